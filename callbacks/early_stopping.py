"""EarlyStopping: stop when a monitored metric stops improving (every rank at the same step).

The metric is checked after each validation. A run without validation (monitoring a training
metric) is checked at the end of each training epoch instead. Under DDP the ranks vote
(``strategy.reduce_any``): if any rank's values say stop, every rank stops after the same batch,
so none waits forever at the next collective.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` checks.

    Args:
        monitor: the logged metric to watch, e.g. ``"val/loss"``.
        mode: ``"min"`` or ``"max"``: which values are better.
        patience: checks without improvement before stopping (0: stop at the first one).
        min_delta: an improvement must beat the best value by more than this.
        stopping_threshold: stop as soon as the metric is at least this good.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_finite: stop when the metric is NaN or infinite.

    Example::

        EarlyStopping("val/loss", patience=5, min_delta=1e-3, divergence_threshold=10.0)
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_finite: bool = True) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStopping(monitor={monitor!r}): use the name of a logged metric, e.g. \"val/loss\".")
        if mode not in ("min", "max"):
            raise ValueError(f'EarlyStopping(mode="{mode}"): use "min" or "max".')
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use an int >= 0.")
        for name, value in (("min_delta", min_delta), ("stopping_threshold", stopping_threshold),
                            ("divergence_threshold", divergence_threshold)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)):
                raise ValueError(f"EarlyStopping({name}={value!r}): use a number{'' if name == 'min_delta' else ' or None'}.")
        if min_delta is None:
            raise ValueError("EarlyStopping(min_delta=None): use a number (0.0: any improvement counts).")
        if stopping_threshold is not None and divergence_threshold is not None and (
                stopping_threshold >= divergence_threshold if mode == "min" else stopping_threshold <= divergence_threshold):
            raise ValueError(
                f"EarlyStopping(mode={mode!r}, stopping_threshold={stopping_threshold}, divergence_threshold="
                f"{divergence_threshold}): the stopping threshold must be on the better side of the divergence one."
            )
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta = abs(min_delta)
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_finite = check_finite
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.stop_reason = ""
        self._validated = False  # a validation ran in this fit: check there, not at epoch ends
        self._checked = False

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint is restored, which may set them again
            self._validated = self._checked = False

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.sanity_checking or trainer.stage != "fit":
            return
        self._validated = True
        if self.monitor not in trainer.callback_metrics:
            raise RuntimeError(
                f"EarlyStopping(monitor={self.monitor!r}) found no such metric after validation; logged "
                f"metrics are {sorted(trainer.callback_metrics)}. Log it with self.log or change monitor."
            )
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        # Without validation, a training metric is checked once per epoch. A validation metric
        # not logged yet (check_val_every_n_epoch > 1) is skipped until validation runs.
        if not self._validated and self.monitor in trainer.callback_metrics:
            self._check(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._checked and self.monitor not in trainer.callback_metrics and trainer.is_global_zero:
            warnings.warn(
                f"EarlyStopping(monitor={self.monitor!r}) never checked: the metric was never logged (logged: "
                f"{sorted(trainer.callback_metrics)}). Log it with self.log or change monitor.", stacklevel=2)

    def _check(self, trainer: Trainer) -> None:
        self._checked = True
        value = float(trainer.callback_metrics[self.monitor])
        reason = self._reason_to_stop(value)
        # Every rank must agree, or one rank waits forever at the next collective.
        if trainer.strategy.reduce_any(bool(reason)):
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stop_reason = reason or "another rank's metric asked to stop"
            if trainer.is_global_zero:
                print(f"EarlyStopping: {self.stop_reason}; stopping at epoch {trainer.current_epoch}, "
                      f"global step {trainer.global_step}.", file=sys.stderr)

    def _reason_to_stop(self, value: float) -> str:
        better = "<=" if self.mode == "min" else ">="
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} = {value} is not finite"
        if self.stopping_threshold is not None and (
            value <= self.stopping_threshold if self.mode == "min" else value >= self.stopping_threshold
        ):
            return f"{self.monitor} = {value:.6g} reached stopping_threshold ({better} {self.stopping_threshold})"
        if self.divergence_threshold is not None and (
            value > self.divergence_threshold if self.mode == "min" else value < self.divergence_threshold
        ):
            return f"{self.monitor} = {value:.6g} passed divergence_threshold {self.divergence_threshold}"
        if self._improves(value):
            self.best_score, self.wait_count = value, 0
            return ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return (f"{self.monitor} did not improve for {self.wait_count} checks (best {self.best_score:.6g}, "
                    f"min_delta {self.min_delta})")
        return ""

    def _improves(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch,
                "stop_reason": self.stop_reason, "validated": self._validated, "checked": self._checked}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.best_score = state_dict["best_score"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.stop_reason = state_dict.get("stop_reason", "")
        self._validated = state_dict.get("validated", False)
        self._checked = state_dict.get("checked", False)
