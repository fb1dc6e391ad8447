"""Where ``self.log`` may run and how, as Lightning's rules (its fx_validator table and its result collection):
refused hooks raise Lightning's error naming the hook, epoch-level hooks take on_step=False/on_epoch=True only,
a name logged twice in one hook must keep its arguments. The words matched are Lightning 2.6.5's."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from tests.linear_regression import LinearRegression, regression_samples
from trainer.utilities import MisconfigurationException


def loader(count: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(*regression_samples(count)), batch_size=4)


class LogsIn(LinearRegression):
    """Overrides the hooks Lightning refuses ``self.log`` in (each still does its job) and logs in ``where``."""

    def __init__(self, where: str | None = None, **log_kwargs) -> None:
        super().__init__()
        self.where, self.log_kwargs = where, log_kwargs

    def _log_if(self, hook: str) -> None:
        if hook == self.where:
            self.log("x", 1.0, **self.log_kwargs)

    def prepare_data(self):
        self._log_if("prepare_data")

    def setup(self, stage):
        self._log_if("setup")

    def configure_model(self):
        self._log_if("configure_model")

    def configure_optimizers(self):
        self._log_if("configure_optimizers")
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    def lr_scheduler_step(self, scheduler, metric):
        self._log_if("lr_scheduler_step")
        scheduler.step()

    def on_fit_start(self):
        self._log_if("on_fit_start")

    def on_fit_end(self):
        self._log_if("on_fit_end")

    def on_train_end(self):
        self._log_if("on_train_end")

    def on_validation_end(self):
        self._log_if("on_validation_end")

    def on_test_end(self):
        self._log_if("on_test_end")

    def teardown(self, stage):
        self._log_if("teardown")

    def on_save_checkpoint(self, checkpoint):
        self._log_if("on_save_checkpoint")

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self._log_if("on_before_batch_transfer")
        return batch

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self._log_if("transfer_batch_to_device")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self._log_if("on_after_batch_transfer")
        return batch

    def on_validation_model_eval(self):
        self._log_if("on_validation_model_eval")
        super().on_validation_model_eval()

    def on_validation_model_train(self):
        self._log_if("on_validation_model_train")
        super().on_validation_model_train()

    def on_validation_model_zero_grad(self):
        self._log_if("on_validation_model_zero_grad")
        super().on_validation_model_zero_grad()

    def on_test_model_eval(self):
        self._log_if("on_test_model_eval")
        super().on_test_model_eval()

    def configure_callbacks(self):
        self._log_if("configure_callbacks")
        return []

    def validation_step(self, batch, batch_idx):
        self._log_if("validation_step")

    def test_step(self, batch, batch_idx):
        self._log_if("test_step")

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self._log_if("predict_step")
        return super().predict_step(batch[0], batch_idx, dataloader_idx)


class LogsInCallback(Callback):
    """A callback that logs (through the module, as Lightning's callbacks do) in ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _log_if(self, hook: str, module) -> None:
        if hook == self.where:
            module.log("x", 1.0)

    def on_sanity_check_start(self, trainer, module):
        self._log_if("on_sanity_check_start", module)

    def on_sanity_check_end(self, trainer, module):
        self._log_if("on_sanity_check_end", module)

    def on_exception(self, trainer, module, error):
        self._log_if("on_exception", module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.where == "on_exception":  # the error whose on_exception logs
            raise RuntimeError("the step failed")


FIT_HOOKS = ["prepare_data", "setup", "configure_model", "configure_optimizers", "configure_callbacks", "on_fit_start",
             "on_fit_end", "on_train_end", "on_validation_end", "teardown", "on_save_checkpoint", "lr_scheduler_step",
             "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
             "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad"]


def refused(hook: str) -> str:
    return rf"You can't `self.log\(\)` inside `{hook}`. HINT: You can still log directly to the logger by using"


@pytest.mark.parametrize("hook", FIT_HOOKS)
def test_self_log_in_a_hook_lightning_refuses_raises_naming_the_hook(make_trainer, hook):
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[ModelCheckpoint(save_last=True)])
    with pytest.raises(MisconfigurationException, match=refused(hook)):
        trainer.fit(LogsIn(hook), loader(), loader())


@pytest.mark.parametrize("hook", ["on_sanity_check_start", "on_sanity_check_end", "on_exception"])
def test_a_callback_logging_in_a_refused_hook_raises_naming_it(make_trainer, hook):
    trainer = make_trainer(max_epochs=1, callbacks=[LogsInCallback(hook)])
    with pytest.raises(MisconfigurationException, match=refused(hook)):
        trainer.fit(LogsIn(), loader(), loader())


@pytest.mark.parametrize("hook", ["setup", "on_test_model_eval", "on_test_end", "test_dataloader"])
def test_test_refuses_self_log_in_the_hooks_lightning_refuses(make_trainer, hook):
    class WithLoader(LogsIn):
        def test_dataloader(self):
            self._log_if("test_dataloader")
            return loader()

    with pytest.raises(MisconfigurationException, match=refused(hook)):
        make_trainer().test(WithLoader(hook))


def test_every_predict_hook_refuses_self_log_with_lightnings_words(make_trainer):
    for hook in ("setup", "predict_step", "configure_callbacks"):
        with pytest.raises(MisconfigurationException, match=r"the loop's result collection is not registered yet\. "
                           rf"This is most likely because you are trying to log in a `predict` hook.*`{hook}`"):
            make_trainer().predict(LogsIn(hook), loader())


def test_the_allowed_hooks_still_log(make_trainer):
    class Allowed(LogsIn):  # the refused hooks overridden too: logging around them still records
        def on_train_start(self):
            self.log("train_start", 1.0)

        def on_train_epoch_start(self):
            self.log("epoch_start", 2.0)

        def on_before_optimizer_step(self, optimizer):
            self.log("before_step", 3.0)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("batch_end", torch.tensor(4.0))

        def on_train_epoch_end(self):
            self.log("epoch_end", 5.0, on_step=False, on_epoch=True)

        def on_validation_start(self):
            self.log("val_start", 6.0)

        def validation_step(self, batch, batch_idx):
            self.log("val_step", 7.0)

        def on_validation_epoch_end(self):
            self.log("val_epoch_end", 8.0)

    trainer = make_trainer(max_epochs=2, callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(Allowed(), loader(), loader())
    assert {key: float(value) for key, value in trainer.callback_metrics.items()} == {
        "train_start": 1.0, "epoch_start": 2.0, "before_step": 3.0, "batch_end": 4.0, "epoch_end": 5.0,
        "val_start": 6.0, "val_step": 7.0, "val_epoch_end": 8.0}
    assert float(make_trainer().validate(Allowed(), loader(), verbose=False)[0]["val_step"]) == 7.0


class Validates(LinearRegression):
    def validation_step(self, batch, batch_idx):
        pass


class StepInEpochEnd(Validates):
    def on_train_epoch_end(self):
        self.log("x", 1.0, on_step=True)


class NoEpochInTrainStart(Validates):
    def on_train_start(self):
        self.log("x", 1.0, on_epoch=False)


class StepInValidationEpochStart(Validates):
    def on_validation_epoch_start(self):
        self.log("x", 1.0, on_step=True)


@pytest.mark.parametrize(("module", "words"), [
    (StepInEpochEnd, r"self.log\(on_step=True\)` inside `on_train_epoch_end`, must be one of \(False,\)"),
    (NoEpochInTrainStart, r"self.log\(on_epoch=False\)` inside `on_train_start`, must be one of \(True,\)"),
    (StepInValidationEpochStart, r"self.log\(on_step=True\)` inside `on_validation_epoch_start`, must be one of \(False,\)"),
])
def test_outside_batches_only_on_epoch_logging_is_allowed(make_trainer, module, words):
    with pytest.raises(MisconfigurationException, match=rf"You can't `{words}\."):
        make_trainer(max_epochs=1).fit(module(), loader(), loader())


def test_a_step_metric_logged_again_per_step_in_an_epoch_end_hook_is_refused(make_trainer):
    class Again(LinearRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)  # per step: later calls take the shortcut
            return loss

        def on_train_epoch_end(self):
            self.log("loss", torch.tensor(1.0), on_step=True)

    with pytest.raises(MisconfigurationException, match=r"self.log\(on_step=True\)` inside `on_train_epoch_end`"):
        make_trainer(max_epochs=1).fit(Again(), loader())


def test_a_name_logged_twice_in_one_hook_with_other_arguments_is_refused(make_trainer):
    class Twice(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("foo", -1, prog_bar=False)
            self.log("foo", -1, prog_bar=True)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=r"You called `self.log\(foo, ...\)` twice in `training_step` "
                                                        "with different arguments. This is not allowed"):
        make_trainer(max_epochs=1).fit(Twice(), loader())

    class OtherFlavour(LinearRegression):
        def validation_step(self, batch, batch_idx):
            self.log("bar", 1.0)
            self.log("bar", 1.0, on_step=True)

    with pytest.raises(MisconfigurationException, match=r"`self.log\(bar, ...\)` twice in `validation_step`"):
        make_trainer(max_epochs=1).fit(OtherFlavour(), loader(), loader())


def test_a_name_logged_twice_with_the_same_arguments_or_from_two_hooks_still_logs(make_trainer):
    class Same(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("foo", 1.0, prog_bar=True)
            self.log("foo", 2.0, prog_bar=True)  # the latest value of the step
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("foo", 2.0, prog_bar=False)  # another hook: Lightning keeps it apart, it is no error

    trainer = make_trainer(max_epochs=1)
    trainer.fit(Same(), loader())
    assert float(trainer.callback_metrics["foo"]) == 2.0


def test_self_log_misuse_raises_misconfiguration_exception(make_trainer):
    class Suffixed(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("foo/dataloader_idx_0", -1)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match="`self.log` with the key `foo/dataloader_idx_0`"):
        make_trainer(max_epochs=1).fit(Suffixed(), loader())

    class Wide(LinearRegression):
        def on_train_start(self):
            self.log("foo", torch.tensor([1.0, 2.0]))

    with pytest.raises(MisconfigurationException, match="tensor must have a single element"):
        make_trainer(max_epochs=1).fit(Wide(), loader())

    class Argmax(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("foo", -1, reduce_fx=torch.argmax)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=r"reduce_fx=\{min,max,mean,sum\}\)` are supported"):
        make_trainer(max_epochs=1).fit(Argmax(), loader())
