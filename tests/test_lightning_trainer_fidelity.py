"""The Trainer's members, arguments and loop as Lightning 2.6 has them (issue 17): each expected value
is what Lightning answers for the same script (its source named where the rule comes from)."""

from __future__ import annotations

import inspect
import logging
import signal

import pytest
import torch
from torch import nn

from callbacks import AMP, Callback
from linear_regression import LinearRegression
from trainer import DataModule, Trainer


class Frozen(LinearRegression):
    """A submodule frozen in eval mode (a pretrained backbone); records the modes and grad modes it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(2, 2).eval().requires_grad_(False)
        self.seen: list[tuple] = []

    def note(self, where: str) -> None:
        self.seen.append((where, self.layer.training, self.frozen.training, torch.is_grad_enabled(),
                          torch.is_inference_mode_enabled()))

    def training_step(self, batch, batch_idx):
        self.note("train")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.note("val")

    def on_validation_start(self):
        self.note("val_start")

    def on_validation_end(self):
        self.note("val_end")

    def on_test_start(self):
        self.note("test_start")

    def test_step(self, batch, batch_idx):
        self.note("test")


def test_evaluation_hooks_run_without_grad_and_each_submodule_keeps_its_mode(make_trainer, regression_loader):
    # Lightning: the evaluation loop's run() (its hooks included) is under no_grad within fit (its fit loop's
    # _EvaluationLoop has inference_mode=False), under inference_mode in test/validate unless inference_mode=False;
    # _ModuleMode gives every submodule its own mode back; fit never calls .train().
    module = Frozen()
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match=r"Found 1 module\(s\) in eval mode at the start of training \(frozen\)"):
        trainer.fit(module, regression_loader, regression_loader)
    make_trainer(inference_mode=False, limit_test_batches=1).test(module, regression_loader, verbose=False)
    assert module.seen == [
        ("train", True, False, True, False), ("train", True, False, True, False),
        ("val_start", False, False, False, False), ("val", False, False, False, False), ("val_end", False, False, False, False),
        ("test_start", False, False, False, False), ("test", False, False, False, False),
    ]
    assert module.layer.training and not module.frozen.training  # as before fit


class RecordsSetup(Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def setup(self, trainer, pl_module, stage):
        self.calls.append(("setup", stage))

    def teardown(self, trainer, pl_module, stage):
        self.calls.append(("teardown", stage))


class NamedStage(DataModule):
    """Hooks with a ``stage`` keyword only (``*args`` would get nothing): Lightning passes stage= by name."""

    def __init__(self, loader) -> None:
        super().__init__()
        self.loader, self.stages = loader, []

    def setup(self, *, stage):
        self.stages.append(stage)

    def teardown(self, *, stage):
        self.stages.append(f"teardown {stage.value}")

    def train_dataloader(self):
        return self.loader


def test_setup_and_teardown_get_stage_by_keyword_and_max_steps_leaves_max_epochs_at_minus_one(make_trainer,
                                                                                                regression_loader):
    recorder, data = RecordsSetup(), NamedStage(regression_loader)
    trainer = make_trainer(max_steps=1, callbacks=[recorder])
    assert (trainer.max_epochs, trainer.max_steps) == (None, 1)
    trainer.fit(LinearRegression(), datamodule=data)
    assert data.stages == ["fit", "teardown fit"] and recorder.calls == [("setup", "fit"), ("teardown", "fit")]
    assert trainer.max_epochs == -1  # Lightning: max_steps ends the run (loops/utilities.py _parse_loop_limits)


def test_max_epochs_or_max_steps_zero_trains_nothing(make_trainer, regression_loader):
    for limits in ({"max_epochs": 0}, {"max_steps": 0}):
        module = LinearRegression()
        before = module.layer.weight.detach().clone()
        trainer = make_trainer(**limits)
        trainer.fit(module, regression_loader)
        assert trainer.global_step == 0 and torch.equal(module.layer.weight, before), limits


def test_validate_test_and_predict_take_their_arguments_in_lightnings_order():
    # A positional call written for Lightning must bind the same parameters here.
    assert list(inspect.signature(Trainer.validate).parameters)[1:6] == [
        "model", "dataloaders", "ckpt_path", "verbose", "datamodule"]
    assert list(inspect.signature(Trainer.test).parameters)[1:6] == [
        "model", "dataloaders", "ckpt_path", "verbose", "datamodule"]
    assert list(inspect.signature(Trainer.predict).parameters)[1:6] == [
        "model", "dataloaders", "datamodule", "return_predictions", "ckpt_path"]


def test_the_precision_print_and_sigterm_members_answer_as_lightnings(make_trainer, capsys):
    assert make_trainer().precision == "32-true"
    assert make_trainer(precision="bf16-mixed").precision == "bf16-mixed"
    assert make_trainer(precision="16-mixed").precision == "bf16-mixed"  # on the CPU, as Lightning's
    assert make_trainer(callbacks=[AMP("bf16")]).precision == "bf16-mixed"
    trainer = make_trainer()
    assert trainer.received_sigterm is False
    trainer.print("rank zero prints", end="!")
    assert capsys.readouterr().out == "rank zero prints!"
    with pytest.raises(AttributeError, match=r"trainer.accelerator is Lightning's Accelerator object.*trainer.strategy.device"):
        trainer.accelerator  # noqa: B018
    assert not hasattr(trainer, "accelerator")


def test_lightnings_private_accelerator_connector_is_refused_naming_the_cadence_way(make_trainer):
    # lightning-bolts' SSLOnlineEvaluator reads trainer._accelerator_connector.is_distributed in on_fit_start
    trainer = make_trainer()
    with pytest.raises(AttributeError, match=r"trainer._accelerator_connector is Lightning's private .* trainer.world_size > 1"):
        trainer._accelerator_connector  # noqa: B018


class SigtermAware(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[bool] = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.received.append(self.trainer.received_sigterm)
        signal.raise_signal(signal.SIGTERM)  # Python runs the handler before the next line
        self.received.append(self.trainer.received_sigterm)


def test_received_sigterm_turns_true_once_sigterm_arrives_during_fit(make_trainer, regression_loader):
    module = SigtermAware()
    with pytest.raises(SystemExit):  # Cadence saves last.ckpt at the end of the step and ends the process
        make_trainer(max_epochs=1, limit_train_batches=3).fit(module, regression_loader)
    assert module.received == [False, True]  # then fit stopped at the end of that step


class NoValidationHook(LinearRegression):
    def val_dataloader(self):
        raise AssertionError("not called: the instance's None turns the hook off")

    def validation_step(self, batch, batch_idx):
        raise AssertionError("no validation without loaders")


def test_a_hook_set_to_none_on_the_instance_is_off_and_freeze_returns_the_module(make_trainer, regression_loader):
    module = NoValidationHook()
    module.val_dataloader = None  # Lightning's idiom (is_overridden: an attribute that is None is not a hook)
    module.train_dataloader = lambda: regression_loader  # and one set on the instance is
    make_trainer(max_epochs=1).fit(module)
    assert module.freeze() is module and not module.training
    assert module.unfreeze() is module and module.training


class PredictsTwo(LinearRegression):
    def forward(self, x):
        return self.layer(x)

    def predict_step(self, batch, batch_idx, dataloader_idx):
        return super().predict_step(batch[0], batch_idx, dataloader_idx)  # the default takes dataloader_idx


def test_the_default_predict_step_takes_dataloader_idx(make_trainer, regression_loader):
    predictions = make_trainer().predict(PredictsTwo(), [regression_loader, regression_loader])
    assert [len(per_loader) for per_loader in predictions] == [8, 8]


class EvaluatesTwo(LinearRegression):
    def test_step(self, batch, batch_idx, dataloader_idx):
        self.log("common", 1.0)
        self.log(f"only_{dataloader_idx}", 10.0 * (dataloader_idx + 1), add_dataloader_idx=False)

    def on_test_epoch_end(self):
        self.log("outside", 3.0)


def test_a_metric_logged_in_one_loader_without_its_suffix_is_in_that_loaders_results_only(make_trainer,
                                                                                          regression_loader):
    results = make_trainer(limit_test_batches=1).test(EvaluatesTwo(), [regression_loader, regression_loader],
                                                        verbose=False)
    assert results == [{"common/dataloader_idx_0": 1.0, "only_0": 10.0, "outside": 3.0},
                       {"common/dataloader_idx_1": 1.0, "only_1": 20.0, "outside": 3.0}]


class LogsThroughACallback(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        self.log("from_callback", 2.0)  # Lightning gives every callback the running module's log and log_dict

    def on_train_epoch_end(self, trainer, pl_module):
        self.log_dict({"also": 5.0})


class AsksForALogger(LinearRegression):
    def training_step(self, batch, batch_idx):
        self.log("asked", 1.0, logger=True)
        return super().training_step(batch, batch_idx)


def test_callbacks_log_through_the_module_and_logger_true_without_a_logger_warns(make_trainer, regression_loader):
    callback = LogsThroughACallback()
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, callbacks=[callback])
    with pytest.warns(UserWarning, match=r"`self.log\('asked', ..., logger=True\)` but have no logger configured"):
        trainer.fit(AsksForALogger(), regression_loader)
    assert {key: float(value) for key, value in trainer.callback_metrics.items()} == {
        "from_callback": 2.0, "also": 5.0, "asked": 1.0}
    assert "log" not in vars(callback)  # the module is not kept alive by the callback after the stage


def test_logger_and_loggers_are_settable_as_in_lightning(tmp_path):
    from callbacks import CSVLogger, Logger

    class Quiet(Logger):
        def log_metrics(self, metrics, step=None):
            pass

    first, second = Quiet(), Quiet()  # two loggers of one class: no state to keep apart
    trainer = Trainer(strategy="cpu", default_root_dir=tmp_path, logger=[first, second], enable_progress_bar=False)
    assert trainer.loggers == [first, second] and trainer.logger is first
    trainer.logger = None
    assert trainer.loggers == [] and trainer.logger is None
    csv = CSVLogger(tmp_path)
    trainer.loggers = [csv]
    assert trainer.logger is csv and csv in trainer.callbacks


class SkipsNoneBatches(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list = []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.outputs.append(None if outputs is None else sorted(outputs))


def test_a_none_batch_from_the_loader_is_skipped_with_a_warning(make_trainer, regression_data):
    from torch.utils.data import DataLoader, default_collate

    def every_other(samples, seen=[]):  # noqa: B006 (counts the calls)
        seen.append(1)
        return None if len(seen) % 2 else default_collate(samples)

    module, trainer = SkipsNoneBatches(), make_trainer(max_epochs=1, limit_train_batches=4)
    with pytest.warns(UserWarning, match="train_dataloader yielded None"):
        trainer.fit(module, DataLoader(regression_data, batch_size=8, collate_fn=every_other))
    assert module.outputs == [None, ["loss"], None, ["loss"]] and trainer.global_step == 2


class LogsALoss(LinearRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_barebones_turns_off_what_costs_speed_and_refuses_it_when_asked(tmp_path, regression_loader):
    for argument, value in (("enable_checkpointing", True), ("logger", True), ("enable_progress_bar", True),
                            ("log_every_n_steps", 1), ("num_sanity_val_steps", 1), ("profiler", "simple")):
        with pytest.raises(ValueError, match=rf"`Trainer\(barebones=True, {argument}={value!r}\)` was passed"):
            Trainer(barebones=True, **{argument: value})
    trainer = Trainer(barebones=True, strategy="cpu", max_epochs=1, default_root_dir=tmp_path)
    assert trainer.barebones and trainer.callbacks == [] and trainer.num_sanity_val_steps == 0
    with pytest.warns(UserWarning, match=r"`self.log\(\)` was called, but `Trainer\(barebones=True\)` is configured"):
        trainer.fit(LogsALoss(), regression_loader)
    assert trainer.global_step == 8 and trainer.callback_metrics == {} and list(tmp_path.iterdir()) == []


class LogsAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.log("on_train_start", 1.0)


def test_a_value_logged_in_on_train_start_after_the_sanity_check_is_kept(make_trainer, regression_loader):
    class Validates(LinearRegression):
        def validation_step(self, batch, batch_idx):
            pass

    trainer = make_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, callbacks=[LogsAtTrainStart()])
    trainer.fit(Validates(), regression_loader, regression_loader)
    assert float(trainer.callback_metrics["on_train_start"]) == 1.0


def test_a_script_written_against_import_lightning_pytorch_as_pl_runs_with_that_one_import_changed(tmp_path):
    import trainer as pl  # was: import lightning.pytorch as pl

    seen = []

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
                                               batch_size=4)

    class Seen(pl.Callback):
        def on_train_end(self, trainer, module):
            seen.append(trainer.global_step)

    profiler = pl.profilers.SimpleProfiler()
    assert isinstance(profiler, pl.profilers.Profiler)  # Lightning's base of the profilers
    trainer = pl.Trainer(max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, profiler=profiler,
                         logger=pl.loggers.CSVLogger(tmp_path),
                         callbacks=[Seen(), pl.callbacks.EarlyStopping("val_loss", check_on_train_epoch_end=True)])
    assert isinstance(trainer.strategy, pl.strategies.Strategy)
    trainer.fit(Net(), datamodule=Data())
    assert seen == [4] and pl.utilities.rank_zero_only.rank == 0
    with pytest.raises(NotImplementedError, match="WandbLogger is Lightning's; Cadence does not have it"):
        pl.loggers.WandbLogger()
    with pytest.raises(AttributeError, match="'plugins': Lightning's plugins are Trainer arguments in Cadence"):
        pl.plugins


class StopsAtStep(LinearRegression):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == 2:
            self.trainer.should_stop = True


@pytest.mark.parametrize("limits, module, said", [
    (dict(max_epochs=1), LinearRegression, ["`Trainer.fit` stopped: `max_epochs=1` reached."]),
    (dict(max_steps=3), LinearRegression, ["`Trainer.fit` stopped: `max_steps=3` reached."]),
    (dict(max_epochs=3), StopsAtStep, []),  # Lightning says should_stop's at DEBUG only
])
def test_fit_says_which_limit_stopped_it_in_lightnings_words(make_trainer, regression_loader, caplog, limits, module, said):
    with caplog.at_level(logging.INFO):  # pytest configures logging: the line goes there, as Lightning's
        make_trainer(**limits).fit(module(), regression_loader)
    assert [message for message in caplog.messages if "stopped" in message] == said


def test_setup_and_teardown_get_lightnings_trainer_fn_members(make_trainer, regression_loader):
    # Lightning 2.6.5 passes trainer.state.fn: a str enum member, equal to "fit" (and to "FIT"), whose
    # str() is "TrainerFn.FITTING"; the module's, the DataModule's and every callback's hooks get the same.
    from trainer.states import TrainerFn

    seen = []

    class Recording(Callback):
        def setup(self, trainer, module, stage):
            seen.append(("callback.setup", stage))

        def teardown(self, trainer, module, stage):
            seen.append(("callback.teardown", stage))

    class Module(LinearRegression):
        def setup(self, stage):
            seen.append(("module.setup", stage))

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

    class Data(DataModule):
        def setup(self, stage):
            seen.append(("datamodule.setup", stage))

        def train_dataloader(self):
            return regression_loader

        predict_dataloader = train_dataloader

    trainer = make_trainer(max_steps=1, callbacks=[Recording()])
    trainer.fit(Module(), datamodule=Data())
    trainer.predict(Module(), datamodule=Data())
    assert [(name, str(stage), type(stage)) for name, stage in seen] == [
        ("datamodule.setup", "TrainerFn.FITTING", TrainerFn), ("callback.setup", "TrainerFn.FITTING", TrainerFn),
        ("module.setup", "TrainerFn.FITTING", TrainerFn), ("callback.teardown", "TrainerFn.FITTING", TrainerFn),
        ("datamodule.setup", "TrainerFn.PREDICTING", TrainerFn), ("callback.setup", "TrainerFn.PREDICTING", TrainerFn),
        ("module.setup", "TrainerFn.PREDICTING", TrainerFn), ("callback.teardown", "TrainerFn.PREDICTING", TrainerFn)]
    assert seen[0][1] == "fit" and seen[0][1] == "FIT" and seen[0][1] != "validate" and {"fit": 1}[seen[0][1]] == 1


@pytest.mark.parametrize("limits", [{"limit_train_batches": 0}, {"limit_train_batches": 0.0}, {"max_epochs": 0}])
def test_a_fit_with_nothing_to_train_sanity_checks_and_calls_no_training_hook(make_trainer, regression_loader, capsys,
                                                                             limits):
    # Lightning 2.6.5 (the same script): its fit loop skips itself, so the sanity check runs, then
    # on_fit_end; no on_train_start/end, no epoch, no step, no checkpoint; the training loader is not
    # even asked for with limit_train_batches=0 (num_training_batches keeps its inf).
    calls = []

    class Recording(Callback):
        pass

    for hook in ("on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
                 "on_sanity_check_start", "on_sanity_check_end", "on_validation_start", "on_save_checkpoint"):
        setattr(Recording, hook, lambda self, *args, hook=hook: calls.append(hook))

    class Module(LinearRegression):
        def validation_step(self, batch, batch_idx):
            calls.append("validation_step")

        def train_dataloader(self):
            calls.append("train_dataloader")
            return regression_loader

    trainer = make_trainer(**{"max_epochs": 2, **limits}, callbacks=[Recording()], enable_checkpointing=True)
    trainer.fit(Module(), val_dataloaders=regression_loader)
    expected = ["on_fit_start", "on_sanity_check_start", "on_validation_start", "validation_step", "validation_step",
                "on_sanity_check_end", "on_fit_end"]
    if "max_epochs" in limits:
        assert calls == ["train_dataloader", *expected]  # Cadence asks for it before on_fit_start (docs/lightning.md)
    else:
        assert calls == expected
        assert trainer.num_training_batches == float("inf") and trainer.train_dataloader is None
    assert (trainer.global_step, trainer.current_epoch, trainer.checkpoint_callback.best_model_path) == (0, 0, "")
    assert "Trainer.fit trained nothing" in capsys.readouterr().err  # Cadence says so; Lightning is silent
