"""EarlyStopping: Lightning's arguments, when it checks and stops, what it says (through the
progress bar, in its numbering), and that every DDP rank stops together."""

from __future__ import annotations

import fcntl
import math
import os
import pty
import re
import struct
import sys
import termios
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from callbacks import EarlyStopping, ModelCheckpoint
from callbacks.early_stopping import EarlyStoppingReason
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
        self.validations = getattr(self, "validations", 0) + (batch_idx == 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def stop_epoch(make_trainer, loader, values, validate=True, trainer_options=None, **kwargs) -> tuple[int, EarlyStopping]:
    """Fit until EarlyStopping(**kwargs) stops; return the epoch it stopped in and the callback."""
    stopper = EarlyStopping(**{"monitor": "val/metric" if validate else "train/metric", **kwargs})
    trainer = make_trainer(max_epochs=len(values), callbacks=[stopper], num_sanity_val_steps=0,
                           limit_val_batches=None if validate else 0, **(trainer_options or {}))
    trainer.fit(Scripted(values), loader, loader if validate else None)
    return trainer.current_epoch - 1, stopper


def test_patience_counts_the_checks_without_improvement(make_trainer, regression_loader, capsys):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 4, 4.5, 4.2, 4.1, 1, 1], patience=3)
    assert epoch == 4 and stopper.stopped_epoch == 4 and stopper.best_score == 4
    assert stopper.stopping_reason is EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert stopper.stopping_reason_message == ("Monitored metric val/metric did not improve in the last 3 records. "
                                               "Best score: 4.000. Signaling Trainer to stop.")
    # Said once, in the progress bar's numbering (its bar reads "Epoch 5/7" then).
    assert capsys.readouterr().err.count("EarlyStopping: ") == 1


def test_the_stop_line_names_the_epoch_as_the_progress_bar_does(make_trainer, regression_loader, capsys):
    stop_epoch(make_trainer, regression_loader, [5, 4, 4.5, 4.2, 4.1, 1, 1], patience=3)
    assert ("EarlyStopping: Monitored metric val/metric did not improve in the last 3 records. Best score: 4.000. "
            "Signaling Trainer to stop. Stopping in epoch 5/7, global step 40.") in capsys.readouterr().err


def test_an_improvement_smaller_than_min_delta_does_not_count(make_trainer, regression_loader):
    epoch, _ = stop_epoch(make_trainer, regression_loader, [5, 4.95, 4.9, 4.85, 1], patience=2, min_delta=0.1)
    assert epoch == 2


def test_mode_max_stops_when_the_metric_stops_rising(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [0.1, 0.5, 0.4, 0.45, 0.9], mode="max", patience=2)
    assert epoch == 3 and stopper.best_score == 0.5


def test_stopping_and_divergence_thresholds_stop_at_once(make_trainer, regression_loader):
    # As in Lightning, the stopping threshold must be passed, not just reached.
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 0.2, 0.1, 0.0], stopping_threshold=0.2)
    assert epoch == 2 and stopper.stopping_reason is EarlyStoppingReason.STOPPING_THRESHOLD
    assert stopper.stopping_reason_message == ("Stopping threshold reached: val/metric = 0.1 < 0.2. Signaling Trainer "
                                               "to stop.")
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 20, 1, 1], divergence_threshold=10.0)
    assert epoch == 1 and stopper.stopping_reason is EarlyStoppingReason.DIVERGENCE_THRESHOLD
    assert stopper.stopping_reason_message == ("Divergence threshold reached: val/metric = 20 > 10.0. Signaling Trainer "
                                               "to stop.")


def test_a_non_finite_metric_stops_unless_check_finite_is_off(make_trainer, regression_loader):
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, math.nan, 1, 1])
    assert epoch == 1 and stopper.stopping_reason is EarlyStoppingReason.NON_FINITE_METRIC
    assert stopper.stopping_reason_message.startswith("Monitored metric val/metric = nan is not finite.")
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, math.nan, 1, 1], check_finite=False, patience=2)
    assert epoch == 3 and stopper.stopping_reason is EarlyStoppingReason.NOT_STOPPED  # the nan was one check without improvement


def test_without_validation_a_training_metric_is_checked_each_epoch(make_trainer, regression_loader):
    epoch, _ = stop_epoch(make_trainer, regression_loader, [3, 2, 2, 2, 2], validate=False, patience=2)
    assert epoch == 3


class LogsAtEpochEnd(Scripted):
    """Logs its metric in on_train_epoch_end, as Lightning's own tests and many projects do."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def on_train_epoch_end(self):
        self.log("train/metric", self.metric())


def test_a_metric_the_module_logs_in_on_train_epoch_end_is_checked_at_that_epoch(make_trainer, regression_loader, tmp_path):
    stopper = EarlyStopping("train/metric", patience=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="train/metric", filename="{epoch}-{train/metric:.0f}",
                                 auto_insert_metric_name=False)
    trainer = make_trainer(max_epochs=10, callbacks=[stopper, checkpoint], limit_val_batches=0)
    trainer.fit(LogsAtEpochEnd([6, 5, 5, 5, 5, 5, 1, 1, 1, 1]), regression_loader)
    assert trainer.current_epoch - 1 == 4 and stopper.stopped_epoch == 4  # Lightning's test_early_stopping_patience_train
    assert checkpoint.best_model_path == str(tmp_path / "1-5.ckpt")  # ranked by the value of the same epoch


def test_with_several_validations_an_epoch_each_one_is_a_check(make_trainer, regression_loader):
    # val_check_interval=0.5: two validations an epoch, so Lightning checks after each (patience counts them)...
    epoch, stopper = stop_epoch(make_trainer, regression_loader, [5, 5, 5, 5], patience=2,
                                trainer_options={"val_check_interval": 0.5})
    assert epoch == 1 and stopper.wait_count == 2  # epoch 0 gives the best and a first miss; epoch 1 the second
    # ... unless told to check at the end of each training epoch.
    epoch, _ = stop_epoch(make_trainer, regression_loader, [5, 5, 5, 5], patience=2, check_on_train_epoch_end=True,
                          trainer_options={"val_check_interval": 0.5})
    assert epoch == 2


def test_verbose_says_each_improvement(make_trainer, regression_loader, capsys):
    stop_epoch(make_trainer, regression_loader, [5, 4, 4], patience=5, verbose=True)
    err = capsys.readouterr().err
    assert "EarlyStopping: Metric val/metric improved. New best score: 5.000" in err
    assert "EarlyStopping: Metric val/metric improved by 1.000 >= min_delta = 0.0. New best score: 4.000" in err
    stop_epoch(make_trainer, regression_loader, [5, 4, 4], patience=5)
    assert "improved" not in capsys.readouterr().err


def test_a_monitor_that_validation_never_logs_is_an_error_unless_not_strict(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=2, callbacks=[EarlyStopping("val/acc")], num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match=r"EarlyStopping\(monitor='val/acc'\) found no such metric at epoch 1/2 "
                                           r"\(logged: \['train/metric', 'val/metric'\]\). .* pass strict=False"):
        trainer.fit(Scripted([1, 1]), regression_loader, regression_loader)
    lenient = EarlyStopping("val/acc", strict=False, verbose=True)
    trainer = make_trainer(max_epochs=2, callbacks=[lenient], num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match=r"EarlyStopping\(monitor='val/acc'\) found no such metric"):
        trainer.fit(Scripted([1, 1]), regression_loader, regression_loader)
    assert trainer.current_epoch == 2 and lenient.wait_count == 0


def test_a_training_metric_not_logged_yet_is_an_error_as_in_lightning(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, callbacks=[EarlyStopping("train/los")], limit_val_batches=0)
    with pytest.raises(RuntimeError, match=r"EarlyStopping\(monitor='train/los'\) found no such metric at epoch 1/1"):
        trainer.fit(Scripted([1]), regression_loader)


def test_the_patience_count_survives_a_restart(make_trainer, regression_loader, tmp_path):
    values = [5, 4, 4.5, 4.6, 4.7, 1]
    first = EarlyStopping("val/metric", patience=3)
    # Listed first, the ModelCheckpoint still saves after EarlyStopping's check of the same epoch (as in Lightning).
    make_trainer(max_epochs=3, callbacks=[ModelCheckpoint(dirpath=tmp_path), first], num_sanity_val_steps=0).fit(
        Scripted(values), regression_loader, regression_loader)
    assert first.wait_count == 1
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"][first.state_key]["wait_count"] == 1
    second = EarlyStopping("val/metric", patience=3)
    trainer = make_trainer(max_epochs=6, callbacks=[second, ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(Scripted(values), regression_loader, regression_loader, ckpt_path=tmp_path / "last.ckpt")
    assert second.stopped_epoch == 4  # two more checks without improvement, not three
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    assert "EarlyStopping{'monitor': 'val/metric', 'mode': 'min'}" in state  # Lightning's key


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"monitor": ""}, r"EarlyStopping\(monitor=''\): use the name of a logged metric"),
    ({"mode": "up"}, r'EarlyStopping\(mode="up"\): use "min" or "max" \(`mode` can be min, max, got up\)'),
    ({"patience": -1}, r"EarlyStopping\(patience=-1\): use an int >= 0"),
    ({"min_delta": "0.1"}, r"EarlyStopping\(min_delta='0.1'\): use a number"),
    ({"stopping_threshold": math.nan}, r"EarlyStopping\(stopping_threshold=nan\): use a number or None"),
    ({"stopping_threshold": 5.0, "divergence_threshold": 1.0},
     r"the stopping threshold must be on the better side of the divergence one"),
    ({"strict": "yes"}, r"EarlyStopping\(strict='yes'\): use True or False"),
    ({"check_on_train_epoch_end": 1}, r"EarlyStopping\(check_on_train_epoch_end=1\): use True, False or None"),
])
def test_bad_early_stopping_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**{"monitor": "val/loss", **kwargs})


class FlatValidation(Scripted):
    def validation_step(self, batch, batch_idx):
        self.log("val/metric", 1.0)


def test_in_a_terminal_the_stop_line_is_written_above_the_bar_not_into_it(regression_loader, monkeypatch):
    # A real pseudo-terminal (80 columns) as stderr, so that the bars draw and redraw as for a user.
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_until_closed, args=(leader, chunks))
    reader.start()
    with os.fdopen(follower, "w", buffering=1) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        # Two validations an epoch: the check runs after each, while the epoch's bar is on screen.
        Trainer(strategy="cpu", max_epochs=5, logger=False, enable_checkpointing=False, report=False,
                enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=0.5,
                callbacks=[EarlyStopping("val/metric", patience=1)]).fit(FlatValidation([1] * 5), regression_loader,
                                                                         regression_loader)
    reader.join(timeout=10)
    screen = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", b"".join(chunks).decode())  # cursor moves between bars
    before, line = screen.split("EarlyStopping: ", 1)
    assert before[-1] in "\r\n", f"the line starts inside the bar: {before[-80:]!r}"
    assert "Stopping in epoch 1/5, global step 8.\r\n" in line
    assert "Epoch 1/5" in before and "Epoch 1/5" in line  # the bar it names was on screen, and is drawn again after


def _read_until_closed(descriptor: int, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(descriptor, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(descriptor)


def test_under_ddp_every_rank_stops_after_the_same_validation(tmp_path, regression_data, capfd):
    # Rank 1's metric stops improving after epoch 1, rank 0's keeps improving: both stop.
    per_rank = [[5, 4, 3, 2, 1, 0], [5, 4, 4, 4, 4, 4]]
    stopper = EarlyStopping("val/metric", patience=2, verbose=True, log_rank_zero_only=True)
    talker = EarlyStopping("val/metric", mode="max", patience=100, verbose=True)  # says its first check on each rank
    trainer = Trainer(strategy=DDP(devices=2), max_epochs=6, callbacks=[stopper, talker], default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    loader = DataLoader(regression_data, batch_size=8)
    trainer.fit(Scripted(per_rank[0], per_rank), loader, loader)
    assert trainer.current_epoch == 4  # rank 1 ran out of patience in epoch 3; rank 0 stopped with it
    assert stopper.stopping_reason_message == "Another rank's metric asked to stop. Signaling Trainer to stop."
    err = capfd.readouterr().err
    assert "[rank: 0] EarlyStopping: Another rank's metric asked to stop. Signaling Trainer to stop. Stopping in epoch 4/6" in err
    assert "[rank: 1] EarlyStopping: Monitored metric val/metric did not improve" not in err  # log_rank_zero_only
    assert "[rank: 0] EarlyStopping: Metric val/metric improved. New best score: 5.000" in err
    assert "[rank: 1] EarlyStopping: Metric val/metric improved. New best score: 5.000" in err  # the talker, every rank
