"""ModelCheckpoint's arguments checked, its triggers resolved (and the clock of its time trigger)
and its file names formatted, as in Lightning.

File names follow Lightning's rules exactly, since users and tools look for them: every
``{name}`` or ``{name:spec}`` field of the filename is a logged metric, ``epoch`` or ``step``;
with ``auto_insert_metric_name`` it becomes ``name=value``, so ``"{epoch}-{val_loss:.3f}"`` names
``epoch=14-val_loss=0.012``. Field names may hold ``/`` and ``.`` (``{val/mAP@0.50:.4f}``); a ``/``
in the formatted name is a subdirectory, as there.
"""

from __future__ import annotations

import math
import os
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import MisconfigurationException, refuse_url, warn

if TYPE_CHECKING:
    from trainer import Trainer


def check_arguments(**arguments: Any) -> None:
    """Raise a ValueError naming the first ModelCheckpoint argument that cannot work, and the fix."""
    dirpath, filename, monitor = arguments["dirpath"], arguments["filename"], arguments["monitor"]
    if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
        raise MisconfigurationException(f"ModelCheckpoint(dirpath={dirpath!r}): use a directory path or None.")
    refuse_url(dirpath, "ModelCheckpoint(dirpath)")
    if filename is not None and not isinstance(filename, str):
        raise MisconfigurationException(
            f"ModelCheckpoint(filename={filename!r}): use a format string like \"{{epoch}}-{{val_loss:.3f}}\".")
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise MisconfigurationException(
            f"ModelCheckpoint(monitor={monitor!r}): use the name of a logged metric, or None.")
    if arguments["mode"] not in ("min", "max"):
        raise MisconfigurationException(
            f'ModelCheckpoint(mode="{arguments["mode"]}"): use "min" or "max" (`mode` can be min, max '
            f'but got {arguments["mode"]}).')
    save_top_k = arguments["save_top_k"]
    if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
        raise MisconfigurationException(
            f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0, or a positive int "
            "(Lightning's: Must be >= -1).")
    if monitor is None and save_top_k not in (-1, 0, 1):
        raise MisconfigurationException(
            f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration: "
            "without a monitored metric there is "
            "nothing to rank k files by. Set monitor=\"...\", or save_top_k=1 (the newest) or -1 (all).")
    if not (arguments["save_last"] in (None, "link") or isinstance(arguments["save_last"], bool)):
        raise MisconfigurationException(
            f"ModelCheckpoint(save_last={arguments['save_last']!r}): use True, False or \"link\".")
    for name in ("verbose", "save_on_exception", "save_weights_only", "auto_insert_metric_name", "enable_version_counter"):
        if not isinstance(arguments[name], bool):
            raise MisconfigurationException(f"ModelCheckpoint({name}={arguments[name]!r}): use True or False.")
    if not (arguments["save_on_train_epoch_end"] is None or isinstance(arguments["save_on_train_epoch_end"], bool)):
        raise MisconfigurationException(
            f"ModelCheckpoint(save_on_train_epoch_end={arguments['save_on_train_epoch_end']!r}): use "
            "True, False or None (decide from the validation schedule).")


def resolve_triggers(every_n_train_steps: Any, every_n_epochs: Any, train_time_interval: Any) -> tuple[int, int, timedelta | None]:
    """``(every_n_train_steps, every_n_epochs, train_time_interval)`` as Lightning resolves them: 0
    means off, and with none of the three given, every epoch."""
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise MisconfigurationException(
                f"ModelCheckpoint({name}={value!r}): use an int >= 0 (0: off) or None (Lightning's: "
                "Must be >= 0).")
    interval = train_time_interval
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and math.isfinite(interval) and interval >= 0:
        interval = timedelta(seconds=interval)
    if interval is not None and (not isinstance(interval, timedelta) or interval < timedelta(0)):
        raise MisconfigurationException(
            f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use a datetime.timedelta "
            "(e.g. timedelta(minutes=30)), seconds >= 0, or None.")
    if every_n_train_steps is None and every_n_epochs is None and interval is None:
        return 0, 1, None
    steps, epochs = every_n_train_steps or 0, every_n_epochs or 0
    if (steps >= 1) + (epochs >= 1) + (interval is not None) > 1:
        raise MisconfigurationException(
            f"ModelCheckpoint(every_n_train_steps={every_n_train_steps}, every_n_epochs={every_n_epochs}, "
            f"train_time_interval={train_time_interval}): give one of them, as in Lightning; for several "
            "schedules, pass one ModelCheckpoint per schedule (their state is kept apart). (Lightning's: Combination "
            "of parameters every_n_train_steps, every_n_epochs and train_time_interval should be mutually exclusive.)")
    return steps, epochs, interval


def format_name(template: str, metrics: dict[str, Any], auto_insert_metric_name: bool, equals: str) -> tuple[str, set[str]]:
    """``template`` filled from ``metrics`` (Lightning's algorithm); also the fields it names that
    ``metrics`` lacks, which are 0 there, as in Lightning."""
    missing: set[str] = set()
    # Longest first, so that {epoch} does not replace the start of {epoch_test}.
    for group in sorted(re.findall(r"(\{.*?)[:\}]", template), key=len, reverse=True):
        name = group[1:]
        if auto_insert_metric_name:
            template = template.replace(group, name + equals + "{" + name)
        template = template.replace(group, f"{{0[{name}]")  # any characters in the name, dots too
        if name not in metrics:
            metrics[name] = 0
            missing.add(name)
    try:
        return template.format(metrics), missing
    except (ValueError, KeyError, IndexError, AttributeError) as error:
        raise MisconfigurationException(
            f"ModelCheckpoint(filename=...) cannot be formatted with {sorted(metrics)}: {error}. Each "
            "{field} is a logged metric, epoch or step, with an optional format spec such as {val_loss:.3f} "
            "or {epoch:02d}.") from None


class TrainTimeClock:
    """``train_time_interval``'s clock: the host's monotonic clock, read once per optimizer step."""

    def __init__(self) -> None:
        self._last_time_checked, self._step_of_time_check = time.monotonic(), 0
        self._next_time_check = 0  # several processes: the optimizer step at which they next compare clocks

    def __eq__(self, other: object) -> bool:  # a pickled copy equals the original, as Lightning's plain attributes do
        return type(other) is type(self) and vars(other) == vars(self)

    def start(self, step: int) -> None:
        self._next_time_check = step
        self.restart(step)

    def restart(self, step: int) -> None:
        self._last_time_checked, self._step_of_time_check = time.monotonic(), step

    def is_due(self, trainer: Trainer, interval: timedelta) -> bool:
        """With several processes each reads its own clock, so they compare at steps planned ahead
        from the step time (at most a twentieth of the interval apart, one small CPU collective
        each); the save is then at most that much late."""
        seconds, elapsed = interval.total_seconds(), time.monotonic() - self._last_time_checked
        if trainer.world_size == 1:
            return elapsed >= seconds
        if trainer.global_step < self._next_time_check:
            return False
        seconds_per_step = elapsed / max(1, trainer.global_step - self._step_of_time_check)
        ahead = max(1, int(seconds / 20 / seconds_per_step)) if seconds_per_step > 0 else 1
        agreed = trainer.strategy.all_reduce(torch.tensor([float(elapsed >= seconds), float(trainer.global_step + ahead)]),
                                             op="max")
        self._next_time_check = int(agreed[1])
        return bool(agreed[0])


class CheckpointNames:
    """ModelCheckpoint's file names (Lightning's class constants and ``format_checkpoint_name``)."""

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1
    dirpath: str | None
    filename: str | None
    auto_insert_metric_name: bool
    _warned: set[str]

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None,
                               prefix: str | None = None) -> str:
        """The path of a checkpoint for ``metrics`` (Lightning's): ``{epoch}`` becomes ``epoch=3``, ``-v2``
        is appended for ``ver``, in ``dirpath``."""
        name = self._format_checkpoint_name(filename or self.filename, dict(metrics), prefix,
                                            self.auto_insert_metric_name)
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        name += self.FILE_EXTENSION
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _format_checkpoint_name(self, filename: str | None, metrics: dict[str, Any], prefix: str | None = None,
                                auto_insert_metric_name: bool = True) -> str:
        logged = sorted(set(metrics) - {"epoch", "step"})
        name, missing = format_name(filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}", metrics,
                                    auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR)
        for field in missing - self._warned:
            self._warned.add(field)
            warn(f"ModelCheckpoint(filename={filename!r}) names {field!r}, which is not among the logged "
                 f"metrics {logged}: it is 0 in the file name, as in "
                 "Lightning. Log it with self.log, or fix the filename.")
        return self.CHECKPOINT_JOIN_CHAR.join([prefix, name]) if prefix is not None else name
