"""Timer: stop training once a time budget is spent, at a step boundary (``Trainer(max_time=...)``).

The budget is checked after optimizer steps (never inside an accumulation window), so the run
ends as a normal end does: the epoch-end hooks run and ``ModelCheckpoint`` writes its checkpoint.
With one process every step is checked. With several, each rank's clock could pass the limit at a
different step, and a rank that stops alone leaves the others waiting at a collective: the ranks
agree at log steps (``Trainer(log_every_n_steps)``), one small collective there and none per step,
so a DDP run stops at most ``log_every_n_steps`` steps after its budget ran out.

The time spent is kept in checkpoints: a run resumed from one continues the same budget (as in
Lightning).
"""

from __future__ import annotations

import datetime
import re
import time
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from callbacks.console import info, MisconfigurationException

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Lightning's stages (``RunningStage``): training, validation and testing are timed; every one is in checkpoints.
STAGES = ("train", "sanity_check", "validate", "test", "predict")


def parse_duration(duration: Any, argument: str = "Timer(duration") -> datetime.timedelta:
    """``duration`` as a timedelta: a ``"DD:HH:MM:SS"`` string, a dict of ``timedelta`` keywords
    (``{"hours": 2}``), or a timedelta. ``argument`` names it in errors."""
    if isinstance(duration, datetime.timedelta):
        parsed = duration
    elif isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if match is None:
            raise MisconfigurationException(
                f"{argument}={duration!r}) is not a duration: a string is in the format DD:HH:MM:SS "
                "(\"00:12:00:00\" is 12 hours). Or use a dict such as {\"hours\": 12}, or a datetime.timedelta.")
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        parsed = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        try:
            parsed = datetime.timedelta(**duration)
        except TypeError as error:
            raise MisconfigurationException(
                f"{argument}={duration!r}): {error}; the keys are datetime.timedelta's (weeks, "
                "days, hours, minutes, seconds, ...).") from None
    else:
        raise MisconfigurationException(
            f"{argument}={duration!r}): use \"DD:HH:MM:SS\", a dict such as {{\"hours\": 12}}, or a "
            "datetime.timedelta.")
    if parsed.total_seconds() < 0:
        raise MisconfigurationException(
            f"{argument}={duration!r}) is a negative duration; use 0 (stop at the first check) or more.")
    return parsed


class Timer(Callback):
    """Measure the time spent training, validating and testing; stop training after ``duration``.

    Args:
        duration: the training budget: ``"DD:HH:MM:SS"``, a dict of ``timedelta`` keywords, a
            ``timedelta``, or None to measure only. 0 stops at the first check (before any step).
        interval: ``"step"`` checks after optimizer steps; ``"epoch"`` at the end of each epoch.
        verbose: print a line on rank zero when the budget stops the run.

    Example::

        timer = Timer(duration="00:12:00:00")   # or Trainer(max_time={"hours": 12})
        ...
        timer.time_elapsed("train"), timer.start_time("validate"), timer.end_time("test")
    """

    def __init__(self, duration: str | datetime.timedelta | dict[str, int] | None = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise MisconfigurationException(
                f'Unsupported parameter value Timer(interval={interval!r}): use "step" or "epoch".')
        self.duration = parse_duration(duration).total_seconds() if duration is not None else None
        self.interval, self.verbose = interval, verbose
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0  # training time of the run this one resumed
        self._step_at_last_batch = 0

    # --- what it measured --------------------------------------------------------------------
    def start_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last started (``time.monotonic()`` seconds), or None."""
        return self._start[_stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """When ``stage`` last ended (``time.monotonic()`` seconds), or None while it runs or before."""
        return self._end[_stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` ("train", "validate" or "test"); training counts resumed runs."""
        stage = _stage(stage)
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    # --- hooks ----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._step_at_last_batch = trainer.global_step
        if self.duration is not None:  # a run resumed with its budget already spent stops at once
            self._check(trainer, agree=True)

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start["train"], self._end["train"] = time.monotonic(), None

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped = trainer.global_step != self._step_at_last_batch
        self._step_at_last_batch = trainer.global_step
        if self.duration is None or self.interval != "step" or not stepped:
            return  # mid accumulation window: stopping here would lose the partial gradients
        if trainer.world_size == 1:
            self._check(trainer, agree=False)
        elif trainer.global_step % trainer.log_every_n_steps == 0:  # every rank has the same global_step
            self._check(trainer, agree=True)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.duration is not None and self.interval == "epoch":
            self._check(trainer, agree=True)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end["train"] = time.monotonic()

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start["validate"], self._end["validate"] = time.monotonic(), None

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end["validate"] = time.monotonic()

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start["test"], self._end["test"] = time.monotonic(), None

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end["test"] = time.monotonic()

    def _check(self, trainer: Trainer, agree: bool) -> None:
        spent = self.time_elapsed() >= self.duration
        if agree:  # each rank read its own clock: stop on every rank, or none
            spent = trainer.strategy.reduce_any(spent)
        if not spent or trainer.should_stop:
            return
        trainer.should_stop = True
        if self.verbose and trainer.is_global_zero:  # Lightning's words, then the limit and the step
            elapsed, limit = (datetime.timedelta(seconds=int(seconds)) for seconds in (self.time_elapsed(), self.duration))
            info(f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop. (Timer: limit {limit}, at "
                 f"global step {trainer.global_step}.)", "cadence.timer")

    # --- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = state_dict.get("time_elapsed", {}).get("train", 0.0)


def _stage(stage: str) -> str:
    if stage not in STAGES:
        raise MisconfigurationException(f"Timer: {stage!r} is not a stage; use one of {', '.join(STAGES)}.")
    return stage
