"""EarlyStopping: stop when a monitored metric stops improving (every rank at the same step)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` validation checks.

    Args:
        monitor: the logged metric to watch, e.g. ``"val/loss"``.
        mode: ``"min"`` or ``"max"``.
        patience: checks without improvement before stopping.
        min_delta: the smallest change that counts as an improvement.
        stopping_threshold: stop as soon as the metric is this good.
        divergence_threshold: stop as soon as the metric is this bad.
        check_finite: stop when the metric is NaN or infinite.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_finite: bool = True) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f'EarlyStopping(mode="{mode}"): use "min" or "max".')
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use an int >= 0.")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta = abs(min_delta)
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_finite = check_finite
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopped_epoch = -1
        self.stop_reason = ""

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, value: float, than: float) -> bool:
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.sanity_checking or trainer.stage != "fit":
            return
        if self.monitor not in trainer.callback_metrics:
            raise RuntimeError(
                f"EarlyStopping(monitor={self.monitor!r}) found no such metric; logged metrics are "
                f"{sorted(trainer.callback_metrics)}. Log it in validation_step or change monitor."
            )
        value = float(trainer.callback_metrics[self.monitor])
        reason = self._reason_to_stop(value)
        # Every rank must agree, or one rank waits forever at the next collective.
        if trainer.strategy.reduce_any(bool(reason)):
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stop_reason = reason or "another rank asked to stop"

    def _reason_to_stop(self, value: float) -> str:
        if self.check_finite and not math.isfinite(value):
            return f"{self.monitor} = {value} is not finite"
        if self.stopping_threshold is not None and (
            value <= self.stopping_threshold if self.mode == "min" else value >= self.stopping_threshold
        ):
            return f"{self.monitor} = {value} reached stopping_threshold {self.stopping_threshold}"
        if self.divergence_threshold is not None and (
            value > self.divergence_threshold if self.mode == "min" else value < self.divergence_threshold
        ):
            return f"{self.monitor} = {value} passed divergence_threshold {self.divergence_threshold}"
        if self._better(value, self.best_score):
            self.best_score, self.wait_count = value, 0
            return ""
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return f"{self.monitor} did not improve for {self.wait_count} checks (best {self.best_score:.6g})"
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.best_score = state_dict["best_score"]
        self.stopped_epoch = state_dict["stopped_epoch"]
