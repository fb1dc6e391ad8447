"""Hooks fire in the order ``Trainer.fit``'s docstring gives, callbacks before the module's hook.

A RecordingCallback and a RecordingModule append every hook name they receive to one list; the
expected lists below are ``Trainer.fit``'s docstring written out for a small run. A hook added to
``Callback`` or ``TrainingModule`` is recorded automatically, so this test fails until the
docstring's order and this list are updated together.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import TrainingModule

# Seams that only run when a callback claims them, and checkpoint plumbing: not hooks of a plain run.
NOT_RECORDED = {"backward", "optimizer_step", "state_dict", "load_state_dict", "on_save_checkpoint",
                "on_load_checkpoint", "on_exception"}


def hook_names(cls: type) -> list[str]:
    names = []
    for name, _ in inspect.getmembers(cls, inspect.isfunction):
        if (name.startswith("on_") or name in ("setup", "teardown", "configure_model", "forward_context")) \
                and name not in NOT_RECORDED:
            names.append(name)
    return names


def recording(cls: type, prefix: str, calls: list[str]) -> type:
    """A subclass of ``cls`` whose every hook appends ``prefix + name`` to ``calls``."""

    def recorder(name: str, original):
        def hook(self, *args, **kwargs):
            calls.append(prefix + name)
            return original(self, *args, **kwargs)

        return hook

    namespace = {name: recorder(name, getattr(cls, name)) for name in hook_names(cls)}
    return type(f"Recording{cls.__name__}", (cls,), namespace)


class Model(TrainingModule):
    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.calls.append("validation_step")
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.calls.append("test_step")
        self.log("test/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        self.calls.append("predict_step")
        return self.layer(batch[0])

    def configure_optimizers(self):
        self.calls.append("configure_optimizers")
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.calls.append("module.optimizer_step")
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls.append("module.optimizer_zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)


@pytest.fixture
def run(make_trainer):
    calls: list[str] = []
    callback = recording(Callback, "callback.", calls)()
    module = recording(Model, "module.", calls)(calls)
    loader = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 2)), batch_size=2)  # 2 batches
    trainer = make_trainer(max_epochs=1, callbacks=[callback], log_every_n_steps=1, num_sanity_val_steps=1)
    return calls, trainer, module, loader


def evaluation(stage: str, step: str, batches: int) -> list[str]:
    """One evaluation pass up to its epoch end (its metrics are read next, then ``on_<stage>_end``),
    from the module's hook that puts the model in eval mode (Lightning's order)."""
    return [
        f"module.on_{stage}_model_eval",
        f"callback.on_{stage}_start", f"module.on_{stage}_start",
        f"callback.on_{stage}_epoch_start", f"module.on_{stage}_epoch_start",
        *["module.on_before_batch_transfer", "module.on_after_batch_transfer",  # the batch, then on the device
          f"callback.on_{stage}_batch_start", f"module.on_{stage}_batch_start", "callback.forward_context", step,
          f"callback.on_{stage}_batch_end", f"module.on_{stage}_batch_end"] * batches,
        f"callback.on_{stage}_epoch_end", f"module.on_{stage}_epoch_end",
    ]


def validation(batches: int) -> list[str]:
    return evaluation("validation", "validation_step", batches)


def training_batch() -> list[str]:
    return [
        "module.on_before_batch_transfer", "module.on_after_batch_transfer",
        "callback.on_train_batch_start", "module.on_train_batch_start",
        "callback.forward_context", "training_step",
        "callback.on_before_backward", "module.on_before_backward",
        "callback.on_after_backward", "module.on_after_backward",
        # the module's optimizer_step override takes the step: on_before_optimizer_step, clip, step
        "module.optimizer_step", "callback.on_before_optimizer_step", "module.on_before_optimizer_step",
        # Cadence clears the gradients right after the step (Lightning: before the next backward)
        "callback.on_before_zero_grad", "module.on_before_zero_grad", "module.optimizer_zero_grad",
        "callback.on_train_batch_end", "module.on_train_batch_end",
    ]


def test_fit_calls_the_hooks_in_the_order_of_its_docstring(run):
    calls, trainer, module, loader = run
    trainer.fit(module, loader, loader)
    assert calls == [
        # seed; setup hooks; module.configure_model; move once; callbacks' configure_model; wrap;
        # configure_optimizers
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        "configure_optimizers",
        "callback.on_fit_start", "module.on_fit_start",
        # sanity validation: one batch, nothing logged (no on_log)
        "callback.on_sanity_check_start",
        *validation(batches=1), "callback.on_validation_end", "module.on_validation_end",
        "module.on_validation_model_train",  # overridden (recorded): called instead of giving the modes back
        "callback.on_sanity_check_end",
        "callback.on_train_start", "module.on_train_start",
        "callback.on_train_epoch_start", "module.on_train_epoch_start",
        *training_batch(),  # batch 0: its values are copied to the host, published at the next log step
        *training_batch(), "callback.on_log",  # batch 1: batch 0's values reach on_log
        # validation at val_check_interval=1.0 (the end of the epoch): first batch 1's values
        # (the logs stay in step order), then its own metrics -> on_log
        "callback.on_log", "module.on_validation_model_zero_grad",  # in fit, not in the sanity check
        *validation(batches=2), "callback.on_log", "callback.on_validation_end", "module.on_validation_end",
        "module.on_validation_model_train",
        # the epoch's end: nothing left to publish (train/loss is logged per step only)
        "callback.on_train_epoch_end", "module.on_train_epoch_end",
        "callback.on_train_end", "module.on_train_end",
        "callback.on_fit_end", "module.on_fit_end",
        "callback.teardown", "module.teardown",
    ]


def test_validate_test_and_predict_call_their_own_hooks_in_order(run):
    calls, trainer, module, loader = run
    one_batch = DataLoader(loader.dataset, batch_size=4)
    trainer.validate(module, one_batch)
    assert calls == [
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        *validation(batches=1), "callback.on_log", "callback.on_validation_end", "module.on_validation_end",
        "module.on_validation_model_train", "callback.teardown", "module.teardown",
    ]
    calls.clear()
    trainer.test(module, one_batch)
    assert calls == [
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        *evaluation("test", "test_step", batches=1), "callback.on_log", "callback.on_test_end", "module.on_test_end",
        "module.on_test_model_train", "callback.teardown", "module.teardown",
    ]
    calls.clear()
    trainer.predict(module, one_batch)
    assert calls == [
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        *evaluation("predict", "predict_step", batches=1), "callback.on_predict_end", "module.on_predict_end",
        "callback.teardown", "module.teardown",
    ]


def test_callbacks_run_in_the_order_given_and_before_the_module(make_trainer, regression_loader):
    calls: list[str] = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        @property
        def state_key(self):
            return self.name

        def on_fit_start(self, trainer, module):
            calls.append(self.name)

    class Module(Model):
        def on_fit_start(self):
            calls.append("module")

    trainer = make_trainer(max_steps=1, limit_val_batches=0, callbacks=[Named("second"), Named("first")])
    trainer.fit(Module([]), regression_loader)
    assert calls == ["second", "first", "module"]


def test_a_failing_step_calls_on_exception_then_teardown_and_raises_the_error(make_trainer, regression_loader):
    calls: list[str] = []

    class Watcher(Callback):
        def on_exception(self, trainer, module, error):
            calls.append(f"on_exception({error})")

        def teardown(self, trainer, module, stage):
            calls.append(f"teardown({stage.value})")

    class Broken(Model):
        def training_step(self, batch, batch_idx):
            raise KeyError("boom")

    module = Broken([])
    trainer = make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[Watcher()])
    with pytest.raises(KeyError, match="boom"):
        trainer.fit(module, regression_loader)
    assert calls == ["on_exception('boom')", "teardown(fit)"]
    assert trainer.module is None  # the stage is over after the failure too
    assert module.trainer is trainer  # and, as in Lightning, the module still answers module.trainer


def test_manual_optimization_calls_the_backward_and_step_hooks_through_manual_backward_and_step(make_trainer, regression_loader):
    calls: list[str] = []

    class Manual(Model):
        def __init__(self):
            super().__init__(calls)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            calls.append("training_step")
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self.layer(batch[0]), batch[1]))
            optimizer.step()

    callback = recording(Callback, "callback.", calls)()
    module = recording(Manual, "module.", calls)()
    make_trainer(max_steps=1, callbacks=[callback], limit_val_batches=0).fit(module, regression_loader)
    batch = calls[calls.index("callback.on_train_batch_start"):calls.index("callback.on_train_epoch_end")]
    # As in Lightning: manual_backward runs the backward hooks, optimizer.step() the step hook;
    # zero_grad is the user's, so no on_before_zero_grad.
    assert batch == [
        "callback.on_train_batch_start", "module.on_train_batch_start", "callback.forward_context", "training_step",
        "callback.on_before_backward", "module.on_before_backward", "callback.on_after_backward",
        "module.on_after_backward", "callback.on_before_optimizer_step", "module.on_before_optimizer_step",
        "callback.on_train_batch_end", "module.on_train_batch_end",
    ]


def test_checkpoint_hooks_run_in_lightnings_order_when_saving_and_restoring(make_trainer, regression_loader, tmp_path):
    calls: list[str] = []

    class Keeps(Callback):
        def state_dict(self):
            calls.append("callback.state_dict")
            return {"kept": 1}

        def load_state_dict(self, state_dict):
            calls.append(f"callback.load_state_dict({state_dict})")

        def on_save_checkpoint(self, trainer, module, checkpoint):
            calls.append(f"callback.on_save_checkpoint(callbacks={checkpoint['callbacks'][self.state_key]})")
            checkpoint["callback_note"] = "from the callback"

        def on_load_checkpoint(self, trainer, module, checkpoint):
            calls.append(f"callback.on_load_checkpoint({checkpoint['callback_note']}, {checkpoint['module_note']})")

    class Notes(Model):
        def on_save_checkpoint(self, checkpoint):
            calls.append("module.on_save_checkpoint")
            checkpoint["module_note"] = "from the module"

        def on_load_checkpoint(self, checkpoint):
            calls.append("module.on_load_checkpoint")

    trainer = make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[Keeps()])
    trainer.fit(Notes([]), regression_loader)
    calls.clear()  # fit also asked for the callback's state for the end-of-fit state
    trainer.save_checkpoint(tmp_path / "notes.ckpt")
    assert calls == ["callback.on_save_checkpoint(callbacks={'kept': 1})", "module.on_save_checkpoint"]
    calls.clear()
    make_trainer(max_epochs=2, limit_val_batches=0, callbacks=[Keeps()]).fit(
        Notes([]), regression_loader, ckpt_path=tmp_path / "notes.ckpt")
    assert calls[:3] == ["module.on_load_checkpoint", "callback.on_load_checkpoint(from the callback, from the module)",
                         "callback.load_state_dict({'kept': 1})"]


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_every_stage_restores_the_module_then_the_callbacks_from_ckpt_path_as_lightning(make_trainer, regression_loader,
                                                                                       tmp_path, stage):
    # Lightning 2.6.6 (_restore_modules_and_callbacks), for every stage: the module's on_load_checkpoint, its
    # weights, then each callback's on_load_checkpoint and load_state_dict (so a ModelCheckpoint's best path returns).
    from callbacks import ModelCheckpoint

    calls: list[str] = []

    class Counts(Callback):
        def __init__(self):
            self.epochs = 0

        def state_dict(self):
            return {"epochs": self.epochs}

        def load_state_dict(self, state_dict):
            calls.append(f"callback.load_state_dict({state_dict})")
            self.epochs = state_dict["epochs"]

        def on_train_epoch_end(self, trainer, module):
            self.epochs += 1

        def on_load_checkpoint(self, trainer, module, checkpoint):
            calls.append("callback.on_load_checkpoint")

    class Loads(Model):
        def on_load_checkpoint(self, checkpoint):
            calls.append("module.on_load_checkpoint")

        def load_state_dict(self, *args, **kwargs):
            calls.append("module.load_state_dict")
            return super().load_state_dict(*args, **kwargs)

    def make(max_epochs):
        return make_trainer(max_epochs=max_epochs, limit_val_batches=0, enable_checkpointing=True,
                            callbacks=[Counts(), ModelCheckpoint(dirpath=tmp_path, monitor="step", mode="max")])

    first = make(1)
    first.fit(Loads([]), regression_loader)
    best = first.checkpoint_callback.best_model_path
    assert best.endswith("step=8.ckpt")
    calls.clear()
    trainer = make(2)
    getattr(trainer, stage)(Loads([]), regression_loader, ckpt_path=best)
    assert calls == ["module.on_load_checkpoint", "module.load_state_dict", "callback.on_load_checkpoint",
                     "callback.load_state_dict({'epochs': 1})"]
    if stage != "fit":
        assert trainer.callbacks[0].epochs == 1 and trainer.checkpoint_callback.best_model_path == best


def test_configure_callbacks_replaces_the_trainers_callback_of_the_same_class(make_trainer, regression_loader):
    class Marker(Callback):
        def __init__(self, owner):
            self.owner = owner

        def on_fit_start(self, trainer, module):
            seen.append(self.owner)

    class Other(Callback):
        def on_fit_start(self, trainer, module):
            seen.append("other")

    class WithCallbacks(Model):
        def configure_callbacks(self):
            return Marker("module")

    seen: list[str] = []
    trainer = make_trainer(max_steps=1, limit_val_batches=0, callbacks=[Marker("trainer"), Other()])
    trainer.fit(WithCallbacks([]), regression_loader)
    assert seen == ["other", "module"]

    class Wrong(Model):
        def configure_callbacks(self):
            return [Other(), "early stopping"]

    with pytest.raises(ValueError, match=r"Wrong.configure_callbacks\(\) returned str \(item 1\), not a callbacks.Callback"):
        make_trainer(max_steps=1, limit_val_batches=0).fit(Wrong([]), regression_loader)


def test_a_lightning_hook_cadence_never_calls_gets_one_warning_naming_it(make_trainer, regression_loader):
    class OldStyle(Model):
        def training_step_end(self, outputs):
            pass

    class OldCallback(Callback):
        def on_epoch_start(self, trainer, module):
            pass

    trainer = make_trainer(max_steps=1, limit_val_batches=0, callbacks=[OldCallback()])
    with pytest.warns(UserWarning) as warned:
        trainer.fit(OldStyle([]), regression_loader)
        trainer.fit(OldStyle([]), regression_loader)  # the same classes again: no second warning
    messages = [str(w.message) for w in warned if "never calls" in str(w.message)]
    assert len(messages) == 2
    assert messages[0].startswith("OldStyle defines Lightning hooks that Cadence never calls, so their code does not "
                                  "run: training_step_end (removed in Lightning 2.0: finish the step in training_step)")
    assert messages[1].startswith("OldCallback defines Lightning hooks that Cadence never calls, so their code does not "
                                  "run: on_epoch_start (removed in Lightning 2.0: use on_train_epoch_start)")


def test_hooks_cadence_calls_get_no_warning(make_trainer, regression_loader, recwarn):
    calls: list[str] = []
    callback = recording(Callback, "callback.", calls)()
    make_trainer(max_steps=1, callbacks=[callback]).fit(recording(Model, "module.", calls)(calls), regression_loader)
    assert not [w for w in recwarn if "never calls" in str(w.message)]


def test_an_evaluation_step_wrapped_without_a_name_still_runs(make_trainer, regression_loader):
    """A step set on the instance as a functools.partial (Lightning's hook-logging test wraps every hook so) has no
    __name__: the Trainer names the step by the stage."""
    import functools

    from tests.linear_regression import LinearRegression

    seen = []

    class Validates(LinearRegression):
        def validation_step(self, batch, batch_idx):
            seen.append(batch_idx)

    module = Validates()
    module.validation_step = functools.partial(lambda step, *args: step(*args), module.validation_step)
    make_trainer().validate(module, regression_loader, verbose=False)
    assert seen == list(range(len(regression_loader)))
