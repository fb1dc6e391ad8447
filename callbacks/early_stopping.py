"""EarlyStopping: Lightning's callback of that name; every rank stops at the same step.

When it checks follows Lightning: at the end of each training epoch (after that epoch's
validation) when validation runs once an epoch, or else after each validation
(``check_on_train_epoch_end`` overrides). Under DDP the ranks vote (``strategy.reduce_any``): if
any rank's value says stop, every rank stops after the same batch, so none waits forever at the
next collective. Why it stopped is said on stderr through the progress bar, in the bar's epoch
numbering, and kept in ``stopping_reason`` and ``stopping_reason_message``.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.console import epoch_label, MisconfigurationException, rank_prefixed, warn, write_line

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class EarlyStoppingReason(Enum):
    """Why training stopped (Lightning's enum)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks. Arguments as Lightning's.

    Args:
        monitor: the logged metric to watch, e.g. ``"val_loss"``.
        min_delta: an improvement must beat the best value by more than this.
        patience: checks without improvement before stopping (0: stop at the first one).
        verbose: also say each improvement (the reason for stopping is always said, on rank zero).
        mode: ``"min"`` or ``"max"``: which values are better.
        strict: a check that finds no ``monitor`` among the logged metrics is an error; False skips it.
        check_finite: stop when the metric is NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of the training epoch (True) or after each
            validation (False); None: as Lightning decides, True when validation runs once an epoch.
        log_rank_zero_only: with several processes, only rank zero says what it found (each
            rank's lines are prefixed ``[rank: N]`` otherwise).

    Example::

        EarlyStopping("val_loss", patience=5, min_delta=1e-3, divergence_threshold=10.0)
    """

    monitors_metrics = True  # its on_train_epoch_end sees what the module's logged
    mode_dict = {"min": torch.lt, "max": torch.gt}
    order_dict = {"min": "<", "max": ">"}

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationException(
                f"EarlyStopping(monitor={monitor!r}): use the name of a logged metric, e.g. \"val_loss\".")
        if mode not in self.mode_dict:
            raise MisconfigurationException(
                f'EarlyStopping(mode="{mode}"): use "min" or "max" (`mode` can be min, max, got {mode}).')
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise MisconfigurationException(f"EarlyStopping(patience={patience!r}): use an int >= 0.")
        for name, value in (("min_delta", min_delta), ("stopping_threshold", stopping_threshold),
                            ("divergence_threshold", divergence_threshold)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)):
                raise MisconfigurationException(
                    f"EarlyStopping({name}={value!r}): use a number{'' if name == 'min_delta' else ' or None'}.")
        if min_delta is None:
            raise MisconfigurationException(
                "EarlyStopping(min_delta=None): use a number (0.0: any improvement counts).")
        if stopping_threshold is not None and divergence_threshold is not None and (
                stopping_threshold >= divergence_threshold if mode == "min" else stopping_threshold <= divergence_threshold):
            raise MisconfigurationException(
                f"EarlyStopping(mode={mode!r}, stopping_threshold={stopping_threshold}, divergence_threshold="
                f"{divergence_threshold}): the stopping threshold must be on the better side of the divergence one.")
        for name, value in (("verbose", verbose), ("strict", strict), ("check_finite", check_finite),
                            ("log_rank_zero_only", log_rank_zero_only)):
            if not isinstance(value, bool):
                raise MisconfigurationException(f"EarlyStopping({name}={value!r}): use True or False.")
        if not (check_on_train_epoch_end is None or isinstance(check_on_train_epoch_end, bool)):
            raise MisconfigurationException(
                f"EarlyStopping(check_on_train_epoch_end={check_on_train_epoch_end!r}): use True, False "
                "or None (decide from the validation schedule).")
        self.monitor, self.mode, self.patience, self.verbose, self.strict = monitor, mode, patience, verbose, strict
        self.min_delta = abs(min_delta)
        self.check_finite = check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.log_rank_zero_only = log_rank_zero_only
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def monitor_op(self) -> Any:
        return self.mode_dict[self.mode]

    @property
    def state_key(self) -> str:
        key = {"monitor": self.monitor, "mode": self.mode}  # Lightning's key: its checkpoints' state is found
        return f"{type(self).__qualname__}{key!r}"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self._check_on_train_epoch_end is None:  # as Lightning: decided once, from the validation schedule
            self._check_on_train_epoch_end = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._check_on_train_epoch_end and trainer.stage == "fit":
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._check_on_train_epoch_end and trainer.stage == "fit" and not trainer.sanity_checking:
            self._run_early_stopping_check(trainer)

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        metrics = trainer.callback_metrics
        if trainer.fast_dev_run:  # as Lightning: a smoke test stops by itself
            return
        if self.monitor not in metrics:
            message = (f"EarlyStopping(monitor={self.monitor!r}) found no such metric at {epoch_label(trainer).lower()} "
                       f"(logged: {sorted(metrics)}). Log it with self.log, change monitor, or pass strict=False to "
                       "skip checks without it.")
            if self.strict:
                raise RuntimeError(message)
            if self.verbose:
                warn(message, RuntimeWarning)
        current = torch.as_tensor(float(metrics[self.monitor])) if self.monitor in metrics else None
        mine, reason = self._evaluate_stopping_criteria(current) if current is not None else (False, None)
        # Every rank must agree, or one rank waits forever at the next collective.
        stop = trainer.strategy.reduce_any(mine)
        trainer.should_stop = trainer.should_stop or stop
        if stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason if mine else "Another rank's metric asked to stop. Signaling Trainer to stop."
            if not mine:
                self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED  # another rank's reason, unknown here
        speak = trainer.is_global_zero or (self.verbose and not self.log_rank_zero_only)
        if speak and reason and self.verbose and not mine:
            write_line(trainer, rank_prefixed(trainer, f"EarlyStopping: {reason}"))
        if speak and stop:
            write_line(trainer, rank_prefixed(trainer, f"EarlyStopping: {self.stopping_reason_message} Stopping in "
                                                       f"{epoch_label(trainer).lower()}, global step {trainer.global_step}."))

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> tuple[bool, str | None]:
        """Lightning's rules and reasons, in its order."""
        monitor, better = self.monitor, self.monitor_op
        if self.check_finite and not torch.isfinite(current):
            self.stopping_reason = EarlyStoppingReason.NON_FINITE_METRIC
            return True, (f"Monitored metric {monitor} = {current.item()} is not finite. Previous best value was "
                          f"{self.best_score:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and better(current, self.stopping_threshold):
            self.stopping_reason = EarlyStoppingReason.STOPPING_THRESHOLD
            return True, (f"Stopping threshold reached: {monitor} = {current.item():.6g} {self.order_dict[self.mode]} "
                          f"{self.stopping_threshold}. Signaling Trainer to stop.")
        if self.divergence_threshold is not None and better(-current, -self.divergence_threshold):
            self.stopping_reason = EarlyStoppingReason.DIVERGENCE_THRESHOLD
            worse = self.order_dict["max" if self.mode == "min" else "min"]
            return True, (f"Divergence threshold reached: {monitor} = {current.item():.6g} {worse} "
                          f"{self.divergence_threshold}. Signaling Trainer to stop.")
        delta = -self.min_delta if self.mode == "min" else self.min_delta
        if better(current - delta, self.best_score):
            improved = (f"Metric {monitor} improved by {abs(self.best_score - current):.3f} >= min_delta = "
                        f"{self.min_delta}. New best score: {current:.3f}") if torch.isfinite(self.best_score) else (
                        f"Metric {monitor} improved. New best score: {current:.3f}")
            self.best_score, self.wait_count = current, 0
            return False, improved
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
            return True, (f"Monitored metric {monitor} did not improve in the last {self.wait_count} records. Best "
                          f"score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, None

    def state_dict(self) -> dict[str, Any]:
        # "patience" is kept for Lightning's readers; on restore the patience given to this callback wins.
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch, "best_score": self.best_score,
                "patience": self.patience, "stopping_reason": self.stopping_reason.value,
                "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = max(0, state_dict["stopped_epoch"])
        self.best_score = torch.as_tensor(state_dict["best_score"])
        self.stopping_reason = EarlyStoppingReason(state_dict.get("stopping_reason", 0))
        self.stopping_reason_message = state_dict.get("stopping_reason_message")

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        # Checkpoints of Cadence before Lightning's state keys name this callback by monitor and mode.
        states = checkpoint.get("callbacks", {})
        legacy = f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"
        if self.state_key not in states and legacy in states:
            states[self.state_key] = states.pop(legacy)
