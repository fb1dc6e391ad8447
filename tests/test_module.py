"""The TrainingModule contract: hparams, self.log and its keys, and what the module sees of the run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import Callback
from trainer import TrainingModule
from trainer.utilities import MisconfigurationException


class Model(TrainingModule):
    def __init__(self, hidden: int = 3, lr: float = 0.1, note: str = "x", **extra):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# --- hyperparameters --------------------------------------------------------------------------
def test_save_hyperparameters_keeps_the_init_arguments_including_defaults_and_kwargs():
    module = Model(hidden=5, extra_flag=True)
    assert module.hparams == {"hidden": 5, "lr": 0.1, "note": "x", "extra_flag": True}
    assert module.hparams.hidden == 5


def test_save_hyperparameters_can_choose_or_ignore_arguments():
    class Chosen(Model):
        def __init__(self, hidden: int = 3, lr: float = 0.1, encoder=None):
            TrainingModule.__init__(self)
            self.save_hyperparameters("hidden")
            self.kept_all_but_encoder = dict(self.hparams)
            self.hparams.clear()
            self.save_hyperparameters(ignore="encoder")

    module = Chosen(encoder=nn.Linear(1, 1))
    assert module.kept_all_but_encoder == {"hidden": 3}
    assert module.hparams == {"hidden": 3, "lr": 0.1}


def test_save_hyperparameters_names_an_unknown_argument():
    class Wrong(TrainingModule):
        def __init__(self, lr: float = 0.1):
            super().__init__()
            self.save_hyperparameters("learning_rate")

    with pytest.raises(ValueError, match=r"save_hyperparameters\('learning_rate',\): pass names of Wrong.__init__'s "
                                         r"arguments \(it takes \['lr'\]; not \['learning_rate'\]\)"):
        Wrong()


def test_a_missing_hparam_names_the_ones_there_are():
    with pytest.raises(AttributeError, match=r"hparams has no 'batch_size'; it has \['hidden', 'lr', 'note'\]"):
        Model().hparams.batch_size


# --- outside a run ------------------------------------------------------------------------------
def test_outside_a_run_the_module_is_a_plain_nn_module():
    module = Model()
    batch = (torch.randn(2, 4), torch.randn(2, 2))
    module.log("train/loss", 1.0)  # nothing to record, and no error: training_step is unit-testable
    assert module.training_step(batch, 0).dim() == 0
    assert (module.trainer, module.current_epoch, module.global_step) == (None, 0, 0)
    assert module.device == torch.device("cpu")
    assert module.automatic_optimization is True


def test_the_module_sees_the_trainer_while_it_runs_and_after(make_trainer, regression_loader):
    seen = []

    class Watch(Model):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append((self.trainer is not None, self.current_epoch, self.global_step, self.device.type))

    module = Watch()
    trainer = make_trainer(max_epochs=2, limit_train_batches=2)
    trainer.fit(module, regression_loader)
    assert seen == [(True, 0, 1, "cpu"), (True, 0, 2, "cpu"), (True, 1, 3, "cpu"), (True, 1, 4, "cpu")]
    # As in Lightning, the module still answers after fit (scripts read them to name their outputs).
    assert (module.trainer, module.global_step, module.current_epoch) == (trainer, 4, 2)


# --- self.log -------------------------------------------------------------------------------------
class Logs(Model):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, prog_bar=True)  # default in training: on_step only
        self.log("train/both", float(batch_idx), on_step=True, on_epoch=True)
        self.log_dict({"train/sum": 1.0, "train/max": float(batch_idx)}, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/mean", float(batch_idx))  # default in evaluation: on_epoch only
        self.log("val/weighted", float(batch_idx), batch_size=batch_idx + 1)


class LogSum(Logs):
    def training_step(self, batch, batch_idx):
        self.log("train/count", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("train/peak", float(batch_idx), on_step=False, on_epoch=True, reduce_fx="max")
        self.log("train/low", float(batch_idx), on_step=False, on_epoch=True, reduce_fx="min")
        return super().training_step(batch, batch_idx)


def test_self_log_keys_and_epoch_reductions_follow_lightning(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(LogSum(), regression_loader, regression_loader)
    metrics = trainer.logged_metrics
    # Logged on step and epoch: Lightning's "_step"/"_epoch" suffixes.
    assert metrics["train/both_step"] == 7.0 and metrics["train/both_epoch"] == pytest.approx(3.5)
    assert metrics["train/count"] == 8.0 and metrics["train/peak"] == 7.0 and metrics["train/low"] == 0.0
    assert metrics["train/sum"] == 1.0  # reduce_fx defaults to the mean
    assert metrics["val/mean"] == pytest.approx(3.5)
    # batch_size weights the epoch mean: sum(i * (i + 1)) / sum(i + 1) over batches 0..7
    assert metrics["val/weighted"] == pytest.approx(sum(i * (i + 1) for i in range(8)) / sum(i + 1 for i in range(8)))
    assert set(trainer.progress_bar_metrics) == {"train/loss"}
    assert isinstance(trainer.callback_metrics["train/loss"], torch.Tensor)


def test_step_values_reach_loggers_only_at_log_steps(make_trainer, regression_loader):
    steps = []

    class Listener(Callback):
        def on_log(self, trainer, module, metrics, step):
            if "train/loss" in metrics:
                steps.append(step)

    trainer = make_trainer(max_epochs=2, log_every_n_steps=3, limit_val_batches=0, callbacks=[Listener()])
    trainer.fit(Logs(), regression_loader)
    # As Lightning 2.6.6 writes them (the same script run under it): the values of optimizer steps 3, 6,
    # 9, 12, 15 (the second epoch continues the count), each at step n - 1, and none at the epochs'
    # ends, which are not log steps (8 batches an epoch).
    assert steps == [2, 5, 8, 11, 14]


def test_a_per_step_name_logged_again_gives_the_loggers_its_last_value_before_each_log_step(make_trainer, regression_loader):
    # The first call registers the name; the later ones (a shorter path) must still replace the value.
    values = []

    class Listener(Callback):
        def on_log(self, trainer, module, metrics, step):
            if "train/last" in metrics:
                values.append(metrics["train/last"])

    class LogsThrice(Model):
        def training_step(self, batch, batch_idx):
            for call in range(3):
                self.log("train/last", torch.tensor(10.0 * batch_idx + call))
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=1, log_every_n_steps=3, limit_val_batches=0, callbacks=[Listener()])
    trainer.fit(LogsThrice(), regression_loader)
    # Log steps after batches 2 and 5 (8 batches): the last call of each, 10 * batch_idx + 2.
    assert values == [22.0, 52.0]
    assert trainer.callback_metrics["train/last"] == 72.0  # the epoch's last batch, published at its end


@pytest.mark.parametrize(
    "name, value, kwargs, match",
    [
        ("", 1.0, {}, r"self.log\(name=''\): the name must be a non-empty string"),
        ("x", torch.ones(3), {}, r"the tensor must have a single element.*it got a tensor of shape \(3,\)"),
        ("x", "high", {}, r"`self.log\(x, high\)` was called, but str values cannot be logged: log a number"),
        ("x", 1.0, {"reduce_fx": "median"}, r"reduce_fx=\{min,max,mean,sum\}\)` are supported.*Found: median"),
        ("x", 1.0, {"on_step": False, "on_epoch": False}, r"on_step=False, on_epoch=False\)` is not useful.*records nothing"),
        ("x", 1.0, {"sync_dist_group": object()}, r"sync_dist_group=...\): Cadence reduces over all processes"),
        ("x/dataloader_idx_0", 1.0, {}, r'with the key `x/dataloader_idx_0`.*the Trainer adds "/dataloader_idx_N" itself'),
        ("x", 1.0, {"metric_attribute": "layer"}, r'metric_attribute="layer"\): BadLog.layer is not the logged object'),
    ],
)
def test_self_log_refuses_what_it_cannot_record(make_trainer, regression_loader, name, value, kwargs, match):
    class BadLog(Model):
        def training_step(self, batch, batch_idx):
            self.log(name, value, **kwargs)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=match):  # Lightning's exception, a ValueError
        make_trainer(max_epochs=1).fit(BadLog(), regression_loader)


# --- self.log's other Lightning arguments -------------------------------------------------------
def test_logger_false_keeps_a_value_out_of_the_loggers_only(make_trainer, regression_loader):
    sent: list[dict] = []

    class Listener(Callback):
        def on_log(self, trainer, module, metrics, step):
            sent.append(dict(metrics))

    class Quiet(Model):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss)
            self.log("train/lr", 0.1, logger=False, prog_bar=True)
            self.log_dict({"train/peak": float(batch_idx)}, on_step=False, on_epoch=True, reduce_fx=torch.max,
                          logger=False)
            return loss

    trainer = make_trainer(max_epochs=1, log_every_n_steps=2, callbacks=[Listener()])
    trainer.fit(Quiet(), regression_loader)
    assert sent and all(set(metrics) <= {"train/loss"} for metrics in sent)
    assert set(trainer.logged_metrics) == {"train/loss"}
    assert trainer.progress_bar_metrics["train/lr"] == torch.tensor(0.1).item()  # a float32 tensor's value, as Lightning's
    assert trainer.callback_metrics["train/peak"].item() == 7.0  # reduce_fx=torch.max, Lightning's spelling


class Accuracy:
    """A metric with torchmetrics' protocol (update/compute/reset), without torchmetrics."""

    def __init__(self):
        self.computed = 0
        self.reset()

    def update(self, predictions, targets):
        self.correct += int((predictions == targets).sum())
        self.total += len(targets)

    def compute(self):
        self.computed += 1
        return torch.tensor(self.correct / self.total)

    def reset(self):
        self.correct, self.total = 0, 0


class Scored(Model):
    def __init__(self):
        super().__init__()
        self.accuracy = Accuracy()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.accuracy.update(self.layer(x).argmax(1), y.argmax(1))
        self.log("val/acc", self.accuracy, metric_attribute="accuracy")


def test_a_metric_object_is_computed_once_at_the_epoch_end_then_reset(make_trainer, regression_data):
    from torch.utils.data import DataLoader

    module = Scored()
    loader = DataLoader(regression_data, batch_size=24)  # batches of 24, 24 and 16: unequal
    trainer = make_trainer(max_epochs=1)
    (first,) = trainer.validate(module, loader)
    x, y = regression_data.tensors
    expected = (module.layer(x).argmax(1) == y.argmax(1)).float().mean().item()  # over samples, not batches
    assert first["val/acc"] == pytest.approx(expected)
    assert module.accuracy.computed == 1 and module.accuracy.total == 0  # computed once, then reset
    (second,) = trainer.validate(module, loader)  # starts from the reset state: the same value
    assert second["val/acc"] == pytest.approx(expected)


def test_a_metric_object_per_step_needs_the_value_of_its_last_call(make_trainer, regression_loader):
    class PerStep(Model):
        def __init__(self):
            super().__init__()
            self.accuracy = Accuracy()

        def training_step(self, batch, batch_idx):
            self.log("train/acc", self.accuracy)  # training's default: on_step
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r'self.log\("train/acc", <Accuracy>, on_step=True\): a metric object is '
                                         r"logged per step through the value of its last metric\(...\) call"):
        make_trainer(max_epochs=1).fit(PerStep(), regression_loader)

    class Forwarding(Accuracy):  # torchmetrics' metric(preds, target): update, and keep the batch's value
        def __call__(self, predictions, targets):
            self.update(predictions, targets)
            self._forward_cache = (predictions == targets).float().mean()
            return self._forward_cache

    class LogsForward(PerStep):
        def __init__(self):
            super().__init__()
            self.accuracy = Forwarding()
            self.batch_values = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.batch_values.append(self.accuracy(self.layer(x).argmax(1), y.argmax(1)).item())
            self.log("train/acc", self.accuracy, on_step=True, on_epoch=True)
            return Model.training_step(self, batch, batch_idx)

    module = LogsForward()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(module, regression_loader)
    assert trainer.logged_metrics["train/acc_step"] == pytest.approx(module.batch_values[-1])
    assert trainer.logged_metrics["train/acc_epoch"] == pytest.approx(sum(module.batch_values) / 8)


class MeanMetric(nn.Module):
    """A torchmetrics-like metric that is an nn.Module (torchmetrics' Metric is one), without torchmetrics."""

    def __init__(self):
        super().__init__()
        self.reset()

    def update(self, value):
        self.values.append(float(value))

    def compute(self):
        return torch.tensor(sum(self.values) / len(self.values))

    def reset(self):
        self.values = []


@pytest.mark.parametrize("owns_one", [False, True])
def test_logging_a_metric_module_that_is_not_the_modules_is_an_error_as_in_lightning(make_trainer, regression_loader,
                                                                                       owns_one):
    # Lightning 2.6.5 raises these (its test_logging_raises): the metric must be a submodule to be found.
    class LogsAStranger(Model):
        def __init__(self):
            super().__init__()
            if owns_one:
                self.mean = MeanMetric()

        def training_step(self, batch, batch_idx):
            stranger = MeanMetric()
            stranger.update(1.0)
            self.log("stranger", stranger, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    lightnings = (r"You can fix this by calling `self.log\(stranger, ..., metric_attribute=name\)` where `name` is one of \['mean'\]"
                  if owns_one else "You can fix this by setting an attribute for the metric in your `LightningModule`")
    with pytest.raises(ValueError, match="Could not find the `LightningModule` attribute for the `torchmetrics.Metric` "
                                         f"logged. {lightnings}"):
        make_trainer(max_epochs=1).fit(LogsAStranger(), regression_loader)


def test_a_metric_module_that_is_a_submodule_is_logged_without_metric_attribute(make_trainer, regression_loader):
    class LogsItsOwn(Model):
        def __init__(self):
            super().__init__()
            self.mean = MeanMetric()

        def training_step(self, batch, batch_idx):
            self.mean.update(batch_idx)
            self.log("mean_idx", self.mean, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=1)
    trainer.fit(LogsItsOwn(), regression_loader)
    assert trainer.callback_metrics["mean_idx"].item() == pytest.approx(3.5)  # batches 0..7


def test_self_log_before_the_module_is_given_to_a_trainer_warns_as_in_lightning():
    with pytest.warns(UserWarning, match="You are trying to `self.log\(\)` but the `self.trainer` reference is not "
                                         "registered on the model yet"):
        Model().log("loss", 1.0)


# --- what else a Lightning module reads ----------------------------------------------------------
def test_print_on_gpu_example_input_array_and_rank_zero_only(make_trainer, regression_loader, capsys):
    from trainer import rank_zero_only
    from trainer.utilities import rank_zero_only as from_utilities

    class Says(Model):
        def forward(self, x):  # the model summary runs example_input_array through it, as Lightning's does
            return self.layer(x)

        def on_train_start(self):
            self.print("starting on", self.device.type, "gpu:", self.on_gpu)

    module = Says()
    module.example_input_array = torch.zeros(1, 4)
    make_trainer(max_steps=1, limit_val_batches=0).fit(module, regression_loader)
    assert "starting on cpu gpu: False" in capsys.readouterr().out
    assert module.layer(module.example_input_array).shape == (1, 2)

    @rank_zero_only
    def report(value):
        return value * 2

    assert from_utilities is rank_zero_only and report(2) == 4
    rank_zero_only.rank = 1  # as on any other process
    try:
        assert report(2) is None
        module.print("not on rank one")  # the trainer is still attached: it says rank 0
    finally:
        rank_zero_only.rank = 0


def test_freeze_unfreeze_dtype_and_a_settable_trainer_as_in_lightning(make_trainer):
    from linear_regression import LinearRegression

    module = LinearRegression()
    module.freeze()
    assert not module.training and not any(parameter.requires_grad for parameter in module.parameters())
    module.unfreeze()
    assert module.training and all(parameter.requires_grad for parameter in module.parameters())
    assert module.dtype == torch.float32 and module.double().dtype == torch.float64
    trainer = make_trainer(max_epochs=1)
    module.trainer = trainer  # users' inference code and Lightning's tests attach a Trainer by hand
    assert module.trainer is trainer and module.global_step == 0


def test_the_modules_counters_and_ranks_are_the_trainers_as_in_lightning():
    # A unit test of a module attaches a stand-in trainer (Lightning's test_property_local_rank): each property
    # reads the trainer's own attribute of that name, as Lightning's does.
    from unittest import mock

    from linear_regression import LinearRegression

    module = LinearRegression()
    assert (module.local_rank, module.global_rank, module.current_epoch, module.global_step) == (0, 0, 0, 0)
    module.trainer = mock.Mock(local_rank=123, global_rank=7, current_epoch=2, global_step=5)
    assert (module.local_rank, module.global_rank, module.current_epoch, module.global_step) == (123, 7, 2, 5)
