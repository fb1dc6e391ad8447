"""The small problem most tests train on: ``y = x @ w`` with 4 inputs and 2 outputs.

- :class:`LinearRegression`, the module: one ``nn.Linear(4, 2)`` named ``layer``, the MSE loss on
  ``(x, y)`` batches, SGD. A test that needs more (logging, recording what ran, a hook) subclasses it
  and overrides only that, so that what the test adds is all it shows.
- :func:`regression_samples`, the data: ``count`` inputs and their targets (``conftest``'s
  ``regression_data`` fixture holds the default 64 as a TensorDataset).
- :class:`IndexedRegression`, the same data as ``(index, x, y)``, for tests that check which samples
  each rank trained on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainer import TrainingModule


class LinearRegression(TrainingModule):
    """``nn.Linear(4, 2)`` (``self.layer``) trained on ``(x, y)`` batches: MSE loss, SGD at ``lr``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualLinearRegression(LinearRegression):
    """The same under manual optimization, written as Lightning's docs write it: zero_grad, manual_backward, step;
    ``training_step`` returns nothing."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def regression_samples(count: int = 64, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``count`` rows of 4 standard normal values) and ``y = x @ w``, with ``w`` (4 x 2) drawn
    after ``x`` from the same seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 4, generator=generator)
    return x, x @ torch.randn(4, 2, generator=generator)


class IndexedRegression(Dataset):
    """``(index, x, y)``: the samples of ``regression_samples(count, seed)`` with their index, which
    tells which samples a rank trained on."""

    def __init__(self, count: int = 64, seed: int = 1234) -> None:
        self.x, self.y = regression_samples(count, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]
