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


@pytest.fixture
def run(make_trainer):
    calls: list[str] = []
    callback = recording(Callback, "callback.", calls)()
    module = recording(Model, "module.", calls)(calls)
    loader = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 2)), batch_size=2)  # 2 batches
    trainer = make_trainer(max_epochs=1, callbacks=[callback], log_every_n_steps=1, num_sanity_val_steps=1)
    return calls, trainer, module, loader


def validation(batches: int) -> list[str]:
    return [
        "callback.on_validation_start", "module.on_validation_start", "module.on_validation_epoch_start",
        *["callback.forward_context", "validation_step", "callback.on_validation_batch_end"] * batches,
        "module.on_validation_epoch_end",
    ]


def training_batch() -> list[str]:
    return [
        "callback.on_train_batch_start", "module.on_train_batch_start",
        "callback.forward_context", "training_step",
        "callback.on_before_optimizer_step", "module.on_before_optimizer_step",
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
        *validation(batches=1), "callback.on_validation_end", "module.on_validation_end",
        "callback.on_train_start", "module.on_train_start",
        "callback.on_train_epoch_start", "module.on_train_epoch_start",
        *training_batch(),  # batch 0: its values are copied to the host, published at the next log step
        *training_batch(), "callback.on_log",  # batch 1: batch 0's values reach on_log
        # validation at val_check_interval=1.0 (the end of the epoch): first batch 1's values
        # (the logs stay in step order), then its own metrics -> on_log
        "callback.on_log",
        *validation(batches=2), "callback.on_log", "callback.on_validation_end", "module.on_validation_end",
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
        "callback.teardown", "module.teardown",
    ]
    calls.clear()
    trainer.test(module, one_batch)
    assert calls == [
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        "callback.on_test_start", "module.on_test_start", "module.on_test_epoch_start",
        "callback.forward_context", "test_step", "callback.on_test_batch_end", "module.on_test_epoch_end",
        "callback.on_log", "callback.on_test_end", "module.on_test_end",
        "callback.teardown", "module.teardown",
    ]
    calls.clear()
    trainer.predict(module, one_batch)
    assert calls == [
        "callback.setup", "module.setup", "module.configure_model", "callback.configure_model",
        "callback.on_predict_start", "module.on_predict_start", "module.on_predict_epoch_start",
        "callback.forward_context", "predict_step", "callback.on_predict_batch_end", "module.on_predict_epoch_end",
        "callback.on_predict_end", "module.on_predict_end",
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
            calls.append(f"teardown({stage})")

    class Broken(Model):
        def training_step(self, batch, batch_idx):
            raise KeyError("boom")

    module = Broken([])
    with pytest.raises(KeyError, match="boom"):
        make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[Watcher()]).fit(module, regression_loader)
    assert calls == ["on_exception('boom')", "teardown(fit)"]
    assert module.trainer is None  # the module is released after the failure too
