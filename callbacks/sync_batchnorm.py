"""SyncBatchNorm: batch normalization over the global batch of every DDP rank (``Trainer(sync_batchnorm=True)``).

Each ``BatchNorm*d`` layer becomes a ``torch.nn.SyncBatchNorm`` that keeps the same parameters and
buffers (so the state_dict keys do not change), in place, in the callbacks' ``configure_model``
seam: after the module moved to its device and before the strategy wraps it for DDP. It costs one
all-reduce per layer per forward, so it changes nothing with one process, where it is left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class SyncBatchNorm(Callback):
    """Synchronize batch normalization statistics across DDP processes."""

    def __init__(self) -> None:
        self._world_size = 1

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._world_size = trainer.world_size

    def configure_model(self, model: nn.Module) -> nn.Module:
        if self._world_size > 1:
            for name, child in model.named_children():  # the root is the TrainingModule, never a BatchNorm
                setattr(model, name, torch.nn.SyncBatchNorm.convert_sync_batchnorm(child))
        return model
