"""The loop's edges as Lightning has them: a training_step that skips its batch, what the module
sees during setup, when validation runs. Each expected value is Lightning 2.6's behaviour (its source
named at each test), checked there with the same script."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from callbacks import AMP
from linear_regression import LinearRegression, ManualLinearRegression, regression_samples


class SkipsOddBatches(LinearRegression):
    """Returns None from training_step for every odd batch; records what on_train_batch_end got."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.batch_ends: list[tuple[int, int, object]] = []

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_ends.append((batch_idx, self.trainer.global_step, outputs))


def hand_loop(data, accumulate: int, trains_on) -> torch.Tensor:
    """SGD over ``data`` in batches of 8, one step per ``accumulate`` batches; a batch adds its
    gradient (loss / accumulate) only when ``trains_on(batch_idx)``. Returns the final weight."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for batch_idx, (x, y) in enumerate(DataLoader(data, batch_size=8)):
        if trains_on(batch_idx):
            (F.mse_loss(layer(x), y) / accumulate).backward()
        if (batch_idx + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return layer.weight.detach()


# --- training_step returning None (Lightning: loops/optimization/automatic.py, Closure) ---------------
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_training_step_returning_none_skips_its_batch(make_trainer, regression_data, accumulate):
    torch.manual_seed(0)
    module = SkipsOddBatches()
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=accumulate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: each warning once per line of code
        trainer.fit(module, DataLoader(regression_data, batch_size=8))
    # Only the even batches' gradients reach the weights; the windows still step, as in Lightning.
    torch.testing.assert_close(module.layer.weight.detach(), hand_loop(regression_data, accumulate, lambda i: i % 2 == 0))
    assert trainer.global_step == 8 // accumulate  # Lightning counts the step of a window that ends on a None
    assert [outputs == {} for _, _, outputs in module.batch_ends] == [False, True] * 4  # Lightning's {} for a skip
    skipped = [w for w in caught if "training_step returned None: the batch is skipped" in str(w.message)]
    assert len(skipped) == 1 and skipped[0].filename == __file__  # once, at the user's fit call


def test_a_step_that_skips_every_batch_leaves_the_weights_as_they_were(make_trainer, regression_loader):
    class SkipsAll(LinearRegression):
        def training_step(self, batch, batch_idx):
            return None

    module = SkipsAll()
    before = module.layer.weight.detach().clone()
    trainer = make_trainer(max_epochs=2)
    with pytest.warns(UserWarning, match="training_step returned None"):
        trainer.fit(module, regression_loader)
    torch.testing.assert_close(module.layer.weight.detach(), before, rtol=0, atol=0)
    assert trainer.global_step == 16


def test_a_skipped_batch_under_float16_amp_takes_no_scaler_step(make_trainer, regression_data):
    """Lightning (plugins/precision/amp.py): no unscale and no scaler step after a skipped backward,
    which would otherwise fail on an optimizer without gradients."""
    torch.manual_seed(0)
    module = SkipsOddBatches()
    trainer = make_trainer(max_epochs=1, callbacks=[AMP(torch.float16)])
    with pytest.warns(UserWarning, match="training_step returned None"):
        trainer.fit(module, DataLoader(regression_data, batch_size=8))

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in list(DataLoader(regression_data, batch_size=8))[::2]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(layer(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    torch.testing.assert_close(module.layer.weight.detach(), layer.weight.detach())
    assert trainer.global_step == 8


def test_manual_optimization_may_return_none_from_training_step(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1)
    trainer.fit(ManualLinearRegression(), regression_loader)
    assert trainer.global_step == 8


# --- what the module sees during setup ---------------------------------------------------------------
def test_trainer_model_is_the_model_inside_configure_optimizers(make_trainer, regression_loader):
    """Lightning sets trainer.model before configure_optimizers (the hydra template optimizes
    ``self.trainer.model.parameters()``)."""

    class OptimizesTrainerModel(LinearRegression):
        def configure_optimizers(self):
            self.seen = [self.trainer.model]  # in a list: not registered as a submodule of itself
            return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

    module = OptimizesTrainerModel()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, regression_loader)
    assert module.seen[0] is module
    assert trainer.global_step == 8


# --- when validation runs (Lightning: loops/training_epoch_loop.py _should_check_val_fx) ---------------
class ValidationSteps(LinearRegression):
    """Records (epoch, global_step) at each validation during fit; sets should_stop at batch ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.stop_at, self.validated_at = stop_at, []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.stop_at:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking:
            self.validated_at.append((self.trainer.current_epoch, self.trainer.global_step))


class Twenty(IterableDataset):
    """20 regression samples with no length: the epoch's end shows only when the loader runs out."""

    def __iter__(self):
        x, y = regression_samples(20)
        return iter(zip(x, y))


def test_a_loader_without_a_length_validates_at_each_epochs_end_by_default(make_trainer, regression_loader):
    module = ValidationSteps()
    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(Twenty(), batch_size=4), regression_loader)
    assert module.validated_at == [(0, 5), (1, 10)]
    assert trainer.global_step == 10


class Recorded(IterableDataset):
    """Twenty's samples in 5 batches of 4, appending ("made", i) to ``events`` as batch i is produced."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __iter__(self):
        x, y = regression_samples(20)
        for index in range(5):
            self.events.append(("made", index))
            yield x[4 * index:4 * index + 4], y[4 * index:4 * index + 4]


class RecordsSteps(LinearRegression):
    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def training_step(self, batch, batch_idx):
        self.events.append(("step", batch_idx))
        return super().training_step(batch, batch_idx)


def test_a_loader_without_a_length_is_read_one_batch_ahead(make_trainer):
    # Lightning's fetcher (loops/fetchers.py, _PrefetchDataFetcher) reads such a loader one batch ahead:
    # an agent that plays an episode to make a batch (the RL examples) plays it while the last one trains.
    events: list = []
    make_trainer(max_epochs=1).fit(RecordsSteps(events), DataLoader(Recorded(events), batch_size=None))
    assert events == [("made", 0), ("made", 1), ("step", 0), ("made", 2), ("step", 1), ("made", 3), ("step", 2),
                      ("made", 4), ("step", 3), ("step", 4)]


def test_is_last_batch_is_true_at_the_last_batch_of_a_loader_without_a_length(make_trainer):
    # Lightning sets it from its fetcher, which has read one batch ahead, before training_step runs
    class SeesLastBatch(LinearRegression):
        seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen.append(self.trainer.is_last_batch)
            return super().training_step(batch, batch_idx)

    make_trainer(max_epochs=1).fit(SeesLastBatch(), DataLoader(Recorded([]), batch_size=None))
    assert SeesLastBatch.seen == [False, False, False, False, True]


def test_a_loader_without_a_length_ends_its_accumulation_window_at_its_last_batch(make_trainer):
    # 5 batches, accumulate 2: Lightning steps after batches 1, 3 and the last, 4 (it knows the last one
    # by reading ahead), so 2 epochs take 6 steps and train as the same batches from a loader with a length.
    torch.manual_seed(0)
    without_length = LinearRegression()
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(without_length, DataLoader(Recorded([]), batch_size=None))
    torch.manual_seed(0)
    with_length = LinearRegression()
    make_trainer(max_epochs=2, accumulate_grad_batches=2).fit(
        with_length, DataLoader(torch.utils.data.TensorDataset(*regression_samples(20)), batch_size=4))
    assert trainer.global_step == 6
    assert torch.equal(without_length.layer.weight, with_length.layer.weight)


def test_should_stop_mid_epoch_validates_then_ends_the_epoch(make_trainer, regression_loader):
    module = ValidationSteps(stop_at=4)
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.validated_at == [(0, 5)]  # at the batch that set it, not at the 8th
    assert (trainer.current_epoch, trainer.global_step) == (1, 5)


def test_should_stop_before_min_epochs_validates_only_when_due(make_trainer, regression_loader):
    module = ValidationSteps(stop_at=4)  # sets it in every epoch
    trainer = make_trainer(max_epochs=3, min_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.validated_at == [(0, 8), (1, 16)]
    assert (trainer.current_epoch, trainer.global_step) == (2, 16)


# --- warnings point at the user's line -----------------------------------------------------------------
def test_the_loops_warnings_point_at_the_users_line_not_at_cadence(make_trainer, regression_loader):
    class NoValidationStep(LinearRegression):
        pass

    with pytest.warns(UserWarning) as caught:
        make_trainer(max_steps=-1, limit_train_batches=1).fit(NoValidationStep(), regression_loader, regression_loader)
    where = {str(w.message): w.filename for w in caught}
    assert any(text.startswith("`max_epochs` was not set") for text in where)
    assert any(text.startswith("You passed in a `val_dataloader` but have no `validation_step`") for text in where)
    assert set(where.values()) == {__file__}
