"""Lightning's read-only Trainer members, as views of what the Trainer holds.

Each is computed from the Trainer's public state (its strategy, callbacks, limits, stage) every time
it is read; none holds state of its own, and none is read by the loop. The Trainer inherits them
from :class:`TrainerProperties` so that ``trainer/trainer.py`` stays the loop; jump-to-definition
lands here. Lightning's names and meanings (``trainer/trainer.py`` of Lightning 2.6).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import callbacks as callbacks_package
from trainer.log_dir import preview_log_dir

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class TrainerProperties:
    """Read-only views (Lightning's names) that :class:`trainer.Trainer` inherits."""

    # --- where this process is: the strategy's answers
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    global_rank = property(lambda self: self.strategy.global_rank)
    local_rank = property(lambda self: self.strategy.local_rank)
    world_size = property(lambda self: self.strategy.world_size)
    num_nodes = property(lambda self: getattr(self.strategy, "num_nodes", 1))

    @property
    def node_rank(self: Trainer) -> int:
        """This machine's index among ``num_nodes`` (torchrun's ``GROUP_RANK``, or ``NODE_RANK``)."""
        for variable in ("GROUP_RANK", "NODE_RANK"):
            if os.environ.get(variable, "").isdigit():
                return int(os.environ[variable])
        return 0

    @property
    def num_devices(self: Trainer) -> int:
        """Devices (processes) per machine."""
        return max(1, self.world_size // max(1, self.num_nodes)) if self.world_size > 1 else \
            getattr(self.strategy, "num_processes", 1)

    @property
    def device_ids(self: Trainer) -> list[int]:
        """The indices of this machine's devices, as Lightning lists them ([0, 1] for two processes)."""
        devices = getattr(self.strategy, "devices", None)
        if isinstance(devices, list):
            return list(devices)
        device = getattr(self.strategy, "device", None)
        if self.num_devices == 1 and getattr(device, "index", None) is not None:
            return [device.index]
        return list(range(self.num_devices))

    # --- the callbacks that play a named role, in the order given
    progress_bar_callback = property(lambda self: next(iter(self._callbacks_of(callbacks_package.ProgressBar)), None))
    loggers = property(lambda self: self._callbacks_of(callbacks_package.Logger))
    logger = property(lambda self: next(iter(self.loggers), None))
    checkpoint_callbacks = property(lambda self: self._callbacks_of(callbacks_package.Checkpoint))
    checkpoint_callback = property(lambda self: next(iter(self.checkpoint_callbacks), None))
    early_stopping_callbacks = property(lambda self: self._callbacks_of(callbacks_package.EarlyStopping))
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None))

    def _callbacks_of(self: Trainer, kind: type) -> list[Any]:
        return [callback for callback in self.callbacks if isinstance(callback, kind)]

    # --- the metric store's values (trainer/metrics.py), and the non-finite guard's count
    callback_metrics = property(lambda self: self.metrics.callback_metrics)
    progress_bar_metrics = property(lambda self: self.metrics.progress_bar_metrics)
    logged_metrics = property(lambda self: self.metrics.logged_metrics)
    num_skipped_steps = property(lambda self: self._guard.skipped)  # steps on_nonfinite_loss="skip" skipped
    profiler = property(lambda self: callbacks_package.profiler_of(self.callbacks))  # a PassThroughProfiler if none
    interrupted = property(lambda self: self._preemption.interrupted)  # the last stage ended by an error or a signal

    # --- what runs now: Lightning's TrainerState.stage as booleans
    training = property(lambda self: self.stage == "fit" and self._evaluation_stage is None)
    validating = property(lambda self: self._evaluation_stage == "validate" and not self.sanity_checking)
    testing = property(lambda self: self._evaluation_stage == "test")
    predicting = property(lambda self: self._evaluation_stage == "predict")
    evaluating = property(lambda self: self._evaluation_stage in ("validate", "test") and not self.sanity_checking)

    # --- the arguments, as Lightning reports them
    limit_train_batches = property(lambda self: _limit(self.limits["train"]))
    limit_val_batches = property(lambda self: _limit(self.limits["validate"]))
    limit_test_batches = property(lambda self: _limit(self.limits["test"]))
    limit_predict_batches = property(lambda self: _limit(self.limits["predict"]))
    enable_validation = property(lambda self: self.limits["validate"] != 0)

    @property
    def num_sanity_val_batches(self: Trainer) -> list[int | float]:
        """The sanity check's batches per validation loader."""
        steps = math.inf if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
        return [min(steps, count) for count in self.num_val_batches]

    @property
    def log_dir(self: Trainer) -> Path:
        """The run's directory (``<first logger's save_dir>/<name>/version_<N>``; trainer/log_dir.py): the
        running or last stage's, and before any, the one the next stage will take."""
        if self._log_dir is not None:
            return self._log_dir
        return preview_log_dir(self.loggers, self.default_root_dir)

    @log_dir.setter
    def log_dir(self: Trainer, value: Path | None) -> None:
        self._log_dir = value


def _limit(value: int | float | None) -> int | float:
    return 1.0 if value is None else value
