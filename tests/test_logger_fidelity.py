"""Loggers used as Lightning code uses them: by hand, without a Trainer (their directory and files
appear at the first call; ``save`` writes), two stateless loggers of one class in one run, and an
``hparams.yaml`` always written (``load_from_checkpoint(hparams_file=...)`` reads it)."""

from __future__ import annotations

import os

import torch
import pytest
import yaml

from callbacks import CSVLogger, Logger, TensorBoardLogger
from linear_regression import LinearRegression


@pytest.mark.parametrize("kind", [CSVLogger, TensorBoardLogger])
def test_a_logger_used_by_hand_writes_at_its_first_call(tmp_path, kind):
    named = kind(save_dir=tmp_path, name="exp", version="2020-02-05-162402")
    named.log_hyperparams({"a": 1})
    assert os.listdir(tmp_path / "exp") == ["2020-02-05-162402"]
    unnamed = kind(save_dir=tmp_path / "plain", name=None)
    unnamed.log_hyperparams({"b": 2})
    assert unnamed.root_dir == str(tmp_path / "plain") and (tmp_path / "plain" / "version_0").is_dir()
    named.save()  # the files are written by a background thread: there once save returns
    assert os.listdir(tmp_path / "exp" / "2020-02-05-162402")
    unnamed.log_metrics({"loss": 0.5}, step=3)
    unnamed.save()
    if kind is CSVLogger:  # written once save returns
        assert open(tmp_path / "plain" / "version_0" / "metrics.csv").read().splitlines() == ["loss,step", "0.5,3"]
    named.finalize("success"), unnamed.finalize("success")
    assert yaml.safe_load((tmp_path / "exp" / "2020-02-05-162402" / "hparams.yaml").read_text()) == {"a": 1}


class Logging(LinearRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


class Recording(Logger):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics, step=None):
        self.steps.append(step)


def test_two_stateless_loggers_of_one_class_run_together_and_an_empty_state_dict_is_warned_about(
        make_trainer, regression_loader, tmp_path):
    first, second = Recording(), Recording()
    trainer = make_trainer(max_epochs=1, logger=[first, second], log_every_n_steps=4)
    trainer.fit(Logging(), regression_loader)
    assert first.steps == second.steps == [3, 7]
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=True)
    checkpoint["state_dict"] = {}
    torch.save(checkpoint, tmp_path / "run.ckpt")
    with pytest.warns(UserWarning, match="contains no parameters"):
        Logging.load_from_checkpoint(tmp_path / "run.ckpt", strict=False)


class LogsItsOwnStep(LinearRegression):
    """Logs "step" (or "epoch") itself at each batch, as Lightning lets a module set the loggers' x axis."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def training_step(self, batch, batch_idx):
        self.log(self.key, float({"step": 10, "epoch": -5}[self.key] + {"step": 1, "epoch": -1}[self.key] * batch_idx))
        self.log("v", float(batch_idx))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("key", "rows"), [
    ("step", ["step,v", "10,0.0", "11,1.0"]),  # Lightning 2.6.5: the logged "step" is the step, and no epoch column
    ("epoch", ["epoch,step,v", "-5.0,0,0.0", "-6.0,1,1.0"]),  # Lightning 2.6.5: a logged "epoch" is kept
])
def test_a_logged_step_or_epoch_is_what_the_loggers_get(make_trainer, regression_loader, tmp_path, key, rows):
    seen = []

    class Recording(Logger):
        def log_metrics(self, metrics, step=None):
            seen.append((step, dict(metrics)))

    csv = CSVLogger(tmp_path)
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, log_every_n_steps=1, logger=[csv, Recording()])
    trainer.fit(LogsItsOwnStep(key), regression_loader)
    assert open(os.path.join(csv.log_dir, "metrics.csv")).read().splitlines() == rows
    assert seen[-1] == ((11, {"v": 1.0}) if key == "step" else (1, {"epoch": -6.0, "v": 1.0}))
    assert float(trainer.logged_metrics[key]) == (11.0 if key == "step" else -6.0)  # kept there, as in Lightning


@pytest.mark.parametrize("kind", ["Mock", "MagicMock"])
def test_a_mock_logger_gets_the_calls_lightning_makes(make_trainer, regression_loader, tmp_path, kind):
    # Lightning's own tests pass logger=Mock() (name, version and save_dir set) and read its calls:
    # Lightning 2.6.5 makes these, in this order, for the same fit (2 training batches, log_every_n_steps=1,
    # one validation batch, a ModelCheckpoint).
    from unittest import mock

    logger = getattr(mock, kind)()
    logger.name, logger.version, logger.save_dir = "name", "0", str(tmp_path)
    if kind == "MagicMock":
        del logger.__iter__  # as Lightning's test helper does (a MagicMock is iterable: a list of no loggers)

    class Module(LinearRegression):
        def __init__(self, a=1):
            super().__init__()
            self.save_hyperparameters()

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", super().training_step(batch, batch_idx))

    trainer = make_trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, log_every_n_steps=1,
                           logger=logger, enable_checkpointing=True)
    module = Module()
    trainer.fit(module, regression_loader, regression_loader)
    assert trainer.logger is logger and trainer.loggers == [logger] and module.logger is logger
    assert [name for name, *_ in logger.method_calls] == [
        "log_hyperparams", "log_graph", "save", "log_metrics", "save", "log_metrics", "save", "log_metrics", "save",
        "after_save_checkpoint", "finalize"]
    assert logger.log_hyperparams.call_args == mock.call({"a": 1})
    assert logger.log_graph.call_args == mock.call(module)
    assert sorted(logger.log_metrics.call_args_list[0].kwargs["metrics"]) == ["epoch", "loss"]
    assert logger.log_metrics.call_args_list[0].kwargs["step"] == 0
    assert logger.finalize.call_args == mock.call("success")
    with pytest.raises(ValueError, match=r"Trainer\(logger=3\) is a int: use True, False, a logger callback, an object "
                                         r"with Lightning's logger methods"):
        make_trainer(logger=3)
