"""What fit / validate / test / predict return, and when the loop validates, limits and stops.

``val_check_interval``, ``check_val_every_n_epoch``, ``limit_*_batches``, ``max_steps`` and
``should_stop`` mean what they mean in PyTorch Lightning.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from callbacks import Callback
from linear_regression import LinearRegression


class Model(LinearRegression):
    """Linear regression that records the (epoch, batch_idx) of each training batch."""

    def __init__(self):
        super().__init__(lr=0.01)
        self.trained: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        self.trained.append((self.current_epoch, batch_idx))
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self.layer(x), y))
        self.log("test/max_target", y.max(), reduce_fx="max")

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


class Validated(Model):
    """Model plus validation; records the global_step at which each validation pass began."""

    def __init__(self):
        super().__init__()
        self.validated_at: list[int] = []

    def on_validation_start(self):
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.global_step)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.layer(x), y))
        self.log("val/samples", float(len(x)), reduce_fx="sum")


# --- what the stages return -----------------------------------------------------------------
def test_validate_and_test_return_one_dict_of_epoch_metrics(make_trainer, regression_loader):
    module = Validated()
    x, y = regression_loader.dataset.tensors
    trainer = make_trainer()
    [validated] = trainer.validate(module, regression_loader)
    [tested] = trainer.test(module, regression_loader)
    full_loss = F.mse_loss(module.layer(x), y).item()
    # Equal batches: the mean of the batch means is the mean over the data set.
    assert validated["val/loss"] == pytest.approx(full_loss, rel=1e-5)
    assert validated["val/samples"] == 64.0  # reduce_fx="sum"
    assert tested == {"test/loss": pytest.approx(full_loss, rel=1e-5), "test/max_target": pytest.approx(y.max().item())}
    assert trainer.callback_metrics["test/loss"].item() == pytest.approx(full_loss, rel=1e-5)


def test_predict_returns_the_outputs_of_each_batch_in_order(make_trainer, regression_loader):
    module = Model()
    predictions = make_trainer().predict(module, regression_loader)
    x, _ = regression_loader.dataset.tensors
    with torch.no_grad():
        expected = [module.layer(x[i : i + 8]) for i in range(0, 64, 8)]
    assert len(predictions) == 8
    assert all(torch.equal(got, want) for got, want in zip(predictions, expected))


def test_evaluation_runs_without_gradients_and_in_eval_mode(make_trainer, regression_loader):
    seen = {}

    class Probe(Validated):
        def validation_step(self, batch, batch_idx):
            seen["grad"], seen["training"] = torch.is_grad_enabled(), self.training

    make_trainer().validate(Probe(), regression_loader)
    assert seen == {"grad": False, "training": False}


def test_stages_take_the_loader_from_the_module_when_none_is_passed(make_trainer, regression_loader):
    class WithLoaders(Validated):
        def train_dataloader(self):
            return regression_loader

        def val_dataloader(self):
            return regression_loader

    module = WithLoaders()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module)
    assert len(module.trained) == 8 and module.validated_at == [8]
    assert "val/loss" in trainer.validate(module)[0]


# --- batches move to the device whatever container holds them -----------------------------
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, wrap):
        self.wrap = wrap
        self.x, self.y = torch.randn(8, 4), torch.randn(8, 2)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return self.wrap(self.x[index], self.y[index])


@pytest.mark.parametrize(
    "wrap, unwrap",
    [
        (lambda x, y: (x, y), lambda batch: batch),
        (lambda x, y: [x, y], lambda batch: batch),
        (lambda x, y: {"x": x, "y": y}, lambda batch: (batch["x"], batch["y"])),
        (lambda x, y: Pair(x, y), lambda batch: (batch.x, batch.y)),
    ],
    ids=["tuple", "list", "dict", "namedtuple"],
)
def test_training_step_receives_the_batch_in_the_container_the_loader_made(make_trainer, wrap, unwrap):
    seen = []

    class Any(Model):
        def training_step(self, batch, batch_idx):
            seen.append(type(batch))
            x, y = unwrap(batch)
            return F.mse_loss(self.layer(x), y)

    make_trainer(max_epochs=1).fit(Any(), DataLoader(PairDataset(wrap), batch_size=4))
    collated = type(next(iter(DataLoader(PairDataset(wrap), batch_size=4))))
    assert seen == [collated, collated]


def test_a_dataclass_batch_reaches_training_step_with_its_fields(make_trainer):
    seen = []

    class WithDataclass(Model):
        def training_step(self, batch, batch_idx):
            seen.append((type(batch), batch.note, batch.x.shape))
            return F.mse_loss(self.layer(batch.x), batch.y)

    def collate(items):
        return Example(torch.stack([i.x for i in items]), torch.stack([i.y for i in items]))

    loader = DataLoader(PairDataset(lambda x, y: Example(x, y)), batch_size=4, collate_fn=collate)
    make_trainer(max_epochs=1).fit(WithDataclass(), loader)
    assert seen == [(Example, "kept", (4, 4))] * 2


# --- when validation runs ------------------------------------------------------------------
@pytest.mark.parametrize(
    "val_check_interval, check_val_every_n_epoch, expected",
    [
        (1.0, 1, [8, 16, 24]),  # once per epoch, after its last batch
        (0.5, 1, [4, 8, 12, 16, 20, 24]),  # twice per epoch
        (0.4, 1, [3, 6, 11, 14, 19, 22]),  # every int(8 * 0.4) = 3 batches; as in Lightning, not again at the end
        (0.25, 2, [10, 12, 14, 16]),  # only in every 2nd epoch (the second), four times
        (3, 1, [3, 6, 11, 14, 19, 22]),  # every 3 batches of each epoch (as in Lightning: not at its end)
        (5, None, [5, 10, 15, 20]),  # every 5 training batches, counted across epochs
    ],
)
def test_validation_runs_at_val_check_interval(make_trainer, regression_loader, val_check_interval,
                                               check_val_every_n_epoch, expected):
    module = Validated()
    trainer = make_trainer(max_epochs=3, val_check_interval=val_check_interval,
                           check_val_every_n_epoch=check_val_every_n_epoch, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.validated_at == expected


def test_sanity_validation_runs_first_and_logs_nothing(make_trainer, regression_loader):
    calls = []

    class Sanity(Validated):
        def validation_step(self, batch, batch_idx):
            calls.append((self.trainer.sanity_checking, self.global_step))
            super().validation_step(batch, batch_idx)

    trainer = make_trainer(max_steps=1, num_sanity_val_steps=2, val_check_interval=1)
    trainer.fit(Sanity(), regression_loader, regression_loader)
    assert calls[:2] == [(True, 0), (True, 0)]
    assert calls[2:] == [(False, 1)] * 8
    assert trainer.logged_metrics["val/samples"] == 64.0  # only the real validation was published


# --- how much runs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "limit_train_batches, limit_val_batches, trained, validated",
    [(3, 2, 3, 16.0), (0.5, 0.25, 4, 16.0), (1.0, 1.0, 8, 64.0), (None, 0, 8, None)],
)
def test_limit_batches_cut_each_epoch(make_trainer, regression_loader, limit_train_batches, limit_val_batches,
                                      trained, validated):
    module = Validated()
    trainer = make_trainer(max_epochs=2, limit_train_batches=limit_train_batches,
                           limit_val_batches=limit_val_batches, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.trained == [(epoch, i) for epoch in range(2) for i in range(trained)]
    assert trainer.logged_metrics.get("val/samples") == validated
    assert trainer.num_training_batches == trained


@pytest.mark.parametrize("limit_val_batches", [0, 0.0])  # a share below one batch (0.01 of 8) is Lightning's error
def test_limit_val_batches_that_leaves_no_batch_turns_validation_off_hooks_and_all(make_trainer, regression_loader,
                                                                                   limit_val_batches):
    started = []

    class Counting(Validated):
        def on_validation_start(self):  # sanity checks included
            started.append(self.global_step)

    trainer = make_trainer(max_epochs=1, limit_val_batches=limit_val_batches)
    trainer.fit(Counting(), regression_loader, regression_loader)
    assert started == [] and "val/loss" not in trainer.callback_metrics


def test_limit_test_and_predict_batches_cut_those_stages(make_trainer, regression_loader):
    trainer = make_trainer(limit_test_batches=2, limit_predict_batches=0.5)
    assert len(trainer.predict(Model(), regression_loader)) == 4
    assert trainer.num_predict_batches == [4]  # per loader, as in Lightning
    trainer.test(Model(), regression_loader)
    assert trainer.num_test_batches == [2]


def test_max_steps_stops_in_the_middle_of_an_epoch(make_trainer, regression_loader):
    module = Model()
    trainer = make_trainer(max_steps=11, accumulate_grad_batches=1)
    trainer.fit(module, regression_loader)
    assert trainer.global_step == 11
    assert module.trained[-1] == (1, 2)


def test_max_steps_counts_optimizer_steps_not_batches(make_trainer, regression_loader):
    module = Model()
    trainer = make_trainer(max_steps=3, accumulate_grad_batches=2)
    trainer.fit(module, regression_loader)
    assert (trainer.global_step, len(module.trained)) == (3, 6)


def test_max_epochs_wins_when_it_comes_before_max_steps(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=2, max_steps=1000)
    trainer.fit(Model(), regression_loader)
    assert (trainer.current_epoch, trainer.global_step) == (2, 16)


def test_a_callback_that_sets_should_stop_ends_training_after_that_batch(make_trainer, regression_loader):
    class StopAtStep(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                trainer.should_stop = True

    module = Model()
    trainer = make_trainer(max_epochs=10, callbacks=[StopAtStep()])
    trainer.fit(module, regression_loader)
    assert trainer.global_step == 5 and len(module.trained) == 5
    assert trainer.should_stop


def test_should_stop_is_reset_by_the_next_fit(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1)
    trainer.should_stop = True
    module = Model()
    trainer.fit(module, regression_loader)
    assert len(module.trained) == 8


class Stream(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            x = torch.randn(4, generator=generator)
            yield x, x[:2] * 2


def test_an_endless_stream_validates_every_n_steps_with_limit_val_batches(make_trainer):
    module = Validated()
    trainer = make_trainer(max_steps=7, val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=2,
                           num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(Stream(), batch_size=4), DataLoader(Stream(), batch_size=4))
    assert module.validated_at == [3, 6]
    assert trainer.logged_metrics["val/samples"] == 8.0


@pytest.mark.parametrize(("limits", "said"), [
    ({"max_epochs": 2}, "max_epochs=2 reached (current_epoch=2). Raise max_epochs"),
    ({"max_epochs": 5, "max_steps": 3}, "max_steps=3 reached (global_step=3). Raise max_steps"),
])
def test_a_fit_whose_end_was_reached_already_says_which_limit_and_reports_nothing(make_trainer, regression_loader,
                                                                                    capsys, limits, said):
    trainer, module = make_trainer(report=True, enable_model_summary=False, **limits), Validated()
    trainer.fit(module, regression_loader, regression_loader)
    capsys.readouterr()
    trained = len(module.trained)
    trainer.fit(module, regression_loader, regression_loader)  # as a notebook cell run twice does
    err = capsys.readouterr().err
    assert f"Trainer.fit trained nothing: {said}" in err
    assert "Performance report" not in err and len(module.trained) == trained


def test_persistent_workers_end_with_the_stage_not_at_garbage_collection(make_trainer, regression_data):
    # Left to the garbage collector, their shutdown waited 5 s per worker (the queues went first).
    import multiprocessing

    loader = DataLoader(regression_data, batch_size=8, num_workers=2, persistent_workers=True)
    trainer, module = make_trainer(max_epochs=2, enable_model_summary=False), Validated()
    trainer.fit(module, loader, loader)
    assert multiprocessing.active_children() == []
    trainer.test(module, loader, verbose=False)  # a later stage starts its own workers, and ends them
    assert multiprocessing.active_children() == []
    assert len(module.trained) == 2 * 8
