"""DataModule: Lightning's hook order (prepare_data, setup, and only then the loaders), its place in
fit / validate / test / predict, and its state in checkpoints.

The DataModules here build their datasets in ``setup``, the common Lightning pattern that needs the
loaders to be asked for after setup.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import ModelCheckpoint
from linear_regression import LinearRegression
from trainer import DataModule, TrainingModule
from trainer.utilities import CombinedLoader


class Regressor(LinearRegression):
    def __init__(self, calls: list[str] | None = None):
        super().__init__()
        self.calls = calls if calls is not None else []

    def setup(self, stage):
        self.calls.append(f"module.setup({stage.value})")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.layer(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self.layer(x), y))


class RegressionData(DataModule):
    """Builds its datasets in setup and records every hook it receives."""

    def __init__(self, calls: list[str], batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters("batch_size")
        self.calls = calls
        self.datasets: dict[str, TensorDataset] = {}
        self.epochs_loaded = 0  # kept in checkpoints

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"datamodule.setup({stage.value})")
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=generator)
        self.datasets = {"train": TensorDataset(x, x[:, :2] * 2), "val": TensorDataset(x[:16], x[:16, :2] * 2)}

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        self.epochs_loaded += 1
        return DataLoader(self.datasets["train"], batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return DataLoader(self.datasets["val"], batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        self.calls.append("test_dataloader")
        return DataLoader(self.datasets["val"], batch_size=self.hparams.batch_size)

    def teardown(self, stage):
        self.calls.append(f"datamodule.teardown({stage.value})")

    def state_dict(self):
        return {"epochs_loaded": self.epochs_loaded}

    def load_state_dict(self, state_dict):
        self.calls.append(f"load_state_dict({state_dict})")
        self.epochs_loaded = state_dict["epochs_loaded"]


def test_fit_with_a_datamodule_asks_for_the_loaders_only_after_setup(make_trainer):
    calls: list[str] = []
    data = RegressionData(calls)
    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(Regressor(calls), datamodule=data)
    assert calls == [
        "prepare_data", "datamodule.setup(fit)", "module.setup(fit)",
        "train_dataloader", "val_dataloader", "datamodule.teardown(fit)",
    ]
    assert trainer.global_step == 8 and "val/loss" in trainer.callback_metrics
    assert trainer.datamodule is data and data.trainer is trainer


def test_a_datamodule_may_be_passed_where_the_loaders_go(make_trainer):
    calls: list[str] = []
    data = RegressionData(calls)
    trainer = make_trainer(max_epochs=1)
    model = Regressor(calls)
    trainer.fit(model, data)  # as Lightning's fit(model, dm)
    assert trainer.global_step == 4
    calls.clear()
    [tested] = trainer.test(model, data, verbose=False)
    assert calls == ["prepare_data", "datamodule.setup(test)", "module.setup(test)", "test_dataloader",
                     "datamodule.teardown(test)"]
    assert set(tested) == {"test/loss"}


def test_test_after_fit_with_a_datamodule_uses_that_datamodule(make_trainer):
    calls: list[str] = []
    trainer = make_trainer(max_epochs=1)
    model = Regressor(calls)
    trainer.fit(model, datamodule=RegressionData(calls))
    calls.clear()
    trainer.test(model, verbose=False)  # no loaders, no datamodule: the one fit used
    assert "test_dataloader" in calls


def test_a_stage_given_loaders_after_fit_with_a_datamodule_still_sets_that_datamodule_up(make_trainer, tmp_path):
    # As Lightning's: trainer.datamodule stays fit's, so its prepare_data, setup and teardown run for a later stage
    # given loaders; its loader hooks are not asked.
    calls: list[str] = []
    trainer = make_trainer(max_epochs=1)
    model = Regressor(calls)
    data = RegressionData(calls)
    trainer.fit(model, datamodule=data)
    calls.clear()
    trainer.test(model, DataLoader(data.datasets["val"], batch_size=8), verbose=False)
    assert calls == ["prepare_data", "datamodule.setup(test)", "module.setup(test)", "datamodule.teardown(test)"]
    assert trainer.datamodule is data


def test_the_datamodule_state_is_kept_in_checkpoints_and_restored(make_trainer, tmp_path):
    calls: list[str] = []
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints")
    trainer = make_trainer(max_epochs=1, callbacks=[checkpoints])
    data = RegressionData(calls)
    trainer.fit(Regressor(calls), datamodule=data)
    saved = torch.load(checkpoints.last_model_path, weights_only=True)
    assert saved["RegressionData"] == {"epochs_loaded": 1}  # Lightning's key: the class's __qualname__
    assert saved["datamodule_hyper_parameters"] == {"batch_size": 8}

    resumed_calls: list[str] = []
    resumed = RegressionData(resumed_calls)
    make_trainer(max_epochs=2).fit(Regressor(resumed_calls), datamodule=resumed, ckpt_path=checkpoints.last_model_path)
    assert "load_state_dict({'epochs_loaded': 1})" in resumed_calls
    assert resumed.epochs_loaded == 2  # restored, then one more load by the resumed fit
    test_calls: list[str] = []  # Lightning restores the DataModule's state for test (and validate, predict) too
    make_trainer().test(Regressor(test_calls), datamodule=RegressionData(test_calls), ckpt_path=checkpoints.last_model_path,
                        verbose=False)
    assert test_calls.index("load_state_dict({'epochs_loaded': 1})") < test_calls.index("test_dataloader")


@pytest.mark.parametrize("key", ["datamodule", "RegressionData"])
def test_a_datamodule_state_under_lightnings_key_or_cadences_old_one_is_restored(make_trainer, tmp_path, key):
    # Lightning's checkpoints keep it under the class's __qualname__; Cadence's before round 5 under "datamodule".
    path = tmp_path / "data.ckpt"
    trainer = make_trainer(max_epochs=1)
    trainer.fit(Regressor(), datamodule=RegressionData([]))
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert "datamodule_hyper_parameters" in saved  # RegressionData saved batch_size
    saved[key] = {"epochs_loaded": 5}
    saved.pop("RegressionData" if key == "datamodule" else "datamodule", None)
    torch.save(saved, path)
    calls: list[str] = []
    make_trainer(max_epochs=2).fit(Regressor(calls), datamodule=RegressionData(calls), ckpt_path=path)
    assert "load_state_dict({'epochs_loaded': 5})" in calls
    assert RegressionData.load_from_checkpoint(path, calls=[]).epochs_loaded == 5


def test_a_datamodule_without_hyperparameters_or_state_adds_no_keys_to_checkpoints(make_trainer, tmp_path, regression_data):
    # As Lightning's dump_checkpoint: its hyperparameters and its state only when it has some.
    class Plain(DataModule):
        def train_dataloader(self):
            return DataLoader(regression_data, batch_size=16)

    trainer = make_trainer(max_epochs=1)
    trainer.fit(Regressor(), datamodule=Plain())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert [key for key in saved if "datamodule" in key or "Plain" in key] == []


def test_from_datasets_serves_the_datasets_it_was_given(make_trainer, regression_data):
    data = DataModule.from_datasets(regression_data, val_dataset=regression_data, batch_size=16)
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Regressor(), datamodule=data)
    assert trainer.global_step == 4 and trainer.num_val_batches == [4]


# --- what may be passed, checked before anything runs ---------------------------------------------
class NoTestStep(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def setup(self, stage):
        raise AssertionError("the stage started")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda t, m, loader, data: t.fit(m, loader, datamodule=data), ValueError,
         "Trainer.fit got both loaders and a datamodule"),
        (lambda t, m, loader, data: t.fit(m, data, datamodule=data), ValueError,
         "got a DataModule as train_dataloaders and another as datamodule"),
        (lambda t, m, loader, data: t.fit(m, loader, data), TypeError,
         r"Trainer.fit\(val_dataloaders=...\) got the DataModule RegressionData where a loader is expected. "
         "Pass it as datamodule="),
        (lambda t, m, loader, data: t.fit(m, datamodule=loader), TypeError,
         r"Trainer.fit\(datamodule=...\) takes a trainer.DataModule; got DataLoader"),
        (lambda t, m, loader, data: t.fit(m, loader.dataset), TypeError,
         r"got the dataset TensorDataset, which yields samples, not batches. Wrap it in a DataLoader"),
        (lambda t, m, loader, data: t.fit(m, 3), TypeError,
         r"Trainer.fit\(train_dataloaders=...\) got int, which is not a loader"),
        (lambda t, m, loader, data: t.fit(m, CombinedLoader([loader, loader], "sequential")), ValueError,
         r'does not support the `CombinedLoader\(mode="sequential"\)` mode.*max_size_cycle'),
        (lambda t, m, loader, data: t.validate(m, {"a": loader, "b": 3}), TypeError,
         "got a dict that is not a dict of loaders"),
        (lambda t, m, loader, data: t.test(NoTestStep(), loader), TypeError,
         r"No `test_step\(\)` method defined to run `Trainer.test`: "  # Lightning 2.6.5's words (its test_eval_loop_config)
         r"Trainer.test runs NoTestStep.test_step\(batch, batch_idx\), which NoTestStep does not define"),
        (lambda t, m, loader, data: t.predict(NoTestStep(), loader), TypeError,
         "defines neither predict_step.batch, batch_idx. nor forward"),
        (lambda t, m, loader, data: t.test(m, datamodule=DataModule()), ValueError,
         r"Trainer.test got no dataloaders, and the datamodule DataModule defines no test_dataloader\(\)"),
    ],
    ids=["loaders-and-datamodule", "two-datamodules", "datamodule-as-val-loader", "loader-as-datamodule",
         "dataset", "not-iterable", "sequential-train-loaders", "dict-of-non-loaders", "test-without-test_step",
         "predict-without-forward", "datamodule-without-the-hook"],
)
def test_what_cannot_be_a_loader_fails_before_the_run_starts(make_trainer, regression_loader, call, error, match):
    calls: list[str] = []
    with pytest.raises(error, match=match):
        call(make_trainer(max_epochs=1), Regressor(calls), regression_loader, RegressionData(calls))
    assert calls == []  # no hook ran


def test_a_hook_that_returns_none_is_named(make_trainer):
    class Forgetful(RegressionData):
        def train_dataloader(self):
            return None

    with pytest.raises(ValueError, match=r"Forgetful.train_dataloader\(\) returned None; return a DataLoader"):
        make_trainer(max_epochs=1).fit(Regressor(), datamodule=Forgetful([]))


def test_an_error_in_fit_reaches_the_datamodules_on_exception_once_and_the_loggers_finalize_failed(make_trainer):
    # Lightning: on an exception, the callbacks' on_exception, then the DataModule's on_exception(error), and each
    # logger's finalize("failed") once (not followed by a finalize("success") at teardown).
    from callbacks import CSVLogger, Logger

    statuses = {}

    class Recording(Logger):
        def log_metrics(self, metrics, step=None):
            pass

        def finalize(self, status):
            statuses.setdefault("logger", []).append(status)

    class RecordingCSV(CSVLogger):
        def finalize(self, status="success"):
            statuses.setdefault("csv", []).append(status)
            super().finalize(status)

    class Failing(Regressor):
        def on_fit_start(self):
            raise RuntimeError("boom")

    class Data(RegressionData):
        def on_exception(self, exception):
            self.calls.append(f"on_exception:{exception}")

    calls = []
    trainer = make_trainer(max_epochs=1, logger=[Recording(), RecordingCSV(save_dir=make_trainer().default_root_dir)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), datamodule=Data(calls))
    assert [call for call in calls if call.startswith("on_exception")] == ["on_exception:boom"]
    assert statuses == {"logger": ["failed"], "csv": ["failed"]}
    statuses.clear()
    trainer = make_trainer(max_epochs=1, logger=[Recording()])
    trainer.fit(Regressor(), datamodule=Data(calls))
    assert statuses == {"logger": ["success"]}
