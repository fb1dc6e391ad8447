"""The oracle: Trainer.fit computes exactly what a hand-written PyTorch loop computes.

Same initial weights, same data order, same optimizer: the weights after ``fit`` must be
bit-identical (``torch.equal``) to the ten-line loop's, with gradient accumulation, clipping
(norm and value) and LR schedulers stepped per optimizer step or per epoch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from trainer import TrainingModule

EPOCHS = 3


def make_optimizer(parameters, scheduler: str | None):
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if scheduler == "step":
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    if scheduler == "epoch":
        return optimizer, torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    return optimizer, None


class Linear(TrainingModule):
    def __init__(self, initial_state, scheduler):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.layer.load_state_dict(initial_state)
        self.scheduler = scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.parameters(), self.scheduler)
        if scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler}}


def hand_written_loop(initial_state, loader, accumulate, clip_val, clip_algorithm, scheduler_kind):
    layer = nn.Linear(4, 2)
    layer.load_state_dict(initial_state)
    optimizer, scheduler = make_optimizer(layer.parameters(), scheduler_kind)
    for _ in range(EPOCHS):
        for batch_idx, (x, y) in enumerate(loader):
            loss = F.mse_loss(layer(x), y)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == len(loader):
                if clip_val is not None and clip_algorithm == "norm":
                    torch.nn.utils.clip_grad_norm_(list(layer.parameters()), clip_val)
                elif clip_val is not None:
                    torch.nn.utils.clip_grad_value_(list(layer.parameters()), clip_val)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if scheduler_kind == "step":
                    scheduler.step()
        if scheduler_kind == "epoch":
            scheduler.step()
    return layer.state_dict()


def shuffled_loader(dataset):
    # Each side gets its own generator with the same seed: the same data order, drawn independently.
    return DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(
    "accumulate, clip_val, clip_algorithm, scheduler",
    [
        (1, None, "norm", None),
        (3, None, "norm", None),  # 8 batches: windows of 3, 3 and a last partial window of 2
        (1, 0.05, "norm", None),
        (1, 0.01, "value", None),
        (1, None, "norm", "step"),
        (1, None, "norm", "epoch"),
        (2, 0.05, "norm", "step"),
    ],
)
def test_fit_gives_the_same_weights_as_a_hand_written_loop(
    make_trainer, regression_data, accumulate, clip_val, clip_algorithm, scheduler
):
    torch.manual_seed(0)
    initial_state = {k: v.clone() for k, v in nn.Linear(4, 2).state_dict().items()}
    expected = hand_written_loop(initial_state, shuffled_loader(regression_data), accumulate, clip_val, clip_algorithm, scheduler)

    module = Linear(initial_state, scheduler)
    trainer = make_trainer(max_epochs=EPOCHS, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip_val, gradient_clip_algorithm=clip_algorithm)
    trainer.fit(module, shuffled_loader(regression_data))

    for name, value in expected.items():
        assert torch.equal(module.layer.state_dict()[name], value), name
    assert trainer.global_step == EPOCHS * -(-8 // accumulate)  # optimizer steps, ceil(8 / accumulate) per epoch


def test_clipping_in_the_oracle_cases_actually_clips(regression_data):
    # Guards the oracle: if the clip values never bit, the clipped cases would prove nothing.
    torch.manual_seed(0)
    initial_state = {k: v.clone() for k, v in nn.Linear(4, 2).state_dict().items()}
    unclipped = hand_written_loop(initial_state, shuffled_loader(regression_data), 1, None, "norm", None)
    for clip_val, algorithm in ((0.05, "norm"), (0.01, "value")):
        clipped = hand_written_loop(initial_state, shuffled_loader(regression_data), 1, clip_val, algorithm, None)
        assert not torch.equal(clipped["weight"], unclipped["weight"])


class Regressor(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def test_the_loss_falls_on_a_learnable_problem(make_trainer, regression_loader):
    torch.manual_seed(0)
    module = Regressor()
    x, y = regression_loader.dataset.tensors
    before = F.mse_loss(module.layer(x), y).item()
    trainer = make_trainer(max_epochs=20)
    trainer.fit(module, regression_loader)
    after = F.mse_loss(module.layer(x), y).item()
    assert after < 0.05 * before
    assert trainer.callback_metrics["train/loss_epoch"] < 0.05 * before
