"""Lightning's profilers by their names: time each hook and phase of a stage, report it at the end.

``Trainer(profiler="simple")`` (or ``"advanced"``, ``"pytorch"``, or a profiler object) times every
hook of the callbacks and the module, each step method, and two phases, under Lightning's action
names::

    [Callback]ModelCheckpoint{'monitor': ...}.on_train_epoch_end   (the callback's state_key)
    [TrainingModule]Net.on_validation_epoch_end, [TrainingModule]Net.configure_optimizers, ...
    [Strategy]SingleDeviceStrategy.training_step (Lightning calls the steps through its strategy)
    run_training_epoch, run_training_batch (on_train_batch_start to on_train_batch_end)

and writes its report when the stage ends: to ``<dirpath>/<stage>-<filename>[-<rank>].txt`` with
a ``filename`` (``dirpath`` defaults to ``trainer.log_dir``), else to stderr on rank zero
(through Python's ``logging``, the ``"cadence.profilers"`` logger, when the program configured logging, as
Lightning's does). ``trainer.profiler`` is the profiler (a :class:`PassThroughProfiler` when none is set), so a
module or callback can time its own code: ``with self.trainer.profiler.profile("augment"): ...``.

A :class:`Profiler` is not a callback; :class:`ProfiledHooks` is the callback that runs one. At the
stage's ``setup`` it gives the callbacks and the module, for that stage only, a timed version of
each hook (an instance attribute that calls the method between ``profiler.start`` and
``profiler.stop``), and takes them away at ``teardown``. So a run without a profiler pays nothing;
with one, as in Lightning, the hooks that do nothing are called and listed too.
"""

from __future__ import annotations

import abc
import cProfile
import contextlib
import functools
import inspect
import io
import math
import os
import pstats
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from callbacks.base import Callback
from callbacks.console import info, MisconfigurationException, refuse_url

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class Profiler(abc.ABC):
    """Lightning's profiler interface: subclass it and implement ``start`` and ``stop``.

    Args:
        dirpath: the directory of the report file; default ``trainer.log_dir``.
        filename: write the report to ``<dirpath>/<stage>-<filename>[-<rank>].txt`` instead of stderr.

    Example::

        class Wall(Profiler):
            def start(self, action_name): ...
            def stop(self, action_name): ...
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise MisconfigurationException(
                f"{type(self).__name__}(dirpath={dirpath!r}): use a directory path or None.")
        refuse_url(dirpath, f"{type(self).__name__}(dirpath)")
        if filename is not None and not isinstance(filename, str):
            raise MisconfigurationException(
                f"{type(self).__name__}(filename={filename!r}): use a file name (\".txt\" is added) or None.")
        self.dirpath = dirpath
        self.filename = filename
        self._output_file: TextIO | None = None
        self._write_stream: Callable[[str], Any] | None = None
        self._local_rank: int | None = None
        self._stage: str | None = None
        self._module: Any = None  # the running stage's module (ProfiledHooks sets it; PyTorchProfiler reads it)

    @abc.abstractmethod
    def start(self, action_name: str) -> None:
        """Start recording ``action_name``."""

    @abc.abstractmethod
    def stop(self, action_name: str) -> None:
        """Stop recording ``action_name``."""

    def summary(self) -> str:
        """The report, as text."""
        return ""

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """Record the ``with`` body as ``action_name``."""
        try:
            self.start(action_name)
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Called when a stage starts: its name, this process's rank (None with one process) and
        the run's log directory (the default ``dirpath``)."""
        self._stage, self._local_rank = stage, local_rank
        self.dirpath = self.dirpath or log_dir

    def teardown(self, stage: str | None) -> None:
        """Close the report file."""
        self._write_stream = None
        if self._output_file is not None:
            self._output_file.close()
            self._output_file = None

    def describe(self) -> None:
        """Write the report (the file, or stderr on rank zero), then tear down."""
        self._prepare_streams()
        summary = self.summary()
        if summary and self._write_stream is not None:
            self._write_stream(summary)
        if self._output_file is not None:
            self._output_file.flush()
        self.teardown(stage=self._stage)

    @property
    def local_rank(self) -> int:
        return 0 if self._local_rank is None else self._local_rank

    def _prepare_filename(self, action_name: str | None = None, extension: str = ".txt") -> str:
        """``<stage>-<filename>-<rank>-<action>`` with path-unsafe characters made ``_``, as in Lightning."""
        parts = [part for part in (self._stage, self.filename) if part]
        if self._local_rank is not None:
            parts.append(str(self._local_rank))
        if action_name is not None:
            parts.append(action_name)
        base = re.sub(r"_+", "_", re.sub(r"[\\/:*?\"<>|\n\r\t]", "_", "-".join(parts))).strip()
        return (base or "profile") + extension

    def _prepare_streams(self) -> None:
        if self._write_stream is not None:
            return
        if self.filename and self.dirpath:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            self._output_file = open(os.path.join(self.dirpath, self._prepare_filename()), "a")  # noqa: SIM115 (closed at teardown)
            self._write_stream = self._output_file.write
        else:
            self._write_stream = self._print_on_rank_zero

    def _print_on_rank_zero(self, text: str) -> None:
        if self._local_rank in (None, 0):
            info(text, "cadence.profilers")

    def _stats_to_str(self, stats: dict[str, str]) -> str:
        stage = f"{self._stage.upper()} " if self._stage is not None else ""
        output = [stage + "Profiler Report"]
        for action, value in stats.items():
            rank = f" rank: {self._local_rank}" if self._local_rank is not None else ""
            output += [f"Profile stats for: {action}{rank}", value]
        return os.linesep.join(output)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # an open report file does not travel (DDP spawn, deepcopy)
        state["_output_file"] = state["_write_stream"] = state["_module"] = None
        return state


class PassThroughProfiler(Profiler):
    """Records nothing: ``trainer.profiler`` when no profiler is set."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass


class SimpleProfiler(Profiler):
    """The duration of every action; the report gives each one's mean, calls, total and share.

    Args:
        dirpath, filename: see :class:`Profiler`.
        extended: add the columns "Num calls" and "Percentage %" (of the time since construction).

    Example::

        Trainer(profiler="simple")   # or Trainer(profiler=SimpleProfiler(filename="perf"))
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, extended: bool = True) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.extended = extended
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise MisconfigurationException(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        if action_name not in self.current_actions:
            raise MisconfigurationException(
                f"Attempting to stop recording an action ({action_name}) which was never started.")
        self.recorded_durations[action_name].append(end - self.current_actions.pop(action_name))

    def summary(self) -> str:
        """Lightning's table, row for row: widest action first, tab-separated columns."""
        sep = os.linesep
        text = (f"{self._stage.upper()} " if self._stage is not None else "") + f"Profiler Report{sep}"
        if not self.recorded_durations:
            return text
        width = max(len(action) for action in self.recorded_durations)
        columns = ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
        if not self.extended:
            columns = (columns[0], columns[1], columns[3])

        def row(*cells: str) -> str:
            return f"{sep}|  {cells[0]:<{width}s}\t|" + "".join(f"  {cell:<15}\t|" for cell in cells[1:])

        header = row(*columns)
        rule = f"{sep}{'-' * len(header.expandtabs())}"
        text += rule + header + rule
        totals = {action: math.fsum(durations) for action, durations in self.recorded_durations.items()}
        if self.extended:
            elapsed = time.perf_counter() - self.start_time
            calls = sum(len(durations) for durations in self.recorded_durations.values())
            text += row("Total", "-", f"{calls}", f"{elapsed:.5}", "100 %") + rule
            for action in sorted(totals, key=totals.get, reverse=True):
                count = len(self.recorded_durations[action])
                text += row(action, f"{totals[action] / count:.5}", f"{count}", f"{totals[action]:.5}",
                            f"{100.0 * totals[action] / elapsed:.5}")
        else:
            means = {action: totals[action] / len(self.recorded_durations[action]) for action in totals}
            for action in sorted(means, key=means.get, reverse=True):
                text += row(action, f"{means[action]:.5}", f"{totals[action]:.5}")
        return text + rule + sep


class AdvancedProfiler(Profiler):
    """Python's ``cProfile`` for each action: the functions each one called, by cumulative time.

    Args:
        dirpath, filename: see :class:`Profiler`.
        line_count_restriction: functions listed per action: an int, or a fraction of them (0.0-1.0).
        dump_stats: also write each action's raw profile to ``<dirpath>/<action>.prof`` (``pstats``, snakeviz).
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 line_count_restriction: float = 1.0, dump_stats: bool = False) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = defaultdict(cProfile.Profile)
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats

    def start(self, action_name: str) -> None:
        for profile in self.profiled_actions.values():  # nested actions: only the innermost records
            profile.disable()
        self.profiled_actions[action_name].enable()

    def stop(self, action_name: str) -> None:
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            raise MisconfigurationException(
                f"Attempting to stop recording an action ({action_name}) which was never started.")
        profile.disable()

    def summary(self) -> str:
        stats = {}
        for action, profile in self.profiled_actions.items():
            if self.dump_stats:
                if not self.dirpath:
                    raise MisconfigurationException(
                        "AdvancedProfiler(dump_stats=True) writes <dirpath>/<action>.prof: give a dirpath, "
                        "or run it under a Trainer (its log_dir).")
                Path(self.dirpath).mkdir(parents=True, exist_ok=True)
                profile.dump_stats(os.path.join(self.dirpath, self._prepare_filename(action, extension=".prof")))
            text = io.StringIO()
            pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative").print_stats(self.line_count_restriction)
            stats[action] = text.getvalue()
        return self._stats_to_str(stats)

    def teardown(self, stage: str | None) -> None:
        super().teardown(stage=stage)
        self.profiled_actions.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # cProfile objects do not pickle: a copy starts empty
        state["profiled_actions"] = defaultdict(cProfile.Profile)
        return state


#: The module's methods timed, when it overrides them, besides its ``on_*`` hooks (all of which are timed).
MODULE_METHODS = ("configure_optimizers", "optimizer_step", "optimizer_zero_grad", "setup", "teardown")
#: The step methods, timed under Lightning's name for them: the strategy's.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
#: The callbacks' methods timed besides their ``on_*`` hooks.
CALLBACK_METHODS = ("setup", "teardown")
#: Lightning's strategy class for each of Cadence's: Lightning calls the steps through its strategy and
#: names their actions after it (``[Strategy]SingleDeviceStrategy.training_step``); Cadence keeps the names.
LIGHTNING_STRATEGIES = {"SingleDevice": "SingleDeviceStrategy", "MPS": "SingleDeviceStrategy", "DDP": "DDPStrategy",
                        "FSDP": "FSDPStrategy"}


class ProfiledHooks(Callback):
    """Run ``profiler`` over each stage: time the hooks, the steps and the phases; report at the end.

    ``Trainer(profiler=...)`` adds it first among the callbacks, so that the other callbacks'
    hooks, ``setup`` included, are timed. As in Lightning, every hook is timed, also those that do
    nothing (so a per-batch hook nobody implements is called while a profiler runs).
    """

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler
        self._timed: list[tuple[Any, str, Any]] = []  # (object, method name, its instance attribute before)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        local_rank = trainer.global_rank if trainer.world_size > 1 else None
        self.profiler.setup(stage, local_rank=local_rank, log_dir=str(trainer.log_dir) if trainer.log_dir else None)
        self.profiler._module = module
        for callback in trainer.callbacks:
            if callback is not self:
                self._time(callback, _hooks(Callback, CALLBACK_METHODS), f"[Callback]{callback.state_key}")
        # TrainingModule: the last class of the module's that defines training_step (callbacks do not import trainer)
        base = [cls for cls in type(module).__mro__ if "training_step" in vars(cls)][-1]
        self._time(module, [n for n in _hooks(base, MODULE_METHODS) if n.startswith("on_") or _overrides(module, base, n)],
                   f"[{base.__name__}]{type(module).__name__}")
        strategy = type(trainer.strategy).__name__
        self._time(module, [n for n in STEP_METHODS if callable(getattr(module, n, None))],
                   f"[Strategy]{LIGHTNING_STRATEGIES.get(strategy, strategy)}")

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        for obj, name, before in reversed(self._timed):
            if before is _MISSING:
                vars(obj).pop(name, None)
            else:
                vars(obj)[name] = before
        self._timed = []
        self.profiler.describe()
        self.profiler._module = None

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        for action in list(getattr(self.profiler, "current_actions", {})):  # what the error interrupted
            self.profiler.stop(action)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.profiler.start("run_training_epoch")

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self.profiler.stop("run_training_epoch")

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self.profiler.start("run_training_batch")

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.profiler.stop("run_training_batch")

    def _time(self, obj: Any, names: list[str], prefix: str) -> None:
        for name in names:
            self._timed.append((obj, name, vars(obj).get(name, _MISSING)))
            vars(obj)[name] = _timed(self.profiler, f"{prefix}.{name}", getattr(obj, name))


_MISSING = object()


def _hooks(base: type, methods: tuple[str, ...]) -> list[str]:
    """The methods of ``base`` named ``on_*`` or in ``methods``: its hooks (functions, not properties)."""
    return [name for name in dir(base) if (name.startswith("on_") or name in methods)
            and inspect.isfunction(getattr(base, name, None))]


def _overrides(obj: Any, base: type, name: str) -> bool:
    """Whether ``obj``'s class defines ``name`` other than ``base`` does (an instance's own counts)."""
    return name in vars(obj) or getattr(type(obj), name, None) is not getattr(base, name, None)


def _timed(profiler: Profiler, action: str, method: Callable[..., Any]) -> Callable[..., Any]:
    start, stop = profiler.start, profiler.stop

    def timed(*args: Any, **kwargs: Any) -> Any:
        start(action)
        try:
            return method(*args, **kwargs)
        finally:
            stop(action)

    return functools.wraps(method)(timed)  # its name, and signature() sees the method's parameters
