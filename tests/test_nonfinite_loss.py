"""The non-finite loss guard: a NaN loss stops training naming the batch and the last good
checkpoint, is found at the next log step (no sync per step), and never reaches a checkpoint;
``on_nonfinite_loss="skip"`` skips such steps instead and counts them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from callbacks import Callback, ModelCheckpoint
from linear_regression import LinearRegression
from trainer import Trainer


class PoisonedAt(LinearRegression):
    """Linear regression whose loss is NaN (or inf) at the given (epoch, batch_idx) pairs."""

    def __init__(self, bad: set[tuple[int, int]], value: float = math.nan, manual: bool = False) -> None:
        super().__init__(lr=0.05)
        self.bad, self.value = bad, value
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        if (self.current_epoch, batch_idx) in self.bad:
            loss = loss * self.value
        return loss


class RecordsBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches.append(batch_idx)


def test_a_nan_loss_stops_training_naming_the_batch_and_the_last_good_checkpoint(make_trainer, regression_loader, tmp_path):
    recorder = RecordsBatches()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, filename="{step}", save_top_k=-1)
    trainer = make_trainer(max_epochs=2, log_every_n_steps=5, callbacks=[recorder, checkpoint])
    with pytest.raises(FloatingPointError, match=rf"The training loss is nan at epoch 1, batch 2 \(global step 10\). "
                                                 rf"Training stopped; .* The last good checkpoint is {tmp_path / 'step=10.ckpt'} "
                                                 r"\(global step 10\)"):
        trainer.fit(PoisonedAt({(1, 2)}), regression_loader)
    # Found without a sync per step: before writing step 12's checkpoint, which it then did not write.
    assert recorder.batches[-1] == 3 and trainer.global_step == 12
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["global_step"] == 10
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "step=10.ckpt", "step=2.ckpt", "step=4.ckpt",
                                                                "step=6.ckpt", "step=8.ckpt"]


def test_without_checkpoints_the_nan_is_found_at_the_next_log_step(make_trainer, regression_loader):
    recorder = RecordsBatches()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=5, callbacks=[recorder])
    with pytest.raises(FloatingPointError, match=r"loss is inf at epoch 0, batch 1 \(global step 1\).* No checkpoint was "
                                                 r"written before it"):
        trainer.fit(PoisonedAt({(0, 1)}, value=math.inf), regression_loader)
    assert recorder.batches == [0, 1, 2, 3, 4]  # checked at the log step (5 batches), and the first bad one named


def test_skip_drops_the_steps_with_a_nan_loss_and_counts_them(make_trainer, regression_loader):
    module = PoisonedAt({(0, 2), (0, 5), (1, 0)})
    trainer = make_trainer(max_epochs=2, on_nonfinite_loss="skip")
    with pytest.warns(UserWarning, match=r"Skipped an optimizer step at epoch 0, global step 2: the loss is nan at batch 2"):
        trainer.fit(module, regression_loader)
    assert trainer.num_skipped_steps == 3 and trainer.global_step == 16 - 3
    assert all(torch.isfinite(parameter).all() for parameter in module.parameters())


def test_skip_drops_the_whole_accumulation_window(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=4, on_nonfinite_loss="skip")
    with pytest.warns(UserWarning, match="Skipped an optimizer step"):
        trainer.fit(PoisonedAt({(0, 1)}), regression_loader)
    assert trainer.num_skipped_steps == 1 and trainer.global_step == 1  # of the 2 windows, the first had the nan


def test_ignore_trains_on(make_trainer, regression_loader):
    module = PoisonedAt({(0, 6)})
    make_trainer(max_epochs=1, on_nonfinite_loss="ignore").fit(module, regression_loader)
    assert not torch.isfinite(module.layer.weight).all()


def test_bad_on_nonfinite_loss_values_are_named(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"Trainer\(on_nonfinite_loss='warn'\): use 'raise' .*, 'skip' .* or 'ignore'"):
        Trainer(strategy="cpu", on_nonfinite_loss="warn")
    with pytest.raises(ValueError, match=r"on_nonfinite_loss='skip'\) skips optimizer steps the Trainer takes; with "
                                         r"self.automatic_optimization = False"):
        make_trainer(max_epochs=1, on_nonfinite_loss="skip").fit(PoisonedAt(set(), manual=True), regression_loader)
