"""The loaders as Lightning shows and requests them: what trainer.train_dataloader answers, when the
``*_dataloader`` hooks are called under ``reload_dataloaders_every_n_epochs``, and the refused
``training_step(self, dataloader_iter)``. Expected values were measured with Lightning 2.6.6."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from callbacks import Callback
from trainer import TrainingModule
from linear_regression import LinearRegression, regression_samples


def _dataset(count: int = 100) -> TensorDataset:
    return TensorDataset(*regression_samples(count))


class RecordsBatches(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", super().training_step(batch, batch_idx))


class ReadsLoaders(Callback):
    def on_train_start(self, trainer, module):
        train, val = trainer.train_dataloader, trainer.val_dataloaders
        self.seen = dict(batch_size=train.batch_size, sampler=type(train.sampler), drop_last=train.drop_last,
                         length=len(train), batch_sampler_size=train.batch_sampler.batch_size,
                         val_batch_size=val.batch_size, val_length=len(val))


def test_train_dataloader_answers_with_the_users_batch_size_sampler_drop_last_and_length(make_trainer):
    """As Lightning's re-made loader: what user code reads (a scheduler's steps per epoch) is the user's."""
    reader, module = ReadsLoaders(), RecordsBatches()
    trainer = make_trainer(max_epochs=1, callbacks=[reader], num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_dataset(), batch_size=16, shuffle=True, drop_last=True),
                DataLoader(_dataset(), batch_size=32))
    assert reader.seen == dict(batch_size=16, sampler=RandomSampler, drop_last=True, length=6, batch_sampler_size=16,
                               val_batch_size=32, val_length=4)
    assert module.sizes == [16] * 6 and trainer.train_dataloader.batch_size == 16  # after fit too


def test_a_users_batch_sampler_is_kept_and_its_loader_reads_batch_size_none(make_trainer):
    """The loop's own batch sampler (for resuming) wraps the user's: a loader given a batch_sampler reads
    batch_size None, as in torch and Lightning, and its batches are the sampler's (100 = 3 * 30 + 10)."""
    module = RecordsBatches()
    loader = DataLoader(_dataset(), batch_sampler=BatchSampler(SequentialSampler(range(100)), 30, drop_last=False))
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, loader)
    assert trainer.train_dataloader.batch_size is None and trainer.train_dataloader.batch_sampler.batch_size == 30
    assert module.sizes == [30, 30, 30, 10] and trainer.num_training_batches == 4


class CountsLoads(RecordsBatches):
    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[str, int]] = []

    def train_dataloader(self):
        self.loads.append(("train", self.trainer.current_epoch))
        return DataLoader(_dataset(32), batch_size=16)

    def val_dataloader(self):
        self.loads.append(("val", self.trainer.current_epoch))
        return DataLoader(_dataset(32), batch_size=16)


@pytest.mark.parametrize("settings, train_epochs, val_epochs", [
    # The val loaders are made again when validation next runs and `every` epochs have passed since.
    (dict(max_epochs=5, reload_dataloaders_every_n_epochs=2), [0, 2, 4], [0, 2, 4]),
    (dict(max_epochs=5, reload_dataloaders_every_n_epochs=2, check_val_every_n_epoch=3), [0, 2, 4], [0, 2]),
    (dict(max_epochs=12, reload_dataloaders_every_n_epochs=5, check_val_every_n_epoch=3), [0, 5, 10], [0, 2, 8]),
    # No validation: val_dataloader() is never called.
    (dict(max_epochs=3, reload_dataloaders_every_n_epochs=1, limit_val_batches=0), [0, 1, 2], []),
])
def test_reloading_calls_the_hooks_in_the_epochs_lightning_calls_them(make_trainer, settings, train_epochs, val_epochs):
    module = CountsLoads()
    make_trainer(**settings).fit(module)
    assert [epoch for kind, epoch in module.loads if kind == "train"] == train_epochs
    assert [epoch for kind, epoch in module.loads if kind == "val"] == val_epochs


class CountsSanityLoads(CountsLoads):
    def val_dataloader(self):
        self.loads.append(("sanity" if self.trainer.sanity_checking else "val", self.trainer.current_epoch))
        return DataLoader(_dataset(32), batch_size=16)


@pytest.mark.parametrize("sanity_steps, check_every, reload_every, sanity_epochs, val_epochs", [
    # Lightning 2.6.5's own expectations (test_dataloaders_load_every_n_epochs_infrequent_val, which it passes):
    # val_dataloader() is called in the sanity check when there is one, else first when validation first runs.
    (0, 2, 1, [], [1, 3, 5, 7, 9]),
    (1, 1, 1, [0], [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    (1, 3, 4, [0], [2, 8]),  # the sanity check's loaders count for nothing: epoch 0 does not validate
])
def test_val_dataloader_is_first_called_where_lightning_calls_it(make_trainer, sanity_steps, check_every, reload_every,
                                                                 sanity_epochs, val_epochs):
    module = CountsSanityLoads()
    make_trainer(max_epochs=10, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=sanity_steps,
                 check_val_every_n_epoch=check_every, reload_dataloaders_every_n_epochs=reload_every).fit(module)
    assert [epoch for kind, epoch in module.loads if kind == "sanity"] == sanity_epochs
    assert [epoch for kind, epoch in module.loads if kind == "val"] == val_epochs


class RandomData(RecordsBatches):
    """Its hooks draw their data from the global RNG (as Lightning's BoringModel's RandomDataset)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.train_batches, self.val_batches = [], [], []

    def train_dataloader(self):
        self.calls.append("train")
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)

    def val_dataloader(self):
        self.calls.append("val")
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)

    def training_step(self, batch, batch_idx):
        self.train_batches.append(batch[0])
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_batches.append(batch[0])


def test_the_sanity_checks_val_dataloader_comes_first_and_costs_the_run_no_random_numbers(make_trainer):
    """Lightning 2.6.5 calls val_dataloader() in its sanity check, whose RNG it isolates, then train_dataloader()
    (test_dataloaders_load_only_once); so with overfit_batches=1 the first train and val batches are equal
    (test_overfit_batches_same_batch_for_train_and_val; measured: True)."""
    module = RandomData()
    make_trainer(max_epochs=1, overfit_batches=1).fit(module)
    assert module.calls == ["val", "train"]
    assert torch.equal(module.train_batches[0], module.val_batches[0])


def test_a_resumed_fit_counts_reloads_from_the_epoch_it_resumes_at(make_trainer, tmp_path):
    """Lightning's rule on resume: its loaders are made when the resumed fit starts (epoch 3 here), so with
    every 2 epochs they are made again at epochs 5 and 7 (not at 4 and 6, as a run from epoch 0 would)."""
    first = make_trainer(max_epochs=3, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0)
    first.fit(CountsLoads())
    first.save_checkpoint(tmp_path / "epoch3.ckpt")
    module = CountsLoads()
    make_trainer(max_epochs=8, reload_dataloaders_every_n_epochs=2).fit(module, ckpt_path=tmp_path / "epoch3.ckpt")
    # The first train load comes before the checkpoint's state is restored (docs/lightning.md), at its epoch 0;
    # the val loaders, as Lightning's, are made before on_train_start of the resumed fit: Lightning 2.6.5 gives
    # val loads at [3, 5, 7] for this run (its train loads are [3, 5, 7]).
    assert [epoch for kind, epoch in module.loads if kind == "train"] == [0, 5, 7]
    assert [epoch for kind, epoch in module.loads if kind == "val"] == [3, 5, 7]


@pytest.mark.parametrize("stage, step", [("fit", "training_step"), ("fit", "validation_step"),
                                         ("test", "test_step"), ("predict", "predict_step")])
def test_a_step_taking_dataloader_iter_is_refused_before_anything_runs(make_trainer, stage, step):
    def takes_the_iterator(self, dataloader_iter):
        raise AssertionError("never called")

    module = type("IterStep", (RecordsBatches,), {step: takes_the_iterator})()
    loader = DataLoader(_dataset(16), batch_size=8)
    arguments = (loader, loader) if stage == "fit" else (loader,)
    with pytest.raises(TypeError, match=rf"IterStep.{step}\(self, dataloader_iter\) takes the loader's iterator .*"
                                        rf"Write {step}\(self, batch, batch_idx\)"):
        getattr(make_trainer(max_epochs=1), stage)(module, *arguments)
    assert module.sizes == []  # no training_step ran


class RecordsOrder(LinearRegression):
    """Trains on the indices of a shuffled dataset (the weights ignore them) and keeps each epoch's order."""

    def __init__(self, workers: int = 0, persistent: bool = False) -> None:
        super().__init__()
        self.workers, self.persistent, self.orders = workers, persistent, {}

    def train_dataloader(self):
        x, y = regression_samples(12)
        return DataLoader(TensorDataset(torch.arange(12), x, y), batch_size=4, shuffle=True, num_workers=self.workers,
                          persistent_workers=self.persistent)

    def training_step(self, batch, batch_idx):
        self.orders.setdefault(self.current_epoch, []).extend(batch[0].tolist())
        return super().training_step(batch[1:], batch_idx)


def _lightnings_orders(module: RecordsOrder, fresh_at: set[int], epochs: int) -> dict[int, list[int]]:
    """Each epoch's order as Lightning 2.6's fit loop draws it: a loader it has just made (a fit that starts
    past epoch 0, a reload) gets a first iterator, which it throws away and makes again when the epoch is past
    0 (training_epoch_loop.on_run_start), so that one's draws are lost."""
    orders = {}
    for epoch in range(epochs):
        if epoch in fresh_at:
            loader = module.train_dataloader()
            if epoch > 0:
                iter(loader)
        orders[epoch] = [int(i) for indices, *_ in loader for i in indices]
    return orders


@pytest.mark.parametrize("workers, persistent", [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("reload_every", [0, 1])
def test_a_second_fit_and_reloads_draw_each_epochs_order_as_lightning_does(make_trainer, reload_every, workers,
                                                                            persistent):
    torch.manual_seed(3)
    module = RecordsOrder(workers, persistent)
    trainer = make_trainer(max_epochs=2, reload_dataloaders_every_n_epochs=reload_every, limit_val_batches=0,
                           num_sanity_val_steps=0, enable_model_summary=False)
    trainer.fit(module)
    trainer.max_epochs = 4  # continue: the second fit starts at epoch 2 with loaders made anew
    trainer.fit(module)
    torch.manual_seed(3)
    expected_module = RecordsOrder(workers, persistent)  # the same draws before training
    fresh = {0, 2} | (set(range(4)) if reload_every else set())
    assert module.orders == _lightnings_orders(expected_module, fresh, 4)


class DrawsInHooks(RecordsOrder):
    """Draws from the global RNG in the hooks around the first iterator, as fixed noise for sample images or a
    random probe batch would (on_train_start, on_train_epoch_start, on_test_start, on_test_epoch_start)."""

    def __init__(self, workers: int = 0) -> None:
        super().__init__(workers)
        self.draws = {}

    def _draw(self, name):
        self.draws[name] = torch.randn(2).tolist()

    def on_train_start(self):
        self._draw("train_start")

    def on_train_epoch_start(self):
        self._draw(f"epoch {self.current_epoch}")

    def val_dataloader(self):  # only the sanity check runs it
        x, y = regression_samples(8)
        return DataLoader(TensorDataset(x, y), batch_size=4)

    def validation_step(self, batch, batch_idx):
        pass

    def test_dataloader(self):
        return self.train_dataloader()

    def test_step(self, batch, batch_idx):
        self.orders.setdefault("test", []).extend(batch[0].tolist())

    def on_test_start(self):
        self._draw("test_start")

    def on_test_epoch_start(self):
        self._draw("test_epoch_start")


class DrawsInTheSanityCheck(Callback):
    def on_sanity_check_start(self, trainer, module):
        torch.randn(5)

    def on_sanity_check_end(self, trainer, module):
        torch.randn(5)


@pytest.mark.parametrize("workers", [0, 1])
def test_what_the_stage_start_hooks_draw_comes_after_the_first_iterator_as_in_lightning(make_trainer, workers):
    torch.manual_seed(3)
    module = DrawsInHooks(workers)
    trainer = make_trainer(max_epochs=3, num_sanity_val_steps=1, check_val_every_n_epoch=50, enable_model_summary=False,
                           callbacks=[DrawsInTheSanityCheck()])
    trainer.fit(module)
    trainer.test(module)
    # Lightning 2.6.5's rule: the sanity check runs with the RNG isolated (its hooks included); the fit loop makes
    # the training iterator when it sets up its data, before on_train_start, and epoch 0 trains on it; later epochs
    # make theirs after on_train_epoch_start. The evaluation loop makes its iterator before on_test_start.
    torch.manual_seed(3)
    expected = DrawsInHooks(workers)
    loader = expected.train_dataloader()
    iterator = iter(loader)
    expected._draw("train_start")
    for epoch in range(3):
        expected._draw(f"epoch {epoch}")
        if epoch > 0:
            iterator = iter(loader)
        expected.orders[epoch] = [int(i) for indices, *_ in iterator for i in indices]
    iterator = iter(expected.test_dataloader())
    expected._draw("test_start")
    expected._draw("test_epoch_start")
    expected.orders["test"] = [int(i) for indices, *_ in iterator for i in indices]
    assert module.draws == expected.draws
    assert module.orders == expected.orders


class ReadsStepsInConfigureOptimizers(DrawsInHooks):
    """configure_optimizers reads trainer.estimated_stepping_batches (as for OneCycleLR); on_fit_start draws."""

    def configure_optimizers(self):
        self.steps = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()

    def on_fit_start(self):
        self._draw("fit_start")


@pytest.mark.parametrize("second_fit", [False, True])
def test_estimated_stepping_batches_makes_the_training_iterator_where_lightnings_fit_loop_makes_it(make_trainer,
                                                                                                   second_fit):
    torch.manual_seed(3)
    module = ReadsStepsInConfigureOptimizers()
    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=1, check_val_every_n_epoch=50, enable_model_summary=False)
    trainer.fit(module)
    if second_fit:
        trainer.max_epochs = 3
        trainer.fit(module)
    # Lightning 2.6.5: reading estimated_stepping_batches sets up the fit loop's data, its first iterator included,
    # before on_fit_start; after the (isolated) sanity check, the fit loop keeps it. A fit past epoch 0 makes the
    # epoch's own after on_train_epoch_start, as always.
    torch.manual_seed(3)
    expected = ReadsStepsInConfigureOptimizers()
    for first, last in [(0, 2), (2, 3)] if second_fit else [(0, 2)]:
        loader = expected.train_dataloader()
        iterator = iter(loader)
        expected._draw("fit_start")
        expected._draw("train_start")
        for epoch in range(first, last):
            expected._draw(f"epoch {epoch}")
            if epoch > 0:
                iterator = iter(loader)
            expected.orders[epoch] = [int(i) for indices, *_ in iterator for i in indices]
    assert module.draws == expected.draws
    assert module.orders == expected.orders


class SchedulesOverTheFit(TrainingModule):
    """OneCycleLR over trainer.estimated_stepping_batches, as Lightning's examples size it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.estimates: list[int] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        self.estimates.append(self.trainer.estimated_stepping_batches)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=int(self.estimates[-1]))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_second_fit_estimates_its_steps_from_its_own_training_loader(make_trainer):
    def batches(count: int) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4 * count, 4)), batch_size=4)

    module = SchedulesOverTheFit()
    trainer = make_trainer(max_epochs=1, enable_model_summary=False)
    trainer.fit(module, batches(4))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, batches(8))
    # Lightning 2.6.5 gives [4, 16]: max_epochs times the batches of the loader this fit trains on (the first fit's
    # count, 4 batches, made the schedule 8 steps long, with another learning rate at every step).
    assert module.estimates == [4, 16] and trainer.global_step == 12
