"""The data side as Lightning has it: what 1 and 1.0 mean for the batch limits, hooks set on the
module object, a too-short epoch for the logging interval."""

from __future__ import annotations

import functools
import logging
import re

import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import CSVLogger
from linear_regression import LinearRegression
from trainer import DataModule


@pytest.mark.parametrize("argument, value, means", [
    ("limit_train_batches", 1, "1 batch per epoch will be used"),
    ("limit_val_batches", 1.0, "100% of the batches will be used"),
    ("overfit_batches", 1, "1 batch will be used"),
    ("val_check_interval", 1.0, "validation will run at the end of the training epoch"),
    ("val_check_interval", 1, "validation will run after every batch"),
])
def test_an_int_one_and_a_float_one_are_told_apart(make_trainer, caplog, argument, value, means):
    """As Lightning's info messages: 1 is one batch, 1.0 all of them; nothing when not given."""
    with caplog.at_level(logging.INFO):
        make_trainer(**{argument: value})
    assert f"`Trainer({argument}={value})` was configured so {means}." in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer = make_trainer()
    assert "was configured" not in caplog.text and trainer.val_check_interval == 1.0


def test_hooks_set_on_the_module_object_count_and_none_removes_one(make_trainer, regression_loader):
    """Lightning's tests and notebooks do model.train_dataloader = lambda: loader, and model.validation_step = None."""

    class Validates(LinearRegression):
        def validation_step(self, batch, batch_idx):
            raise AssertionError("set to None: not a hook any more")

    module = Validates()
    module.train_dataloader = lambda: regression_loader
    module.validation_step = None
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, val_dataloaders=regression_loader)
    assert trainer.global_step == 8 and trainer.val_dataloaders is None


def test_an_epoch_shorter_than_the_logging_interval_is_warned_about(make_trainer, regression_data, tmp_path):
    with pytest.warns(UserWarning, match=r"The number of training batches \(2\) is smaller than the logging "
                                         r"interval Trainer\(log_every_n_steps=3\)"):
        make_trainer(max_epochs=1, log_every_n_steps=3, logger=CSVLogger(tmp_path)).fit(
            LinearRegression(), DataLoader(regression_data, batch_size=32))


def test_batch_transfer_hooks_change_every_batch_in_order_the_datamodules_first(make_trainer, regression_loader):
    """Lightning's Kornia tutorial augments in on_after_batch_transfer when trainer.training: it must run."""
    calls = []

    class Augments(LinearRegression):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            raise AssertionError("the DataModule's hook runs instead")

        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append(("after", self.trainer.training, dataloader_idx))
            x, y = batch
            return (x * 0 if self.trainer.training else x), y

        def training_step(self, batch, batch_idx):
            assert not batch[0].any()  # augmented
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            assert batch[0].any()  # as the loader made it

    class Data(DataModule):
        def train_dataloader(self):
            return regression_loader

        def val_dataloader(self):
            return [regression_loader, regression_loader]

        def on_before_batch_transfer(self, batch, dataloader_idx):
            calls.append(("before", self.trainer.training, dataloader_idx))
            return batch

    make_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0).fit(
        Augments(), datamodule=Data())
    assert calls == [("before", True, 0), ("after", True, 0), ("before", False, 0), ("after", False, 0),
                     ("before", False, 1), ("after", False, 1)]


def test_a_datamodule_hook_wrapping_its_default_on_the_instance_leaves_the_modules_hook(make_trainer, regression_loader):
    """Lightning's test_hooks wraps every DataModule hook on the instance (functools.partial with
    update_wrapper) to record it: a wrapper of the default is no override, so the module's runs."""
    calls = []

    class Augments(LinearRegression):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append("module")
            return batch

    class Data(DataModule):
        def train_dataloader(self):
            return regression_loader

    data = Data()
    for hook in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"):
        default = getattr(data, hook)
        setattr(data, hook, functools.update_wrapper(functools.partial(default), default))
    make_trainer(max_epochs=1, limit_train_batches=2).fit(Augments(), datamodule=data)
    assert calls == ["module", "module"]


def test_a_batch_hook_requiring_dataloader_idx_over_one_loader_fails_before_the_first_batch(make_trainer,
                                                                                           regression_loader):
    class RequiresIndex(LinearRegression):
        def validation_step(self, batch, batch_idx):
            raise AssertionError("never reached: the hooks are checked first")

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx):
            pass

    with pytest.raises(RuntimeError, match=r"RequiresIndex.on_validation_batch_end requires dataloader_idx, but runs "
                                           r"over one loader.*only a single `val_dataloader`.*dataloader_idx=0"):
        make_trainer().validate(RequiresIndex(), regression_loader)


def test_a_loader_whose_len_raises_not_implemented_has_no_length(make_trainer, regression_loader):
    class Stream:
        def __iter__(self):
            return iter(regression_loader)

        def __len__(self):
            raise NotImplementedError

    trainer = make_trainer(max_epochs=1)
    trainer.fit(LinearRegression(), Stream())
    assert trainer.global_step == 8 and trainer.num_training_batches == float("inf")


def test_fast_dev_run_one_reads_true_and_bad_limits_say_passed_invalid_value(make_trainer):
    assert make_trainer(fast_dev_run=1).fast_dev_run is True and make_trainer(fast_dev_run=3).fast_dev_run == 3
    for argument in ("limit_train_batches", "limit_val_batches", "overfit_batches", "val_check_interval"):
        with pytest.raises(ValueError, match=rf"Trainer\({argument}=1.2\): you passed invalid value 1.2"):
            make_trainer(**{argument: 1.2})
    with pytest.raises(ValueError, match=r"`reload_dataloaders_every_n_epochs` should be an int >= 0, got 'x'"):
        make_trainer(reload_dataloaders_every_n_epochs="x")


def test_overfit_batches_reads_in_order_whatever_the_sampler(make_trainer, regression_data):
    class Reversed(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(len(regression_data) - 1, -1, -1))

        def __len__(self):
            return len(regression_data)

    class Records(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.first = batch[0][0]
            return super().training_step(batch, batch_idx)

    module = Records()
    with pytest.warns(UserWarning, match="You requested to overfit but enabled train dataloader shuffling.*"
                                         "SequentialSampler in place of its Reversed"):
        make_trainer(max_epochs=1, overfit_batches=1).fit(module, DataLoader(regression_data, sampler=Reversed()))
    assert torch.equal(module.first, regression_data[0][0])


def test_no_loader_and_no_hook_is_lightnings_type_error_too(make_trainer):
    module = LinearRegression()
    module.train_dataloader = None  # Lightning's way of saying a hook is not there
    with pytest.raises(TypeError, match=r"An invalid dataloader was passed to `Trainer.fit\(train_dataloaders=None\)`: "
                                        r"Trainer.fit got no train_dataloaders"):
        make_trainer().fit(module)


def test_a_batch_hook_over_several_loaders_must_take_dataloader_idx(make_trainer, regression_loader):
    class WithoutIndex(LinearRegression):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            raise AssertionError("never reached: the hooks are checked first")

        def on_validation_batch_start(self, batch, batch_idx):
            pass

    with pytest.raises(RuntimeError, match=r"WithoutIndex.on_validation_batch_start runs over several loaders but "
                                           r"takes no dataloader_idx.*multiple `val_dataloader`"):
        make_trainer().validate(WithoutIndex(), [regression_loader, regression_loader])


def test_a_shuffling_evaluation_loader_is_warned_about_as_in_lightning(make_trainer, regression_data, recwarn):
    # The UvA-DL course 05 tests on its shuffling training loader; Lightning's _process_dataloader warns
    # (PossibleUserWarning) for each evaluation stage given a RandomSampler, never for training.
    class Validated(LinearRegression):
        def validation_step(self, batch, batch_idx):
            pass

        def test_step(self, batch, batch_idx):
            pass

    shuffled, ordered = DataLoader(regression_data, batch_size=32, shuffle=True), DataLoader(regression_data, batch_size=32)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(Validated(), shuffled, ordered)
    trainer.test(dataloaders=ordered)
    assert not [w for w in recwarn if "shuffling enabled" in str(w.message)]
    phrase = ("Your `{}_dataloader`'s sampler has shuffling enabled, it is strongly recommended that you turn "
              "shuffling off for val/test dataloaders.")
    with pytest.warns(UserWarning, match=re.escape(phrase.format("val"))):
        make_trainer(max_epochs=1, log_every_n_steps=1).fit(Validated(), ordered, shuffled)
    with pytest.warns(UserWarning, match=re.escape(phrase.format("test"))) as caught:
        trainer.test(dataloaders=shuffled)
    assert [w.filename for w in caught if "shuffling enabled" in str(w.message)] == [__file__]  # the user's line


class ZeroedInputs(DataLoader):
    """A DataLoader subclass that changes its batches, as users' loaders do (collation, sharding, streaming)."""

    def __iter__(self):
        for x, y in super().__iter__():
            yield torch.zeros_like(x), y


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_dataloader_subclass_keeps_its_own_iteration_in_every_stage(make_trainer, regression_data, num_workers):
    # The UvA-DL tutorials' loaders have num_workers=4; Lightning keeps the user's loader object (and sets only its
    # worker_init_fn, when workers are seeded). Cadence rebuilt it as a plain DataLoader (to shield its workers from
    # stop signals, to record batches for resuming and for prediction writers), so a subclass's __iter__ silently
    # stopped running: the steps saw other batches.
    class Records(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.seen.append(("train", float(batch[0].abs().sum())))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.seen.append(("val", float(batch[0].abs().sum())))

        def predict_step(self, batch, batch_idx):
            self.seen.append(("predict", float(batch[0].abs().sum())))

    module = Records()
    module.seen = []
    train, val = (ZeroedInputs(regression_data, batch_size=size, num_workers=num_workers) for size in (16, 32))
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, train, val)
    assert type(trainer.train_dataloader) is ZeroedInputs and type(trainer.val_dataloaders) is ZeroedInputs
    trainer.predict(module, val)
    assert module.seen == [("train", 0.0)] * 4 + [("val", 0.0)] * 2 + [("predict", 0.0)] * 2
    assert train.worker_init_fn is None and val.worker_init_fn is None  # the user's objects are left as they were
