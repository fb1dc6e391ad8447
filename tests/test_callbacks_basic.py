"""The Callback base, the default callbacks, the progress bar and the log directory layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from callbacks import (
    Callback, CSVLogger, EarlyStopping, ModelCheckpoint, ModelSummary, PerformanceReport, ProgressBar, TensorBoardLogger,
)
from linear_regression import LinearRegression
from trainer import Trainer


class Model(LinearRegression):
    """Logs its training and validation loss to the progress bar."""

    def __init__(self):
        super().__init__(lr=0.05)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.layer(x), y), prog_bar=True)


def test_a_plain_callback_changes_nothing(make_trainer, regression_loader):
    torch.manual_seed(0)
    plain = Model()
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    make_trainer(max_epochs=1, callbacks=Callback()).fit(plain, regression_loader, regression_loader)
    without = Model()
    without.load_state_dict(initial)
    make_trainer(max_epochs=1).fit(without, regression_loader, regression_loader)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in without.state_dict().items())
    assert Callback().state_key == "Callback" and Callback().state_dict() == {}


def test_the_default_trainer_adds_a_progress_bar_loggers_and_checkpoints():
    kinds = [type(callback) for callback in Trainer(strategy="cpu").callbacks]
    assert kinds == [TensorBoardLogger, CSVLogger, ProgressBar, ModelCheckpoint, ModelSummary, PerformanceReport]
    quiet = Trainer(strategy="cpu", enable_progress_bar=False, enable_checkpointing=False, logger=False,
                    enable_model_summary=False, report=False)
    assert quiet.callbacks == []


def test_a_users_own_progress_bar_or_checkpoint_replaces_the_default():
    bar, checkpoint = ProgressBar(refresh_rate=5), ModelCheckpoint(monitor="val/loss")
    trainer = Trainer(strategy="cpu", logger=False, callbacks=[checkpoint, bar], enable_model_summary=False,
                      report=False)
    assert trainer.callbacks == [bar, checkpoint]  # as in Lightning, checkpoints run after the other callbacks


def test_two_callbacks_with_the_same_state_key_are_refused_unless_they_have_no_state():
    with pytest.raises(RuntimeError, match=r"more than one stateful callback of type `EarlyStopping`.*share the "
                                           r"checkpoint key .*EarlyStopping"):
        Trainer(strategy="cpu", callbacks=[EarlyStopping("val/loss"), EarlyStopping("val/loss")])
    stateless = [Callback(), Callback()]  # as in Lightning (two loggers of one class, say): nothing to lose
    assert all(callback in Trainer(strategy="cpu", callbacks=stateless).callbacks for callback in stateless)


def test_progress_bar_arguments_are_checked_and_one_bar_is_allowed():
    with pytest.raises(ValueError, match=r"ProgressBar\(refresh_rate=-1\): use an int >= 0 \(0 turns the bars off\)"):
        ProgressBar(refresh_rate=-1)
    with pytest.raises(ValueError, match=r"ProgressBar\(process_position=1.5\): use an int >= 0"):
        ProgressBar(process_position=1.5)
    with pytest.raises(ValueError, match=r"^You added multiple progress bar callbacks to the Trainer: .*holds 2 progress bars \(ProgressBar, ProgressBar\); only one is supported"):
        Trainer(strategy="cpu", callbacks=[ProgressBar(), ProgressBar()])
    with pytest.raises(ValueError, match=r"enable_progress_bar=False` but found `TQDMProgressBar`"):
        Trainer(strategy="cpu", callbacks=[ProgressBar()], enable_progress_bar=False)


def test_the_progress_bar_prints_one_tidy_line_per_epoch_when_not_on_a_terminal(make_trainer, regression_loader, capsys):
    trainer = make_trainer(max_epochs=2, enable_progress_bar=True, log_every_n_steps=2, num_sanity_val_steps=0)
    trainer.fit(Model(), regression_loader, regression_loader)
    lines = capsys.readouterr().err.splitlines()
    progress = [line for line in lines if line.startswith(("Epoch", "Validation"))]
    assert [line.split(":")[0] for line in progress] == ["Validation", "Epoch 1/2", "Validation", "Epoch 2/2"]
    assert progress[1].startswith("Epoch 1/2: step 8, train/loss=") and "val/loss=" in progress[1]


def test_the_progress_bar_draws_bars_on_a_terminal(make_trainer, regression_loader, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True, num_sanity_val_steps=0)
    trainer.fit(Model(), regression_loader, regression_loader)
    err = capsys.readouterr().err
    assert "Epoch 1/1" in err and "8/8" in err and "train/loss=" in err


def test_logs_and_checkpoints_go_to_numbered_version_directories(tmp_path, regression_loader):
    for expected in ("version_0", "version_1"):
        trainer = Trainer(strategy="cpu", max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False,
                          log_every_n_steps=2)
        trainer.fit(Model(), regression_loader, regression_loader)
        assert trainer.log_dir == str(tmp_path / "lightning_logs" / expected)
    files = {path.relative_to(trainer.log_dir).as_posix().split(".")[0] for path in Path(trainer.log_dir).rglob("*")}
    assert {"metrics", "events", "checkpoints", "checkpoints/last"} <= files
    rows = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,step,train/loss,val/loss" and any(row.startswith("0,7,,") for row in rows)  # after step 8: Lightning's step 7


def test_early_stopping_stops_when_the_metric_stops_improving(make_trainer, regression_loader):
    class Flat(Model):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", 1.0)

    stopper = EarlyStopping(monitor="val/loss", patience=2)
    trainer = make_trainer(max_epochs=20, callbacks=[stopper], num_sanity_val_steps=0)
    trainer.fit(Flat(), regression_loader, regression_loader)
    assert trainer.current_epoch == 3  # epoch 1 sets the best; 2 and 3 do not improve
    assert "did not improve in the last 2 records" in stopper.stopping_reason_message


def test_model_checkpoint_keeps_the_best_by_the_monitored_metric(make_trainer, regression_loader, tmp_path):
    class Scored(Model):
        def validation_step(self, batch, batch_idx):
            self.log("val/acc", [0.5, 0.9, 0.7][self.current_epoch])

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/acc", mode="max", filename="{epoch}-{val/acc:.1f}",
                                 auto_insert_metric_name=False)
    make_trainer(max_epochs=3, callbacks=[checkpoint], num_sanity_val_steps=0).fit(Scored(), regression_loader, regression_loader)
    assert checkpoint.best_model_path == str(tmp_path / "ckpt" / "1-0.9.ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1-0.9.ckpt", "last.ckpt"]


def test_a_mock_callback_gets_the_hooks_and_keeps_the_seams_defaults(make_trainer, regression_loader):
    # Lightning's tests pass Mock(spec=Callback) (test_callbacks_configured_in_model): Lightning calls its on_*
    # hooks; Cadence's seams, checkpoint state and report facts, which Lightning's Callback lacks, keep their defaults
    # for it (a Mock's attributes are Mocks: no context manager, no ownership of backward or the optimizer step).
    from unittest import mock

    given, configured = mock.Mock(spec=Callback), mock.Mock(spec=Callback)

    class Configures(LinearRegression):
        def configure_callbacks(self):
            return configured

    trainer = make_trainer(max_epochs=1, limit_train_batches=2, callbacks=[given], enable_checkpointing=True)
    trainer.fit(Configures(), regression_loader)
    assert trainer.callbacks[-2:] == [configured, trainer.checkpoint_callback]
    called = [call[0] for call in given.method_calls]
    assert called[:3] == ["setup", "on_fit_start", "on_train_start"] and "on_train_batch_end" in called
    assert [call[0] for call in configured.method_calls] == called
    assert not {"forward_context", "module_init_context", "configure_model", "state_dict"} & set(called)
    assert torch.load(trainer.checkpoint_callback.last_model_path, weights_only=True)["callbacks"].keys() == {
        trainer.checkpoint_callback.state_key}
