"""Checkpoints other tools read and write: what torch's safe loader accepts, Lightning's layout.

A checkpoint holds what ``torch.load(weights_only=True)`` loads: a MultiStepLR's Counter, and a
learning rate a scheduler computed with NumPy (stored as the Python number of the same value), and
a resumed run trains on exactly as the uninterrupted one. It carries Lightning's top-level keys, so
tools that read Lightning checkpoints read it; and a checkpoint in the layout Lightning 2.6 writes
(built here with plain torch: the tests never need Lightning) loads into ``load_from_checkpoint``
and ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from callbacks import Callback, ModelCheckpoint
from linear_regression import LinearRegression


class CosineWarmupScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The warm-up scheduler of a popular tutorial (UvA DL course, notebook 5): its learning rates
    are NumPy floats (``np.cos``), which the optimizer's param_groups then hold."""

    def __init__(self, optimizer, warmup: int, max_iters: int) -> None:
        self.warmup, self.max_num_iters = warmup, max_iters
        super().__init__(optimizer)

    def get_lr(self):
        factor = 0.5 * (1 + np.cos(np.pi * self.last_epoch / self.max_num_iters))
        if self.last_epoch <= self.warmup:
            factor *= self.last_epoch * 1.0 / self.warmup
        return [base_lr * factor for base_lr in self.base_lrs]


class TwoSchedulers(LinearRegression):
    """Adam with two schedulers: the NumPy warm-up each step, MultiStepLR (a Counter) each epoch."""

    def configure_optimizers(self):
        adam = torch.optim.Adam(self.parameters(), lr=0.05)
        return [adam], [{"scheduler": CosineWarmupScheduler(adam, warmup=3, max_iters=40), "interval": "step"},
                        torch.optim.lr_scheduler.MultiStepLR(adam, milestones=[1, 2], gamma=0.5)]


class SaveAtStep(Callback):
    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fresh() -> TwoSchedulers:
    torch.manual_seed(0)
    return TwoSchedulers()


def test_numpy_learning_rates_and_multisteplr_are_saved_and_resume_exactly(make_trainer, regression_loader, tmp_path):
    path = tmp_path / "mid.ckpt"
    reference = _fresh()
    make_trainer(max_epochs=3, callbacks=[SaveAtStep(path, 11)]).fit(reference, regression_loader)
    assert isinstance(reference.trainer.optimizers[0].param_groups[0]["lr"], np.floating)  # what the tutorial does

    state = torch.load(path, weights_only=True)  # torch's own safe loader reads it, no allow-list needed
    adam_lr = state["optimizer_states"][0]["param_groups"][0]["lr"]
    assert type(adam_lr) is float and math.isfinite(adam_lr) and adam_lr > 0
    assert type(state["lr_schedulers"][1]["milestones"]) is collections.Counter

    resumed = _fresh()
    trainer = make_trainer(max_epochs=3)
    trainer.fit(resumed, regression_loader, ckpt_path=path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name  # bit-identical to the uninterrupted run
    assert trainer.lr_scheduler_configs[1].scheduler.milestones == collections.Counter([1, 2])


def test_modelcheckpoint_saves_a_numpy_learning_rate(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(_fresh(), regression_loader)  # refused at its first checkpoint before
    assert (tmp_path / "last.ckpt").is_file()
