"""Timer as in Lightning: a zero budget, start/end times per stage, its message, max_time beside a Timer."""

from __future__ import annotations

import datetime
import logging

import pytest
import torch.nn.functional as F
from linear_regression import LinearRegression

from callbacks import Timer
from trainer import Trainer


class Validated(LinearRegression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_zero_duration_stops_before_the_first_step_and_says_so(make_trainer, regression_loader, interval, caplog):
    trainer = make_trainer(max_epochs=3, callbacks=[Timer(duration=datetime.timedelta(0), interval=interval)])
    with caplog.at_level(logging.INFO):  # pytest configures logging: the line goes there, as Lightning's
        trainer.fit(LinearRegression(), regression_loader)
    assert (trainer.global_step, trainer.current_epoch) == (0, 0)
    assert "Time limit reached. Elapsed time is 0:00:00. Signaling Trainer to stop. (Timer: limit 0:00:00, at global " \
           "step 0.)" in caplog.text


def test_start_and_end_times_of_each_stage(make_trainer, regression_loader):
    timer = Timer()
    assert timer.start_time() is None and timer.end_time("validate") is None and timer.time_remaining() is None
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(Validated(), regression_loader, regression_loader)
    train_start, train_end = timer.start_time("train"), timer.end_time("train")
    assert train_start < timer.start_time("validate") < timer.end_time("validate") <= train_end
    assert timer.time_elapsed() == pytest.approx(train_end - train_start)
    assert timer.start_time("test") is None and timer.time_elapsed("test") == 0
    trainer.test(dataloaders=regression_loader, ckpt_path=None)
    assert train_end < timer.start_time("test") < timer.end_time("test")
    assert set(timer.state_dict()["time_elapsed"]) == {"train", "sanity_check", "validate", "test", "predict"}
    with pytest.raises(ValueError, match=r"Timer: 'training' is not a stage; use one of train, sanity_check, validate"):
        timer.start_time("training")


def test_max_time_beside_a_timer_leaves_the_timer_in_charge_and_says_so(caplog):
    timer = Timer(duration={"seconds": 5})
    with caplog.at_level(logging.INFO):
        trainer = Trainer(strategy="cpu", max_time={"seconds": 1337}, callbacks=[timer])
    assert [c for c in trainer.callbacks if isinstance(c, Timer)] == [timer]
    assert trainer.max_epochs == -1  # as in Lightning: a time limit was asked for
    assert "Trainer(max_time={'seconds': 1337}) is not used: the callbacks list already contains a Timer" in caplog.text
    with pytest.raises(ValueError, match=r"Trainer\(max_time='1:00'\) is not a duration"):
        Trainer(strategy="cpu", max_time="1:00", callbacks=[Timer()])
