"""Process-wide PyTorch settings for a run: ``Trainer(benchmark=...)`` and ``Trainer(detect_anomaly=...)``.

They are per-process flags, so they are set in every process of the run (a spawned DDP worker does
not inherit them) when a stage sets up, and put back as they were when it ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.console import warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class TorchFlags(Callback):
    """Set ``torch.backends.cudnn.benchmark`` and autograd's anomaly detection for the run.

    Args:
        cudnn_benchmark: let cuDNN time its convolution algorithms for each input shape and keep the
            fastest (faster for fixed shapes, slower when shapes vary); None leaves it as it is.
        detect_anomaly: make backward name the forward operation that produced a NaN (much slower;
            for debugging).
    """

    def __init__(self, cudnn_benchmark: bool | None = None, detect_anomaly: bool = False) -> None:
        self.cudnn_benchmark, self.detect_anomaly = cudnn_benchmark, detect_anomaly
        self._previous: dict[str, Any] = {}

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._previous = {"benchmark": torch.backends.cudnn.benchmark, "anomaly": torch.is_anomaly_enabled()}
        if self.cudnn_benchmark is not None:
            if self.cudnn_benchmark and trainer.deterministic and trainer.is_global_zero:
                warn("Trainer(benchmark=True, deterministic=True): cuDNN's benchmark mode picks algorithms "
                     "by timing, so results may vary between runs.")
            torch.backends.cudnn.benchmark = self.cudnn_benchmark
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(True)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self._previous:  # empty when the stage failed before setup
            torch.backends.cudnn.benchmark = self._previous["benchmark"]
            torch.autograd.set_detect_anomaly(self._previous["anomaly"])
        self._previous = {}
