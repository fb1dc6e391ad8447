"""The loggers: every logged value reaches both files, read back with TensorBoard's own reader and
the csv module; Lightning's directories, names and logger surface; resuming into a run's files.
"""

from __future__ import annotations

import csv
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import (Callback, CSVLogger, DummyExperiment, DummyLogger, LearningRateMonitor, Logger, ModelCheckpoint,
                       TensorBoardLogger)
from trainer import Trainer, TrainingModule

EPOCHS, BATCHES, VAL_BATCHES, LOG_EVERY = 2, 6, 3, 2


class Logged(TrainingModule):
    """Logs per step, per epoch and both, and records on the host (test code may sync) every
    value it logged: ``(name, global step after the batch, value)``."""

    def __init__(self, lr: float = 0.05, hidden: int = 8, note: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)
        self.history: list[tuple[str, int, float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        self.log("train/offset", torch.tensor(batch_idx + 0.25), on_step=True, on_epoch=True)
        self.history += [("train/loss", self.global_step + 1, loss.item()), ("train/offset", self.global_step + 1, batch_idx + 0.25)]
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Validated(Logged):
    """Also logs in validation, per step and per epoch, and a histogram through logger.experiment."""

    def validation_step(self, batch, batch_idx):
        if self.trainer.sanity_checking:
            return
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("val/loss", loss, on_step=True, on_epoch=True)
        self.log("val/batch", float(batch_idx))
        self.history += [("val/loss", self.global_step, loss.item()), ("val/batch", self.global_step, float(batch_idx))]

    def on_train_epoch_end(self):
        for logger in self.loggers:  # as Lightning's GAN example does; a CSV file takes no histogram
            logger.experiment.add_histogram("weights", self.layer.weight, self.current_epoch)
        assert self.logger.experiment is self.loggers[0].experiment  # TensorBoard's SummaryWriter


def loader(batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(batches * 4, 4, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=4)


def expected_values(history: list[tuple[str, int, float]]) -> dict[str, dict[int, float]]:
    """What the files must hold, derived from the module's own record: training step values at
    log steps, epoch means as ``_epoch``, validation step values as ``_step`` on the validation
    batch axis, validation epoch means at the step validation ran. As Lightning writes them, the
    values of the n-th optimizer step (and the validation and epoch end after it) are at step n - 1."""
    expected: dict[str, dict[int, float]] = {}
    train = [(name, step, value) for name, step, value in history if name.startswith("train/")]
    for name, step, value in train:
        if step % LOG_EVERY == 0:
            expected.setdefault("train/loss" if name == "train/loss" else "train/offset_step", {})[step - 1] = value
    for epoch in range(EPOCHS):
        offsets = [value for name, step, value in train if name == "train/offset" and (step - 1) // BATCHES == epoch]
        expected.setdefault("train/offset_epoch", {})[(epoch + 1) * BATCHES - 1] = sum(offsets) / len(offsets)
    validation = [(name, step, value) for name, step, value in history if name.startswith("val/")]
    for index, (name, step, value) in enumerate(v for v in validation if v[0] == "val/loss"):
        expected.setdefault("val/loss_step", {})[index] = value
    for name in ("val/loss", "val/batch"):
        for step in sorted({step for n, step, _ in validation if n == name}):
            values = [value for n, s, value in validation if n == name and s == step]
            expected.setdefault(name if name == "val/batch" else "val/loss_epoch", {})[step - 1] = sum(values) / len(values)
    return expected


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("logged")
    module = Validated()
    trainer = Trainer(strategy="cpu", max_epochs=EPOCHS, log_every_n_steps=LOG_EVERY, default_root_dir=root,
                      enable_progress_bar=False, report=False)
    trainer.fit(module, loader(BATCHES), loader(VAL_BATCHES))
    events = EventAccumulator(str(trainer.log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    return trainer, module, events, rows


def test_every_logged_value_reaches_tensorboard_at_its_step(logged_run):
    trainer, module, events, _ = logged_run
    expected = expected_values(module.history)
    written = {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for tag, values in expected.items():
        assert written[tag] == pytest.approx(values, rel=1e-6), tag
    assert set(written) == set(expected) | {"epoch"}  # nothing else, and no value twice (dict == list)
    assert all(len(events.Scalars(tag)) == len(values) for tag, values in expected.items())


def test_every_logged_value_reaches_the_wide_csv_with_its_epoch(logged_run):
    trainer, module, _, rows = logged_run
    expected = expected_values(module.history)
    assert list(rows[0]) == ["epoch", "step", "train/loss", "train/offset_epoch", "train/offset_step", "val/batch",
                             "val/loss_epoch", "val/loss_step"]  # sorted by name, as Lightning's
    written: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("epoch", "step") and value != "":
                assert int(row["step"]) not in written.get(name, {}), f"{name} written twice at step {row['step']}"
                written.setdefault(name, {})[int(row["step"])] = float(value)
    assert set(written) == set(expected)
    for name, values in expected.items():
        assert written[name] == pytest.approx(values, rel=1e-6), name
    train_epochs = {int(row["step"]): int(row["epoch"]) for row in rows if row["train/loss"]}
    assert train_epochs == {step: (step - 1) // BATCHES for step in expected["train/loss"]}


def test_metrics_csv_rows_are_in_step_order_when_validation_runs_between_log_steps(make_trainer):
    trainer = make_trainer(max_epochs=1, logger=CSVLogger(), log_every_n_steps=2, val_check_interval=3)
    trainer.fit(Validated(), loader(BATCHES), loader(VAL_BATCHES))
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as file:
        rows = [(int(row["step"]), bool(row["val/batch"])) for row in csv.DictReader(file) if not row["val/loss_step"]]
    # log steps after batches 2, 4, 6; validation after batches 3 and 6, each after the values logged before
    # it; each at Lightning's step (one less than the optimizer steps taken)
    assert rows == [(1, False), (2, True), (3, False), (5, False), (5, True), (5, False)]


def test_hyperparameters_reach_hparams_yaml_and_tensorboard_with_the_final_metrics(logged_run):
    trainer, _, events, _ = logged_run
    assert yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text()) == {"lr": 0.05, "hidden": 8, "note": "tiny"}
    # in sorted order, as Lightning's yaml.dump writes them (saved as lr, hidden, note)
    assert list(yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text())) == ["hidden", "lr", "note"]
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert {key: value.number_value or value.string_value for key, value in start.hparams.items()} == {
        "lr": 0.05, "hidden": 8, "note": "tiny"}
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {info.name.tag for info in experiment.metric_infos} == set(trainer.callback_metrics)
    assert "val/loss_epoch" in trainer.callback_metrics


def test_logger_experiment_is_the_summary_writer_of_the_run(logged_run):
    trainer, module, events, _ = logged_run
    assert [type(logger) for logger in trainer.loggers] == [TensorBoardLogger, CSVLogger]
    assert trainer.logger is trainer.loggers[0]
    assert [event.step for event in events.Histograms("weights")] == [0, 1]  # from on_train_epoch_end
    # After the run the module still answers through its last Trainer, as in Lightning.
    assert module.logger is trainer.logger and module.loggers == trainer.loggers
    assert TrainingModule().logger is None and TrainingModule().loggers == []  # never attached


def test_a_csv_logger_follows_lightnings_directory_scheme_and_sets_the_runs_log_dir(make_trainer, tmp_path):
    logger = CSVLogger(save_dir=tmp_path / "logs", name="mnist", version=3)
    trainer = make_trainer(max_epochs=1, logger=logger, enable_checkpointing=True, log_every_n_steps=1)
    trainer.fit(Logged(), loader(2))
    run = tmp_path / "logs" / "mnist" / "version_3"
    assert trainer.log_dir == str(run) and logger.log_dir == str(run) and logger.save_dir == str(tmp_path / "logs")
    assert (logger.name, logger.version, logger.root_dir) == ("mnist", 3, str(tmp_path / "logs" / "mnist"))
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints", "hparams.yaml", "metrics.csv"]
    assert [CSVLogger(tmp_path / "logs", name="mnist").version, CSVLogger(tmp_path / "logs", name="").log_dir] == [
        4, str(tmp_path / "logs" / "version_0")]


def test_a_csv_logger_given_nothing_to_log_writes_no_file(make_trainer, tmp_path):
    # As Lightning 2.6.5's: metrics.csv is made by the first row written, and hparams.yaml by log_hyperparams,
    # which the Trainer calls only for a module (or DataModule) that called save_hyperparameters(); the
    # TensorBoardLogger writes an empty hparams.yaml all the same (its save() does).
    from linear_regression import LinearRegression  # logs nothing, saves no hyperparameters

    class SavesNone(LinearRegression):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters()  # nothing to keep: Lightning still logs {}

    trainer = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(LinearRegression(), loader(2))
    assert sorted(path.name for path in Path(trainer.log_dir).iterdir()) == []
    trainer = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(SavesNone(), loader(2))
    assert yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text()) == {}
    trainer = make_trainer(max_epochs=1, logger=TensorBoardLogger(tmp_path, name="tb"), log_every_n_steps=1)
    trainer.fit(LinearRegression(), loader(2))
    assert yaml.safe_load((Path(trainer.log_dir) / "hparams.yaml").read_text()) == {}


def test_loggers_left_to_their_defaults_share_the_next_version(make_trainer, tmp_path):
    (tmp_path / "lightning_logs" / "version_4").mkdir(parents=True)
    csv_logger, tensorboard = CSVLogger(), TensorBoardLogger(version="named")
    trainer = make_trainer(max_epochs=1, logger=[csv_logger, tensorboard, CSVLogger(name="other")])
    trainer.fit(Logged(), loader(2))
    assert trainer.log_dir == str(tmp_path / "lightning_logs" / "version_5") and csv_logger.version == 5
    assert tensorboard.log_dir == str(tmp_path / "lightning_logs" / "named")
    assert (tmp_path / "other" / "version_0" / "metrics.csv").is_file()


def test_two_identical_loggers_are_accepted_and_each_writes_its_own_version(make_trainer, tmp_path):
    # Lightning accepts two loggers of one class with the same arguments (its test_property_loggers), and each
    # takes its own version; beside them the other class shares the first's, as Cadence's defaults do.
    first, second, tensorboard = CSVLogger(tmp_path), CSVLogger(tmp_path), TensorBoardLogger(tmp_path)
    trainer = make_trainer(max_epochs=1, logger=[first, second, tensorboard], log_every_n_steps=1)
    assert trainer.loggers == [first, second, tensorboard]
    trainer.fit(Logged(), loader(2))
    assert (first.version, second.version, tensorboard.version) == (0, 1, 0)
    rows = [(Path(logger.log_dir) / "metrics.csv").read_text() for logger in (first, second)]
    assert rows[0] == rows[1] and rows[0].count("\n") > 2  # the same rows, each in its own file
    both_three = make_trainer(max_epochs=1, logger=[CSVLogger(tmp_path, version=3), CSVLogger(tmp_path, version=3)])
    with pytest.raises(RuntimeError, match=r"Two CSVLoggers write to .*version_3: they would write the same files"):
        both_three.fit(Logged(), loader(2))  # refused before anything is written
    assert not (tmp_path / "lightning_logs" / "version_3").exists()
    (tmp_path / "b" / "lightning_logs" / "version_6").mkdir(parents=True)  # the next free version is 7
    both_seven = make_trainer(max_epochs=1, logger=[CSVLogger(tmp_path / "b"), CSVLogger(tmp_path / "b", version=7)])
    with pytest.raises(RuntimeError, match=r"Two CSVLoggers write to .*version_7: they would write the same files"):
        both_seven.fit(Logged(), loader(2))


def test_a_run_resumed_from_its_checkpoint_replaces_what_was_logged_after_it(tmp_path):
    def run(max_epochs: int, ckpt_path=None) -> Trainer:
        trainer = Trainer(strategy="cpu", max_epochs=max_epochs, log_every_n_steps=LOG_EVERY, default_root_dir=tmp_path,
                          enable_progress_bar=False, report=False, callbacks=[ModelCheckpoint(save_top_k=-1)])
        trainer.fit(Logged(), loader(BATCHES), ckpt_path=ckpt_path)
        return trainer

    first = run(max_epochs=2)  # then "killed" after epoch 2: resume from epoch 1's checkpoint
    resumed = run(max_epochs=2, ckpt_path=Path(first.log_dir) / "checkpoints" / f"epoch=0-step={BATCHES}.ckpt")
    assert resumed.log_dir == first.log_dir
    with open(Path(resumed.log_dir) / "metrics.csv", newline="") as file:
        steps = [int(row["step"]) for row in csv.DictReader(file) if row["train/loss"]]
    assert steps == list(range(LOG_EVERY - 1, EPOCHS * BATCHES, LOG_EVERY))  # each once, in order
    events = EventAccumulator(str(resumed.log_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == steps  # purged after the checkpoint's step


def test_log_metrics_and_log_hyperparams_work_without_a_trainer(tmp_path):
    logger = CSVLogger(tmp_path, name="plain")
    logger.log_hyperparams({"width": 3})
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=1)
    logger.log_metrics({"loss": 0.25, "acc": 0.75}, step=2)
    logger.finalize("success")
    run = Path(logger.log_dir)
    assert (run / "metrics.csv").read_text().splitlines() == ["acc,loss,step", ",0.5,1", "0.75,0.25,2"]
    assert yaml.safe_load((run / "hparams.yaml").read_text()) == {"width": 3}


def test_a_users_own_lightning_style_logger_receives_the_metrics(make_trainer):
    class Remember(Logger):
        def __init__(self):
            self.rows, self.params = [], None

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, params, *args, **kwargs):
            self.params = params

    logger = Remember()
    trainer = make_trainer(max_epochs=1, logger=logger, log_every_n_steps=2)
    trainer.fit(Logged(), loader(4))
    assert trainer.logger is logger and logger.params == {"lr": 0.05, "hidden": 8, "note": "tiny"}
    assert [step for step, _ in logger.rows] == [1, 3, 3] and logger.rows[0][1]["epoch"] == 0  # Lightning's steps


def test_the_learning_rate_monitor_logs_each_group_in_the_row_of_its_step(make_trainer, tmp_path):
    class TwoGroups(Logged):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD([{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": 0.5}],
                                        lr=0.1, momentum=0.9)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "step"}}

    trainer = make_trainer(max_epochs=1, logger=CSVLogger(), log_every_n_steps=2,
                           callbacks=[LearningRateMonitor(log_momentum=True)])
    trainer.fit(TwoGroups(), loader(4))
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train/loss"]]
    # Each log step holds the rate its step used (the scheduler halved it once per earlier step), at
    # Lightning's step: 0.05/0.25 at step 1, 0.0125/0.0625 at step 3, as Lightning 2.6.6 writes them (same script).
    assert [(row["step"], float(row["lr-SGD/pg1"]), float(row["lr-SGD/pg2"])) for row in rows] == [
        ("1", 0.1 / 2, 0.5 / 2), ("3", 0.1 / 8, 0.5 / 8)]
    assert all(float(row["lr-SGD/pg1-momentum"]) == 0.9 for row in rows)
    monitor = trainer.callbacks[[type(c) for c in trainer.callbacks].index(LearningRateMonitor)]
    assert monitor.lrs == {"lr-SGD/pg1": [0.1 / 2, 0.1 / 8], "lr-SGD/pg2": [0.5 / 2, 0.5 / 8]}  # Lightning's members
    assert monitor.last_momentum_values == {"lr-SGD/pg1-momentum": 0.9, "lr-SGD/pg2-momentum": 0.9}
    assert monitor.last_weight_decay_values == {"lr-SGD/pg1-weight_decay": None, "lr-SGD/pg2-weight_decay": None}


def test_the_learning_rate_monitor_names_rates_as_lightning_does(make_trainer):
    class Named(Logged):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD([{"params": [self.layer.weight]}, {"params": [self.layer.bias]}], lr=0.1)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "name": "my_lr"}}

    class Growing(Logged):  # one group, then a second added at epoch 1 (as BaseFinetuning does)
        def configure_optimizers(self):
            optimizer = torch.optim.SGD([self.layer.weight], lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)]

    class AddGroup(Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                trainer.optimizers[0].add_param_group({"params": [module.layer.bias], "lr": 0.3})

    monitor = LearningRateMonitor()
    make_trainer(max_epochs=1, logger=CSVLogger(), callbacks=[monitor]).fit(Named(), loader(2))
    assert list(monitor.lrs) == ["my_lr/pg1", "my_lr/pg2"]  # the scheduler's "name"
    monitor = LearningRateMonitor()
    make_trainer(max_epochs=2, logger=CSVLogger(), callbacks=[AddGroup(), monitor]).fit(Growing(), loader(2))
    # Lightning goes on with lr-SGD's values as lr-SGD/pg1 once the optimizer has two groups
    assert monitor.lrs == {"lr-SGD/pg1": [0.1, 0.05], "lr-SGD/pg2": [0.3]}

    class SameNames(Logged):
        def configure_optimizers(self):
            return torch.optim.SGD([{"params": [self.layer.weight], "name": "a"}, {"params": [self.layer.bias], "name": "a"}],
                                   lr=0.1)

    with pytest.raises(ValueError, match=r"A single `Optimizer` cannot have multiple parameter groups with identical "
                                         r"`name` values. lr-SGD has duplicated parameter group names \['a'\]"):
        make_trainer(max_epochs=1, logger=CSVLogger(), callbacks=[LearningRateMonitor()]).fit(SameNames(), loader(2))


def test_the_learning_rate_monitor_warns_when_asked_for_a_momentum_the_optimizer_lacks(make_trainer):
    class Adagrad(Logged):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    trainer = make_trainer(max_epochs=1, logger=CSVLogger(), callbacks=[LearningRateMonitor(log_momentum=True)])
    with pytest.warns(RuntimeWarning, match="log_momentum=True, but some optimizers do not have momentum"):
        trainer.fit(Adagrad(), loader(2))


def test_a_logger_that_cannot_write_says_so(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    logger = CSVLogger(blocked, name="")  # its directory would be a_file/version_0
    # By hand the writer opens its directory at the first call, which fails there (Lightning 2.6.5's
    # raises FileExistsError from that call too).
    with pytest.raises(RuntimeError, match=r"CSVLogger could not write to .*a_file/version_0: .*Not a directory"):
        logger.log_metrics({"loss": 1.0}, step=1)
    with pytest.warns(UserWarning, match=r"CSVLogger could not write to .*a_file/version_0: .*Not a directory"):
        logger.finalize()
    with pytest.raises(RuntimeError, match=r"CSVLogger could not write to .*a_file/version_0: "):
        logger.log_metrics({"loss": 0.5}, step=2)


def test_saving_by_hand_after_a_failed_write_raises_instead_of_waiting_for_ever(tmp_path):
    logger = CSVLogger(tmp_path, name="", flush_logs_every_n_steps=1)  # by hand: save() at every step
    logger.log_hyperparams({"lr": 0.1})  # the writer opens version_0
    (tmp_path / "version_0" / "metrics.csv").mkdir()  # where the rows go cannot be written
    failed = []

    def log() -> None:
        try:
            logger.log_metrics({"loss": 1.0}, step=0)
        except RuntimeError as error:
            failed.append(str(error))

    caller = threading.Thread(target=log, daemon=True)  # a hang fails the test instead of the suite
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "save() waited for a write that had failed"
    assert len(failed) == 1 and re.match(r"CSVLogger could not write to .*version_0: .*Is a directory", failed[0])
    with pytest.warns(UserWarning, match="CSVLogger could not write to"):
        logger.finalize()


def test_bad_logger_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"CSVLogger\(version=-1\): use an int >= 0"):
        CSVLogger(version=-1)
    with pytest.raises(ValueError, match=r"TensorBoardLogger got \['graph'\]. It takes Lightning's save_dir, .* and "
                                         r"passes on \['comment', 'max_queue', 'flush_secs', 'filename_suffix'\]"):
        TensorBoardLogger("logs", graph=True)
    with pytest.raises(ValueError, match=r"TensorBoardLogger\(log_graph='yes'\): use True or False"):
        TensorBoardLogger("logs", log_graph="yes")
    with pytest.raises(ValueError, match=r"CSVLogger\(flush_logs_every_n_steps=0\): use an int >= 1"):
        CSVLogger(flush_logs_every_n_steps=0)
    with pytest.raises(ValueError, match=r'LearningRateMonitor\(logging_interval=\'batch\'\): use "step", "epoch"'):
        LearningRateMonitor(logging_interval="batch")
    with pytest.raises(RuntimeError, match=r"CSVLogger\(\) without save_dir logs under the Trainer's default_root_dir"):
        CSVLogger().log_dir


def test_a_learning_rate_monitor_without_a_logger_says_so(make_trainer):
    with pytest.raises(ValueError, match=r"Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger. "
                                         r"LearningRateMonitor writes to the loggers, and this Trainer has none"):
        make_trainer(max_epochs=1, callbacks=[LearningRateMonitor()]).fit(Logged(), loader(2))


def test_loggers_have_lightnings_remaining_members(tmp_path):
    logger = CSVLogger(save_dir=tmp_path, prefix="train")
    assert (logger.group_separator, logger.LOGGER_JOIN_CHAR, logger.NAME_HPARAMS_FILE) == ("/", "-", "hparams.yaml")
    assert logger.root_dir == str(tmp_path / "lightning_logs")
    logger.log_hyperparams()  # Lightning's params=None: nothing new to keep, and no error
    assert logger.hparams == {}
    # by hand, the version directory holds its files when it returns, as Lightning's (its test_no_name); Cadence's
    # writer thread wrote them a moment later (Lightning's test failed in 2 of 4 runs on the loaded machine)
    assert (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").exists()

    class Printing(Logger):
        def log_metrics(self, metrics, step=None):
            pass

    assert Printing().root_dir is None and Printing().group_separator == "/"


def test_the_learning_rate_monitor_per_epoch_logs_the_rates_alone_as_lightning(make_trainer):
    # Lightning's on_train_epoch_start: logger.log_metrics(latest_stat, step=...), no "epoch" key, so
    # the "epoch" curve of a run with LearningRateMonitor("epoch") (UvA-DL course 04) has no extra points.
    class Remember(Logger):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    logger = Remember()
    make_trainer(max_epochs=2, logger=logger, log_every_n_steps=50,
                 callbacks=[LearningRateMonitor("epoch")]).fit(Logged(), loader(4))
    assert [(step, metrics) for step, metrics in logger.rows if "lr-SGD" in metrics] == [
        (0, {"lr-SGD": 0.05}), (4, {"lr-SGD": 0.05})]


class Remember(Logger):
    """A logger that keeps each row it gets: ``(step, metrics)``."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class EverySecondBatch(TrainingModule):
    """Manual optimization stepping every second batch (an HDN denoiser's hand-made accumulation)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(F.mse_loss(self.layer(x), y))
        if batch_idx % 2 == 1:
            self.optimizers().step()
            self.optimizers().zero_grad()

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def on_train_epoch_end(self):
        self.lr_schedulers().step()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]


def test_under_manual_optimization_the_loggers_step_counts_batches_as_lightnings(make_trainer):
    # Lightning logs at fit_loop.epoch_loop._batches_that_stepped, which counts every batch under manual
    # optimization: the epoch's rates of LearningRateMonitor("epoch") (an HDN denoiser's run) and a test after
    # fit (a CycleGAN's validate of its best checkpoint). Lightning 2.6.5, this module, 4 batches a step every
    # second batch, 3 epochs: rates at steps 0, 4, 8, global_step 6, the test's row at step 12.
    logger = Remember()
    trainer = make_trainer(max_epochs=3, logger=logger, callbacks=[LearningRateMonitor("epoch")])
    module = EverySecondBatch()
    trainer.fit(module, loader(4))
    assert [(step, metrics) for step, metrics in logger.rows if "lr-SGD" in metrics] == [
        (0, {"lr-SGD": 0.1}), (4, {"lr-SGD": 0.05}), (8, {"lr-SGD": 0.025})]
    assert trainer.global_step == 6 and trainer.batches_that_stepped == 12
    trainer.test(module, loader(2), verbose=False)
    assert [step for step, metrics in logger.rows if "test_loss" in metrics] == [12]


@pytest.mark.parametrize("logger_class", [CSVLogger, TensorBoardLogger])
def test_a_logger_used_by_hand_has_written_hparams_yaml_when_log_hyperparams_returns(tmp_path, logger_class):
    # Lightning's loggers write hparams.yaml in log_hyperparams; code that reads it next must find it.
    logger = logger_class(save_dir=tmp_path, name="exp", version="2020-02-05-162402")
    logger.log_hyperparams({"a": 1, "b": 2})
    written = tmp_path / "exp" / "2020-02-05-162402" / "hparams.yaml"
    assert written.is_file() and yaml.safe_load(written.read_text()) == {"a": 1, "b": 2}


def test_csv_logger_by_hand_has_lightnings_experiment_and_flush(tmp_path):
    # Every figure here is what Lightning 2.6.5's CSVLogger does with the same calls.
    logger = CSVLogger(tmp_path, name="exp", flush_logs_every_n_steps=3)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_metrics({"a": 2.0}, step=1)
    assert [row["step"] for row in logger.experiment.metrics] == [0, 1]  # not saved yet
    assert not Path(logger.experiment.metrics_file_path).exists()
    logger.log_metrics({"a": 3.0, "b": 1.0}, step=2)  # (2 + 1) % 3 == 0: saved
    assert logger.experiment.metrics == []
    assert Path(logger.experiment.metrics_file_path).read_text().splitlines() == [
        "a,b,step", "1.0,,0", "2.0,,1", "3.0,1.0,2"]
    again = CSVLogger(tmp_path, name="exp", version=0)  # a new logger on that version starts the file over
    with pytest.warns(UserWarning, match=r"Experiment logs directory .*version_0 exists and is not empty"):
        again.log_metrics({"c": 1.0}, step=5)
    again.save()
    assert Path(again.experiment.metrics_file_path).read_text().splitlines() == ["c,step", "1.0,5"]


def test_dummy_logger_takes_every_call_and_keeps_nothing(make_trainer):
    # As Lightning 2.6.5's DummyLogger and DummyExperiment: any method with any arguments, "" names.
    logger = DummyLogger()
    logger.log_hyperparams("1", 2, three="three")
    logger.log_metrics("1", 2, three="three")
    assert logger.log_text("a", step=1) is None  # a method it does not define (WandbLogger's)
    assert (logger.name, logger.version) == ("", "")
    experiment = logger[0].experiment
    experiment["variable"] = "value"
    assert isinstance(experiment["variable"], DummyExperiment) and experiment[0].add_image("x") is None

    class UsesTheLogger(Logged):
        def on_train_epoch_end(self):
            self.logger.experiment.add_histogram("weights", self.layer.weight)

    trainer = make_trainer(max_epochs=1, logger=logger)
    trainer.fit(UsesTheLogger(), loader(2))
    assert trainer.logger is logger


def test_csv_experiment_writer_made_on_its_own_writes_into_its_directory(tmp_path):
    # Lightning 2.6.5's ExperimentWriter(log_dir) writes this file for these calls.
    from callbacks.csv_logger import ExperimentWriter

    writer = ExperimentWriter(tmp_path / "run")
    writer.log_metrics({"loss": 0.5}, step=0)
    writer.log_metrics({"loss": 0.25}, step=1)
    writer.save()
    assert writer.log_dir == str(tmp_path / "run")
    assert Path(writer.metrics_file_path).read_text().splitlines() == ["loss,step", "0.5,0", "0.25,1"]
