"""EarlyStopping: when it stops, why it says it stopped, and that every DDP rank stops together."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from callbacks import EarlyStopping, ModelCheckpoint
from strategies import DDP
from trainer import Trainer, TrainingModule


class Scripted(TrainingModule):
    """Logs ``val/metric`` (or ``train/metric`` without validation) from a list, one value per epoch."""

    def __init__(self, values: list[float], per_rank: list[list[float]] | None = None) -> None:
        super().__init__()
        self.values, self.per_rank = values, per_rank
        self.layer = nn.Linear(4, 2)

    def metric(self) -> float:
        values = self.per_rank[self.trainer.global_rank] if self.per_rank else self.values
        return values[self.current_epoch]

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("train/metric", self.metric(), on_step=False, on_epoch=True)
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", self.metric())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def stop_epoch(make_trainer, loader, values, validate=True, **kwargs) -> tuple[int, EarlyStopping]:
    """Fit until EarlyStopping(**kwargs) stops; return the epoch it stopped in and the callback."""
    stopper = EarlyStopping(**{"monitor": "val/metric" if validate else "train/metric", **kwargs})
    trainer = make_trainer(max_epochs=len(values), callbacks=[stopper], num_sanity_val_steps=0,
                           limit_val_batches=None if validate else 0)
    trainer.fit(Scripted(values), loader, loader if validate else None)
    return trainer.current_epoch - 1, stopper


def test_patience_counts_the_checks_without_improvement(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 4, 4.5, 4.2, 4.1, 1, 1], patience=3)
    assert epoch == 4 and stopper.stopped_epoch == 4 and stopper.best_score == 4
    assert stopper.stop_reason == "val/metric did not improve for 3 checks (best 4, min_delta 0.0)"


def test_an_improvement_smaller_than_min_delta_does_not_count(make_trainer, regression_loader):
    epoch, _ = stop_epoch(make_trainer, regression_loader, [5, 4.95, 4.9, 4.85, 1], patience=2, min_delta=0.1)
    assert epoch == 2


def test_mode_max_stops_when_the_metric_stops_rising(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [0.1, 0.5, 0.4, 0.45, 0.9], mode="max", patience=2)
    assert epoch == 3 and stopper.best_score == 0.5


def test_stopping_and_divergence_thresholds_stop_at_once(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 0.5, 0.1, 0.0], stopping_threshold=0.2)
    assert epoch == 2 and "reached stopping_threshold (<= 0.2)" in stopper.stop_reason
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 20, 1, 1], divergence_threshold=10.0)
    assert epoch == 1 and "passed divergence_threshold 10.0" in stopper.stop_reason


def test_a_non_finite_metric_stops_unless_check_finite_is_off(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, math.nan, 1, 1])
    assert epoch == 1 and stopper.stop_reason == "val/metric = nan is not finite"
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, math.nan, 1, 1], check_finite=False, patience=2)
    assert epoch == 3 and stopper.stopped_epoch == -1  # the nan counted only as one check without improvement


def test_without_validation_a_training_metric_is_checked_each_epoch(make_trainer, regression_loader):
    epoch, _ = stop_epoch(make_trainer, regression_loader, [3, 2, 2, 2, 2], validate=False, patience=2)
    assert epoch == 3


def test_a_monitor_that_validation_never_logs_is_an_error(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=2, callbacks=[EarlyStopping("val/acc")], num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match=r"EarlyStopping\(monitor='val/acc'\) found no such metric after validation; "
                                           r"logged metrics are \['val/metric'\]"):
        trainer.fit(Scripted([1, 1]), regression_loader, regression_loader)


def test_a_monitor_never_logged_without_validation_warns_at_the_end(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, callbacks=[EarlyStopping("train/los")], limit_val_batches=0)
    with pytest.warns(UserWarning, match=r"EarlyStopping\(monitor='train/los'\) never checked: the metric was never logged"):
        trainer.fit(Scripted([1]), regression_loader)


def test_the_patience_count_survives_a_restart(make_trainer, regression_loader, tmp_path):
    values = [5, 4, 4.5, 4.6, 4.7, 1]
    first = EarlyStopping("val/metric", patience=3)
    make_trainer(max_epochs=3, callbacks=[first, ModelCheckpoint(dirpath=tmp_path)], num_sanity_val_steps=0).fit(
        Scripted(values), regression_loader, regression_loader)
    assert first.wait_count == 1
    second = EarlyStopping("val/metric", patience=3)
    trainer = make_trainer(max_epochs=6, callbacks=[second, ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(Scripted(values), regression_loader, regression_loader, ckpt_path=tmp_path / "last.ckpt")
    assert second.stopped_epoch == 4  # two more checks without improvement, not three


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"monitor": ""}, r"EarlyStopping\(monitor=''\): use the name of a logged metric"),
    ({"mode": "up"}, r'EarlyStopping\(mode="up"\): use "min" or "max"'),
    ({"patience": -1}, r"EarlyStopping\(patience=-1\): use an int >= 0"),
    ({"min_delta": "0.1"}, r"EarlyStopping\(min_delta='0.1'\): use a number"),
    ({"stopping_threshold": math.nan}, r"EarlyStopping\(stopping_threshold=nan\): use a number or None"),
    ({"stopping_threshold": 5.0, "divergence_threshold": 1.0},
     r"the stopping threshold must be on the better side of the divergence one"),
])
def test_bad_early_stopping_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**{"monitor": "val/loss", **kwargs})


def test_under_ddp_every_rank_stops_after_the_same_validation(tmp_path, regression_data):
    # Rank 1's metric stops improving after epoch 1, rank 0's keeps improving: both stop.
    per_rank = [[5, 4, 3, 2, 1, 0], [5, 4, 4, 4, 4, 4]]
    stopper = EarlyStopping("val/metric", patience=2)
    trainer = Trainer(strategy=DDP(devices=2), max_epochs=6, callbacks=[stopper], default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    loader = DataLoader(regression_data, batch_size=8)
    trainer.fit(Scripted(per_rank[0], per_rank), loader, loader)
    assert trainer.current_epoch == 4  # rank 1 ran out of patience in epoch 3; rank 0 stopped with it
    assert stopper.stop_reason == "another rank's metric asked to stop"  # rank zero's view, handed back
