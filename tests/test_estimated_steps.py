"""``trainer.estimated_stepping_batches`` in ``configure_optimizers``, as Lightning's tutorials size
their warm-up and OneCycle schedules with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer, TrainingModule


class LinearWarmup(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.total_steps = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total_steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=self.total_steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}]


def quiet_trainer(tmp_path, **options) -> Trainer:
    return Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, report=False, **options)


LOADER = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)


def test_with_max_steps_alone_the_estimate_is_max_steps(tmp_path):
    model = LinearWarmup()
    quiet_trainer(tmp_path, max_steps=6).fit(model, LOADER)
    assert model.total_steps == 6


def test_with_an_epoch_bound_the_estimate_is_an_error_saying_what_to_use_instead(tmp_path):
    with pytest.raises(RuntimeError, match=r"trainer.estimated_stepping_batches: Cadence builds the training loader "
                                           r"after configure_optimizers(.|\n)*Trainer\(max_steps=N\)"):
        quiet_trainer(tmp_path, max_epochs=2).fit(LinearWarmup(), LOADER)
