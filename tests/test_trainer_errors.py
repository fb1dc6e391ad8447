"""Every bad input fails before or at the first step, naming the problem and the fix."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from callbacks import Callback, ModelCheckpoint
from linear_regression import LinearRegression
from trainer import Trainer, TrainingModule
from trainer.utilities import MisconfigurationException


class Model(LinearRegression):
    """Returns ``step(loss)`` from training_step when given a ``step``."""

    def __init__(self, step=None):
        super().__init__()
        self.step = step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return self.step(loss) if self.step is not None else loss


class Evaluated(Model):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


# --- what training_step returns ------------------------------------------------------------
@pytest.mark.parametrize(
    "step, match",
    [
        (lambda loss: loss * torch.ones(4, 2), r"a loss of shape \(4, 2\) at batch 0; the loss must be a scalar"),
        (lambda loss: loss.item(), "training_step returned float at batch 0"),
        (lambda loss: {"log": loss}, "training_step returned a dict without a 'loss' key at batch 0"),
    ],
    ids=["non-scalar", "python-float", "dict-without-loss"],
)
def test_training_step_must_return_a_scalar_loss(make_trainer, regression_loader, step, match):
    with pytest.raises(RuntimeError, match=match):
        make_trainer(max_epochs=1).fit(Model(step), regression_loader)


def test_training_step_may_return_a_dict_with_a_loss(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1)
    trainer.fit(Model(lambda loss: {"loss": loss, "extra": 1}), regression_loader)
    assert trainer.global_step == 8


def test_a_loss_without_grad_says_the_parameters_are_frozen(make_trainer, regression_loader):
    module = Model()
    module.requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad: every parameter is frozen"):
        make_trainer(max_epochs=1).fit(module, regression_loader)


def test_a_module_without_training_step_is_told_to_define_it(make_trainer, regression_loader):
    class Empty(TrainingModule):
        def configure_optimizers(self):
            return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(NotImplementedError, match=r"does not define training_step\(self, batch, batch_idx\)"):
        make_trainer(max_epochs=1).fit(Empty(), regression_loader)


@pytest.mark.parametrize("hook", ["training_step", "configure_optimizers"])
def test_a_hook_set_to_none_is_refused_before_fit_starts_in_lightnings_words(make_trainer, regression_loader, hook):
    # Lightning 2.6.5 (its test_wrong_train_setting / test_wrong_configure_optimizers): model.training_step = None
    # -> "No `training_step()` method defined."; Cadence called None ('NoneType' object is not callable).
    started = []

    class Model(LinearRegression):
        def on_fit_start(self):
            started.append(True)

    model = Model()
    setattr(model, hook, None)
    with pytest.raises(NotImplementedError, match=rf"No `{hook}\(\)` method defined. Model.{hook} is None"):
        make_trainer(max_epochs=1).fit(model, regression_loader)
    assert not started


@pytest.mark.parametrize("stage, hook, lightnings_words", [  # the regexes of Lightning 2.6.5's test_eval_loop_config
    ("validate", "validation_step", r"No `validation_step\(\)` method defined"),
    ("test", "test_step", r"No `test_step\(\)` method defined"),
    ("predict", "predict_step", r"`predict_step` cannot be None"),
    ("predict", "forward", r"requires `forward` method to run"),
])
def test_an_evaluation_hook_set_to_none_is_refused_in_lightnings_words(make_trainer, regression_loader, stage, hook,
                                                                       lightnings_words):
    model = LinearRegression()
    setattr(model, hook, None)
    with pytest.raises(NotImplementedError, match=rf"{lightnings_words}.*LinearRegression.{hook} is None"):
        getattr(make_trainer(max_epochs=1), stage)(model, regression_loader)


def test_pl_trainer_environment_variables_are_defaults_as_in_lightning(monkeypatch, tmp_path):
    # Lightning 2.6.5 (its trainer/flags/test_env_vars.py): PL_TRAINER_<ARGUMENT> sets that argument's default, read as
    # a Python literal; an argument passed (by keyword or position) wins. Cadence ignored them.
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_DEFAULT_ROOT_DIR", str(tmp_path))
    trainer = Trainer()
    assert trainer.logger is None and trainer.max_steps == 7 and trainer.default_root_dir == str(tmp_path)
    trainer = Trainer(3, 42, logger=True)
    assert trainer.logger is not None and (trainer.max_epochs, trainer.max_steps) == (3, 42)


def test_fit_refuses_a_plain_nn_module(make_trainer, regression_loader):
    with pytest.raises(TypeError, match="Trainer.fit needs a trainer.TrainingModule; got Linear"):
        make_trainer(max_epochs=1).fit(nn.Linear(4, 2), regression_loader)


def test_a_parameter_moved_off_the_device_by_a_hook_is_caught_before_the_first_step(make_trainer, regression_loader):
    class Wanders(Model):
        def on_train_start(self):
            self.layer.to("meta")

    with pytest.raises(RuntimeError, match="Parameter 'layer.weight' is on meta, but this run trains on cpu"):
        make_trainer(max_epochs=1).fit(Wanders(), regression_loader)


# --- loaders ----------------------------------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.randn(4), torch.randn(2)


class Nothing(IterableDataset):
    def __iter__(self):
        return iter(())


def test_an_endless_loader_needs_max_epochs_or_max_steps(make_trainer):
    with pytest.raises(ValueError, match=r"no length \(an IterableDataset\) and neither max_epochs nor max_steps"):
        make_trainer().fit(Model(), DataLoader(Stream(), batch_size=4))


def test_without_max_epochs_or_max_steps_a_sized_loader_stops_after_1000_epochs(make_trainer, regression_loader):
    class StopAtOnce(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = True

    trainer = make_trainer(callbacks=[StopAtOnce()])
    # Lightning 2.6.5's words (its test_max_epochs_not_set_warning).
    with pytest.warns(UserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch "
                                         "limit, set `max_epochs=-1`"):
        trainer.fit(Model(), regression_loader)
    assert trainer.max_epochs == 1000


def test_an_empty_loader_is_an_error(make_trainer):
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, 2)), batch_size=4)
    with pytest.raises(ValueError, match=r"The train DataLoader is empty \(len 0\)"):
        make_trainer(max_epochs=1).fit(Model(), empty)
    with pytest.raises(ValueError, match=r"The test DataLoader is empty \(len 0\)"):
        make_trainer().test(Evaluated(), empty)


def test_drop_last_with_too_few_samples_is_an_empty_loader(make_trainer):
    three = DataLoader(TensorDataset(torch.zeros(3, 4), torch.zeros(3, 2)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="is empty.*batch_size/drop_last"):
        make_trainer(max_epochs=1).fit(Model(), three)


def test_an_empty_stream_is_an_error_when_it_would_never_end(make_trainer):
    """With max_epochs, an epoch without batches ends as in Lightning (a stream may run dry), with a warning."""
    with pytest.raises(RuntimeError, match="The training DataLoader yielded no batches, and no max_epochs bounds"):
        make_trainer(max_steps=5).fit(Model(), DataLoader(Nothing(), batch_size=4))
    trainer = make_trainer(max_epochs=2)
    with pytest.warns(UserWarning, match="The training DataLoader yielded no batches in epoch 1"):
        trainer.fit(Model(), DataLoader(Nothing(), batch_size=4))
    assert trainer.current_epoch == 2 and trainer.global_step == 0


def test_validation_step_without_a_val_loader_warns(make_trainer, regression_loader):
    class WithValidation(Model):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", 0.0)

    # Lightning 2.6.5's words first (its test_fit_val_loop_config), then what to do.
    with pytest.warns(UserWarning, match="You defined a `validation_step` but have no `val_dataloader`. Skipping val loop: "
                                         "WithValidation's fit got no val_dataloaders"):
        make_trainer(max_epochs=1).fit(WithValidation(), regression_loader)


def test_evaluation_without_a_loader_is_an_error(make_trainer):
    with pytest.raises(ValueError, match=r"Trainer.validate got no dataloaders, and Evaluated defines no val_dataloader\(\)"):
        make_trainer().validate(Evaluated())
    with pytest.raises(ValueError, match=r"Trainer.fit got no train_dataloaders, and Model defines no train_dataloader\(\)"):
        make_trainer().fit(Model())


def test_a_fractional_val_check_interval_needs_a_length(make_trainer, regression_loader):
    # 1.0, the default, means the end of each epoch, which a loader without a length also has (as in Lightning).
    with pytest.raises(ValueError, match=r"val_check_interval=0.5\) is a fraction of the epoch, but the training "
                                         r"loader has no length. Use 1.0 \(the end of each epoch\), an int"):
        make_trainer(max_steps=2, val_check_interval=0.5).fit(Evaluated(), DataLoader(Stream(), batch_size=4),
                                                              regression_loader)


def test_an_int_val_check_interval_longer_than_the_epoch_is_an_error(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"val_check_interval=9\) must be less than or equal to the number of the "
                                         r"training batches \(8 in an epoch\)"):
        make_trainer(max_epochs=1, val_check_interval=9).fit(Evaluated(), regression_loader, regression_loader)


# --- the Trainer's arguments ------------------------------------------------------------------
@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"max_epochs": -100}, r"Trainer\(max_epochs=-100\): `max_epochs` must be a non-negative integer or -1"),
        ({"max_epochs": 2.5}, r"Trainer\(max_epochs=2.5\)"),
        ({"max_steps": -2}, r"Trainer\(max_steps=-2\): `max_steps` must be a non-negative integer or -1"),
        ({"accumulate_grad_batches": 0}, r"Trainer\(accumulate_grad_batches=0\): use an int >= 1"),
        ({"log_every_n_steps": 0}, r"Trainer\(log_every_n_steps=0\)"),
        ({"check_val_every_n_epoch": 0}, r"Trainer\(check_val_every_n_epoch=0\)"),
        ({"gradient_clip_val": -1.0}, r"Trainer\(gradient_clip_val=-1.0\): use a positive number or None"),
        ({"gradient_clip_val": "1"}, r"Trainer\(gradient_clip_val='1'\)"),
        ({"gradient_clip_algorithm": "l2"}, r'Trainer\(gradient_clip_algorithm="l2"\): use "norm" or "value"'),
        ({"val_check_interval": 1.5}, r"Trainer\(val_check_interval=1.5\): you passed invalid value 1.5; use a float in \(0.0, 1.0\]"),
        ({"val_check_interval": 0}, r"Trainer\(val_check_interval=0\)"),
        ({"val_check_interval": True}, r"Trainer\(val_check_interval=True\)"),
        # Lightning 2.6's time-based values: refused by name, not as an "invalid value".
        ({"val_check_interval": "00:00:05:00"}, r"Trainer\(val_check_interval='00:00:05:00'\): Lightning's time-based "
                                                r"validation .* is not supported by Cadence, which validates by batches"),
        ({"val_check_interval": datetime.timedelta(minutes=5)}, r"time-based validation .* use an int >= 1"),
        ({"val_check_interval": {"minutes": 5}}, r"Trainer\(val_check_interval=\{'minutes': 5\}\): Lightning's time-based"),
        # Lightning 2.6.5's sentence (its test_val_check_interval_float_with_none_check_val_every_n_epoch), then Cadence's way.
        ({"check_val_every_n_epoch": None}, r"check_val_every_n_epoch=None, val_check_interval=1.0\): `val_check_interval` "
                                            r"should be an integer or a time-based duration .*Cadence has no time-based "
                                            r"validation: use an int"),
        ({"limit_train_batches": 1.5}, r"Trainer\(limit_train_batches=1.5\): you passed invalid value 1.5, a "
                                       r"fraction outside \[0.0, 1.0\]"),
        ({"limit_val_batches": -1}, r"Trainer\(limit_val_batches=-1\): you passed invalid value -1, a negative one"),
        ({"limit_test_batches": "all"}, r"Trainer\(limit_test_batches='all'\): you passed invalid value 'all'; it must "
                                        r"be a float in \[0.0, 1.0\], an int >= 0"),
        ({"limit_predict_batches": True}, r"Trainer\(limit_predict_batches=True\)"),
        ({"num_sanity_val_steps": -2}, r"Trainer\(num_sanity_val_steps=-2\): use an int >= 0, or -1 for all"),
        ({"seed": -1}, r"seed_everything\(seed=-1\): use an int in \[0, 2\*\*32 - 1\]"),
        ({"callbacks": [object()]}, r"Trainer\(callbacks=\[...\]\) item 0 is object, not a callbacks.Callback"),
        ({"logger": "tensorboard"}, r"Trainer\(logger='tensorboard'\) is a str: use True, False, a logger callback, an object with Lightning's logger methods"),
    ],
)
def test_a_bad_trainer_argument_is_refused_with_what_would_work(arguments, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**arguments)


def test_a_gradient_clip_val_that_is_not_a_number_is_a_type_error_in_lightnings_words():
    # Lightning 2.6.5: TypeError("`gradient_clip_val` should be an int or a float. Got (1, 2).")
    with pytest.raises(TypeError, match=r"`gradient_clip_val` should be an int or a float. Got \(1, 2\)"):
        Trainer(gradient_clip_val=(1, 2))


def test_a_share_of_the_epoch_below_one_batch_reports_the_share_given(make_trainer, regression_loader):
    # Lightning 2.6.5's words (_parse_num_batches), 1 / 8 the least share that works.
    with pytest.raises(ValueError, match=r"You requested to check 0.1 of the `train_dataloader` but 0.1 \* 8 < 1. Please "
                                         r"increase the `limit_train_batches` argument. Try at least `limit_train_batches=0.125`"):
        make_trainer(max_epochs=1, limit_train_batches=0.1).fit(Model(), regression_loader)


@pytest.mark.parametrize("stage, limit", [("fit", "limit_val_batches"), ("validate", "limit_val_batches"),
                                          ("test", "limit_test_batches"), ("predict", "limit_predict_batches"),
                                          ("fit", "overfit_batches")])
def test_a_share_of_an_evaluation_loader_below_one_batch_is_refused_as_lightning_refuses_it(
        make_trainer, regression_loader, stage, limit):
    # Lightning 2.6.5 raises for every stage's loader (overfit_batches sets limit_val_batches too); running no
    # validation at all instead would be a run that finishes with other numbers than Lightning's.
    kind = "val" if limit == "overfit_batches" else limit.split("_")[1]
    match = (rf"You requested to check 0.1 of the `{kind}_dataloader` but 0.1 \* 8 < 1. Please increase the "
             rf"`limit_{kind}_batches` argument. Try at least `limit_{kind}_batches=0.125`")
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, **{limit: 0.1})
    train = DataLoader(regression_loader.dataset, batch_size=1)  # 64 batches: 0.1 of them trains
    with pytest.raises(MisconfigurationException, match=match):
        if stage == "fit":
            trainer.fit(Evaluated(), train, regression_loader)
        else:
            getattr(trainer, stage)(Evaluated(), regression_loader)


def test_a_fractional_limit_on_an_endless_loader_is_an_error(make_trainer):
    # Lightning 2.6.5's words first (its test_inf_dataloader_raise_error_with_partial_batch_limits), then the value given.
    with pytest.raises(ValueError, match=r"When using an `IterableDataset`, `Trainer\(limit_train_batches\)` must be `1.0` "
                                         r"or an int: limit_train_batches=0.5 is a fraction"):
        make_trainer(max_steps=2, limit_train_batches=0.5).fit(Model(), DataLoader(Stream(), batch_size=4))


@pytest.mark.parametrize("stage, argument, match", [
    ("fit", "val_dataloader", r"Trainer.fit\(val_dataloader=.*\): no such argument; did you mean val_dataloaders\?"),
    ("fit", "train_dataloader", r"Trainer.fit\(train_dataloader=.*\): no such argument; did you mean train_dataloaders\?"),
    ("validate", "dataloader", r"Trainer.validate\(dataloader=.*\): no such argument; did you mean dataloaders\?"),
    ("predict", "return_prediction", r"Trainer.predict\(return_prediction=.*\): no such argument; did you mean return_predictions\?"),
])
def test_a_misspelled_stage_argument_gets_a_did_you_mean(make_trainer, regression_loader, stage, argument, match):
    with pytest.raises(TypeError, match=match):
        getattr(make_trainer(max_epochs=1), stage)(Evaluated(), **{argument: regression_loader})


def test_a_manual_training_step_returning_a_number_is_refused(make_trainer, regression_loader):
    # Lightning 2.6.5 raises "In manual optimization, `training_step` must either return a Tensor or have no return."
    class Manual(Model):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return 5

    with pytest.raises(RuntimeError, match=r"training_step returned int at batch 0\. In manual optimization, "
                                           r"`training_step` must either return a Tensor or have no return"):
        make_trainer(max_epochs=1).fit(Manual(), regression_loader)


class WithoutStep(LinearRegression):
    training_step = None


class ReturnsJunk(LinearRegression):
    def configure_optimizers(self):
        return 0.5


@pytest.mark.parametrize("make, match", [
    (lambda trainer, loader: Trainer(max_epochs=-5), "max_epochs"),
    (lambda trainer, loader: Trainer(limit_train_batches=1.5), "limit_train_batches"),
    (lambda trainer, loader: Trainer(gradient_clip_val="big"), "gradient_clip_val"),
    (lambda trainer, loader: Trainer(strategy="ddp", devices=[0]), "lists GPU indices"),
    (lambda trainer, loader: ModelCheckpoint(mode="best"), "mode"),
    (lambda trainer, loader: trainer.fit(ReturnsJunk(), loader), "Unknown configuration for model optimizers"),
    (lambda trainer, loader: trainer.test(LinearRegression(), loader), r"No `test_step\(\)` method defined"),
    (lambda trainer, loader: trainer.fit(WithoutStep(), loader), r"No `training_step\(\)` method defined"),
])
def test_configuration_errors_are_lightnings_misconfiguration_exception_and_a_value_error(make_trainer,
                                                                                         regression_loader, make, match):
    # Lightning raises MisconfigurationException for these; code that catches it (or ValueError) catches Cadence's.
    with pytest.raises(MisconfigurationException, match=match) as raised:
        make(make_trainer(max_epochs=1), regression_loader)
    assert isinstance(raised.value, ValueError)
