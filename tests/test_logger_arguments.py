"""Lightning's logger arguments (log_graph, default_hp_metric, prefix, sub_dir, flush_logs_every_n_steps)
and what reaches the loggers from save_hyperparameters (logger=False, a DataModule's, merged), read
back from the files with TensorBoard's own reader and the csv module."""

from __future__ import annotations

import argparse
import csv
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, CSVLogger, ModelCheckpoint, SimpleProfiler, TensorBoardLogger
from trainer import DataModule, Trainer, TrainingModule


class Net(TrainingModule):
    def __init__(self, lr: float = 0.05, keep_from_loggers: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=not keep_from_loggers)
        self.layer = nn.Linear(4, 2)
        self.example_input_array = torch.zeros(3, 4)

    def forward(self, x):
        return torch.tanh(self.layer(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(DataModule):
    def __init__(self, batch_size: int = 4, lr: float = 0.05, keep_from_loggers: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters("batch_size", "lr", logger=not keep_from_loggers)

    def train_dataloader(self):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :2]), batch_size=self.hparams.batch_size)


def events_of(directory) -> EventAccumulator:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return events


def session_metrics(events: EventAccumulator) -> set[str] | None:
    try:
        content = events.PluginTagToContent("hparams")
    except KeyError:  # no hparams plugin data at all
        return None
    if "_hparams_/experiment" not in content:
        return None
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    return {info.name.tag for info in experiment.metric_infos}


def test_log_graph_writes_the_graph_traced_on_example_input_array(make_trainer, tmp_path):
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    make_trainer(max_epochs=1, logger=logger).fit(Net(), datamodule=Data())
    graph = events_of(logger.log_dir).Graph()
    assert "aten::linear" in {node.op for node in graph.node} and "aten::tanh" in {node.op for node in graph.node}
    no_example = Net()
    no_example.example_input_array = None
    with pytest.warns(UserWarning, match=r"Could not log computational graph to TensorBoard: The "
                                         r"`model.example_input_array` attribute is not set"):
        make_trainer(max_epochs=1, logger=TensorBoardLogger(tmp_path / "none", log_graph=True)).fit(no_example,
                                                                                                   datamodule=Data())


def test_default_hp_metric_false_writes_the_hparams_session_only_when_asked(make_trainer, tmp_path):
    quiet = TensorBoardLogger(tmp_path, name="quiet", default_hp_metric=False)
    make_trainer(max_epochs=1, logger=quiet).fit(Net(), datamodule=Data())
    assert session_metrics(events_of(quiet.log_dir)) is None
    with open(f"{quiet.log_dir}/hparams.yaml") as file:
        assert yaml.safe_load(file)["lr"] == 0.05  # kept in hparams.yaml all the same
    default = TensorBoardLogger(tmp_path, name="default")
    make_trainer(max_epochs=1, logger=default).fit(Net(), datamodule=Data())
    assert session_metrics(events_of(default.log_dir)) == {"loss"}  # the final metrics
    asked = TensorBoardLogger(tmp_path, name="asked", default_hp_metric=False)  # used without a Trainer
    asked.log_hyperparams(argparse.Namespace(lr=0.1), metrics=0.25)
    asked.finalize()
    events = events_of(asked.log_dir)
    assert session_metrics(events) == {"hp_metric"}
    assert [(event.step, event.value) for event in events.Scalars("hp_metric")] == [(0, 0.25)]


def test_prefix_goes_before_every_metric_name_in_both_loggers(make_trainer, tmp_path):
    board, table = TensorBoardLogger(tmp_path, prefix="run"), CSVLogger(tmp_path, prefix="run")
    make_trainer(max_epochs=1, logger=[board, table], log_every_n_steps=1).fit(Net(), datamodule=Data())
    assert "run-loss" in events_of(board.log_dir).Tags()["scalars"]
    with open(f"{table.log_dir}/metrics.csv", newline="") as file:
        header = next(csv.reader(file))
    assert header == ["epoch", "run-loss", "step"]


def test_sub_dir_holds_the_event_files_and_the_checkpoints_stay_in_the_version_directory(make_trainer, tmp_path):
    logger = TensorBoardLogger(tmp_path, name="exp", sub_dir="tb")
    trainer = make_trainer(max_epochs=1, logger=logger, enable_checkpointing=True)
    trainer.fit(Net(), datamodule=Data())
    version = tmp_path / "exp" / "version_0"
    assert logger.log_dir == str(version / "tb") and trainer.log_dir == str(version)
    assert list((version / "tb").glob("events.out.tfevents.*")) and (version / "tb" / "hparams.yaml").exists()
    assert (version / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("logger_class", [TensorBoardLogger, CSVLogger])
def test_a_subclass_overriding_name_and_version_logs_under_them(tmp_path, logger_class):
    # Lightning 2.6.5 (its test_tensorboard_log_sub_dir): a logger subclass whose name and version properties are
    # overridden has log_dir <save_dir>/<name>/<version> (Cadence used the constructor's name: lightning_logs).
    class Fixed(logger_class):
        @property
        def name(self):
            return "name"

        @property
        def version(self):
            return "version"

    assert Fixed(tmp_path / "logs").log_dir == str(tmp_path / "logs" / "name" / "version")


class ReadsTheCsvLater(Callback):
    """At step 6, waits (up to ``patience`` seconds) for the row written at step 2 (step 3's values, at
    Lightning's step n - 1) to be in metrics.csv; flush_logs_every_n_steps=2 hands rows over every 2 steps."""

    def __init__(self, logger: CSVLogger, patience: float) -> None:
        self.logger, self.patience, self.steps_on_disk = logger, patience, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != 6:
            return
        deadline = time.monotonic() + self.patience
        self.steps_on_disk = []
        while time.monotonic() < deadline:
            path = f"{self.logger.log_dir}/metrics.csv"
            if os.path.exists(path):  # the writer thread opens it when it first runs
                with open(path, newline="") as file:
                    self.steps_on_disk = [int(row["step"]) for row in csv.DictReader(file)]
            if 2 in self.steps_on_disk:
                break
            time.sleep(0.05)


@pytest.mark.parametrize(("every", "on_disk_by_step_6"), [(2, True), (100, False)])
def test_flush_logs_every_n_steps_bounds_how_far_the_csv_lags(make_trainer, tmp_path, every, on_disk_by_step_6):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=every)
    logger.handover_seconds, logger.min_handover_seconds = 3600, 0  # only the step count hands rows over
    reader = ReadsTheCsvLater(logger, patience=5 if on_disk_by_step_6 else 0.5)  # the writer thread writes them
    make_trainer(max_epochs=2, logger=logger, log_every_n_steps=1, callbacks=[reader]).fit(Net(), datamodule=Data())
    assert (2 in reader.steps_on_disk) is on_disk_by_step_6  # the rows of steps 1..3 (at 0..2) are handed over
    with open(f"{logger.log_dir}/metrics.csv", newline="") as file:  # and at the end, every row
        assert [int(row["step"]) for row in csv.DictReader(file)] == list(range(8))  # step n's row at n - 1 (Lightning's)


def test_hyperparameters_saved_with_logger_false_stay_out_of_the_loggers(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path), enable_checkpointing=True)
    trainer.fit(Net(lr=0.02, keep_from_loggers=True), datamodule=Data(batch_size=8, lr=0.02))
    assert yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text()) == {"batch_size": 8, "lr": 0.02}  # the data's
    checkpoint = torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"] == {"lr": 0.02, "keep_from_loggers": True}  # kept all the same
    assert Net.load_from_checkpoint(Path(trainer.log_dir) / "checkpoints" / "last.ckpt").hparams.lr == 0.02
    quiet = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path / "quiet"))
    quiet.fit(Net(keep_from_loggers=True), datamodule=Data(keep_from_loggers=True))
    assert not (Path(quiet.log_dir) / "hparams.yaml").exists()  # Lightning 2.6.5's CSVLogger then writes none


def test_the_module_and_datamodule_hyperparameters_merge_unless_they_disagree(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path))
    trainer.fit(Net(lr=0.05), datamodule=Data(batch_size=4, lr=0.05))
    assert yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text()) == {
        "lr": 0.05, "keep_from_loggers": False, "batch_size": 4}
    with pytest.raises(RuntimeError, match=r"Net and Data both save the hyperparameter 'lr', with different values "
                                           r"\(0.05 and 0.1\).* pass logger=False to one's save_hyperparameters"):
        make_trainer(max_epochs=1, logger=CSVLogger(tmp_path)).fit(Net(lr=0.05), datamodule=Data(lr=0.1))


class Base(TrainingModule):
    def __init__(self, width: int, **options) -> None:
        super().__init__()
        self.save_hyperparameters()


class Derived(Base):
    def __init__(self, width: int = 3, depth: int = 2) -> None:
        super().__init__(width, dropout=0.1)


def test_save_hyperparameters_takes_lightnings_forms():
    assert Derived().hparams == {"width": 3, "dropout": 0.1, "depth": 2}  # the subclass's arguments too

    class FromDict(TrainingModule):
        def __init__(self, config: dict) -> None:
            super().__init__()
            self.save_hyperparameters(config)

    assert FromDict({"lr": 0.1, "layers": 2}).hparams == {"lr": 0.1, "layers": 2}
    assert FromDict(argparse.Namespace(lr=0.1)).hparams.lr == 0.1
    assert FromDict({}).hparams == {}
    with pytest.raises(ValueError, match=r"one object is kept as the hyperparameters when it is a dict or an "
                                         r"argparse.Namespace, not a list"):
        FromDict([1, 2])


@pytest.mark.parametrize("make, where", [
    (lambda url: CSVLogger(save_dir=url), "CSVLogger(save_dir)"),
    (lambda url: TensorBoardLogger(save_dir=url), "TensorBoardLogger(save_dir)"),
    (lambda url: ModelCheckpoint(dirpath=url), "ModelCheckpoint(dirpath)"),
    (lambda url: SimpleProfiler(dirpath=url, filename="report"), "SimpleProfiler(dirpath)"),
    (lambda url: Trainer(default_root_dir=url), "Trainer(default_root_dir)"),
    (lambda url: Net.load_from_checkpoint(url), "checkpoint"),
])
@pytest.mark.parametrize("url", ["memory://runs", "s3://bucket/runs"])
def test_a_remote_url_for_a_directory_is_refused_naming_the_argument(make, where, url):
    # Lightning writes such paths through fsspec; taken as a local path they became a directory named "s3:".
    with pytest.raises(ValueError, match=rf"{re.escape(where)}='{re.escape(url)}' is a URL: .*local paths only"):
        make(url)
