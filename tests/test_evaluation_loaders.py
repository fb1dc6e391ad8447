"""Several validation, test and prediction loaders (run in turn, ``dataloader_idx``, Lightning's metric
suffixes), a module without the step a loader is given to, and validate/test/predict after fit with
``model=None`` and ``ckpt_path="best" | "last"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from linear_regression import LinearRegression
from trainer import TrainingModule


def loader(offset: float, count: int = 8, batch_size: int = 4) -> DataLoader:
    """``count`` samples whose targets are the inputs' first two columns plus ``offset``."""
    x = torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) / 10
    return DataLoader(TensorDataset(x, x[:, :2] + offset), batch_size=batch_size)


class Regressor(LinearRegression):
    def __init__(self):
        super().__init__(lr=0.05)
        self.seen: list[tuple[int, int]] = []  # (dataloader_idx, batch_idx) of each evaluation batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append((dataloader_idx, batch_idx))
        x, y = batch
        self.log("val/loss", F.mse_loss(self.layer(x), y))

    def on_validation_epoch_end(self):
        self.log("val/epochs", 1.0)  # outside the loaders: no suffix, in every loader's results

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("test/loss", F.mse_loss(self.layer(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return dataloader_idx, batch_idx


def expected_loss(module: TrainingModule, data: DataLoader) -> float:
    x, y = data.dataset.tensors
    with torch.no_grad():
        return F.mse_loss(module.layer(x), y).item()


# --- several loaders -----------------------------------------------------------------------------
def test_two_validation_loaders_run_in_turn_with_their_index_and_suffixed_metrics(make_trainer):
    module, near, far = Regressor(), loader(0.0), loader(5.0)
    results = make_trainer().validate(module, [near, far], verbose=False)
    assert module.seen == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert results == [
        {"val/loss/dataloader_idx_0": pytest.approx(expected_loss(module, near)), "val/epochs": 1.0},
        {"val/loss/dataloader_idx_1": pytest.approx(expected_loss(module, far)), "val/epochs": 1.0},
    ]


def test_fit_validates_on_each_loader_of_a_dict_and_logs_them_apart(make_trainer):
    module = Regressor()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=1, limit_val_batches=1)
    trainer.fit(module, loader(0.0), {"near": loader(0.0), "far": loader(5.0)})
    assert module.seen == [(0, 0), (1, 0)] * 2  # the sanity check and the epoch's validation, one batch each
    assert trainer.num_val_batches == [1, 1]
    assert {"val/loss/dataloader_idx_0", "val/loss/dataloader_idx_1"} <= set(trainer.callback_metrics)


def test_callbacks_get_the_dataloader_idx_of_each_batch(make_trainer):
    seen = []

    class Recording(Callback):
        def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
            seen.append((dataloader_idx, batch_idx))

    make_trainer(callbacks=[Recording()]).test(Regressor(), [loader(0.0), loader(1.0, count=4)], verbose=False)
    assert seen == [(0, 0), (0, 1), (1, 0)]


def test_predict_over_two_loaders_returns_one_list_each(make_trainer):
    predictions = make_trainer().predict(Regressor(), [loader(0.0), loader(0.0, count=12)])
    assert predictions == [[(0, 0), (0, 1)], [(1, 0), (1, 1), (1, 2)]]
    assert make_trainer().predict(Regressor(), loader(0.0), return_predictions=False) is None


def test_the_steps_signature_must_fit_the_number_of_loaders(make_trainer):
    class WithoutIndex(Regressor):
        def validation_step(self, batch, batch_idx):
            pass

    class RequiresIndex(Regressor):
        def validation_step(self, batch, batch_idx, dataloader_idx):
            pass

    with pytest.raises(TypeError, match=r"WithoutIndex.validation_step runs over several loaders but takes no "
                                        r"dataloader_idx \(.*no `dataloader_idx` argument.*\). Add it to the "
                                        r"signature: def validation_step\(self, ..., dataloader_idx=0\)"):
        make_trainer().validate(WithoutIndex(), [loader(0.0), loader(1.0)])
    with pytest.raises(TypeError, match=r"RequiresIndex.validation_step requires dataloader_idx, but runs over one "
                                        r"loader, which passes none \(.*\). Give it a default: dataloader_idx=0"):
        make_trainer().validate(RequiresIndex(), loader(0.0))


def test_validate_prints_the_metrics_of_each_loader(make_trainer, capsys):
    make_trainer().validate(Regressor(), [loader(0.0), loader(5.0)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Validate", "metric", "DataLoader", "0", "DataLoader", "1"]
    assert [line.split()[0] for line in lines[1:]] == ["val/epochs", "val/loss"]


# --- a loader without its step ---------------------------------------------------------------------
class Untouchable(DataLoader):
    """A loader that fails the test if a batch is fetched from it."""

    def __iter__(self):
        raise AssertionError("a batch was fetched")


def test_a_val_loader_for_a_module_without_validation_step_is_not_read_and_warns_once(make_trainer):
    class TrainOnly(Regressor):
        validation_step = TrainingModule.validation_step

    trainer = make_trainer(max_epochs=2)
    with pytest.warns(UserWarning, match="You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop: TrainOnly") as warned:
        trainer.fit(TrainOnly(), loader(0.0), Untouchable(loader(0.0).dataset))
    assert len(warned) == 1 and trainer.global_step == 4


# --- after fit: model=None, ckpt_path="best" | "last" -----------------------------------------------
@pytest.fixture
def fitted(make_trainer, tmp_path):
    """Three epochs ranked by val/loss; the model then trains on with a bad step so its weights are
    neither the best checkpoint's nor the last's."""
    module = Regressor()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val/loss", save_top_k=1)
    trainer = make_trainer(max_epochs=3, callbacks=[checkpoints], num_sanity_val_steps=0)
    trainer.fit(module, loader(0.0), loader(0.0))
    with torch.no_grad():
        module.layer.weight.add_(100.0)
    return trainer, module, checkpoints


def weights_of(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def test_test_without_a_model_loads_the_best_checkpoint_into_the_fitted_module(fitted):
    trainer, module, checkpoints = fitted
    # Lightning 2.6.5's words first (its test_checkpoint_path_input_last), then which file.
    with pytest.warns(UserWarning, match=r"^`.test\(ckpt_path=None\)` was called without a model. The best model of the "
                                         r"previous `fit` call will be used. .* got no model and no ckpt_path, so it "
                                         r"loads the best checkpoint of the last fit: .*epoch=\d+-step=\d+.ckpt.\)$"):
        [result] = trainer.test(dataloaders=loader(0.0), verbose=False)
    assert torch.equal(module.layer.weight, weights_of(checkpoints.best_model_path)["layer.weight"])
    assert result["test/loss"] == pytest.approx(expected_loss(module, loader(0.0)))


@pytest.mark.parametrize("which", ["best", "last"])
def test_ckpt_path_best_or_last_chooses_the_weights(fitted, which):
    trainer, module, checkpoints = fitted
    trainer.validate(ckpt_path=which, dataloaders=loader(0.0), verbose=False)
    path = checkpoints.best_model_path if which == "best" else checkpoints.last_model_path
    assert torch.equal(module.layer.weight, weights_of(path)["layer.weight"])


def test_ckpt_path_best_needs_a_checkpoint_callback_and_a_model_needs_a_fit(make_trainer):
    trainer = make_trainer()
    with pytest.raises(TypeError, match=r"Trainer.test\(\) got no model, and this Trainer has run none yet"):
        trainer.test(dataloaders=loader(0.0))
    with pytest.raises(ValueError, match=r'Trainer.test\(ckpt_path="best"\) loads the best checkpoint of a '
                                         "callbacks.ModelCheckpoint, and this Trainer has none"):
        trainer.test(Regressor(), loader(0.0), ckpt_path="best")
    with pytest.raises(ValueError, match=r'Trainer.fit\(ckpt_path="best"\) loads the best checkpoint of a '
                                         "callbacks.ModelCheckpoint, and this Trainer has none"):
        trainer.fit(Regressor(), loader(0.0), ckpt_path="best")


def test_fit_with_ckpt_path_best_continues_from_the_best_checkpoint_as_lightning(fitted, make_trainer):
    _, module, checkpoints = fitted
    best = checkpoints.best_model_path
    saved = torch.load(best, weights_only=True)
    trainer = make_trainer(max_epochs=5, callbacks=[checkpoints], num_sanity_val_steps=0)
    trainer.fit(module, loader(0.0), loader(0.0), ckpt_path="best")
    # Lightning resolves "best" for fit too: the run continues after the best checkpoint's epoch, 2 steps an epoch
    assert trainer.ckpt_path == best
    assert trainer.global_step == saved["global_step"] + 2 * (5 - saved["epoch"] - 1)


class EpochSampler(torch.utils.data.SequentialSampler):
    """A sampler that shuffles by epoch (as DistributedSampler): records each ``set_epoch``."""

    def __init__(self, data):
        super().__init__(data)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def with_epoch_sampler(offset: float, batch_sampler: bool) -> DataLoader:
    data = loader(offset).dataset
    sampler = EpochSampler(data)
    if batch_sampler:
        return DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 4, drop_last=False))
    return DataLoader(data, sampler=sampler, batch_size=4)


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_validation_loaders_samplers_are_told_the_epoch_as_lightnings(make_trainer, batch_sampler):
    # Lightning calls set_epoch on every evaluation loader's sampler each time it runs: the sanity check and
    # epoch 0's validation with 0, epoch 1's with 1; a validate() after two epochs with 2.
    train, val = with_epoch_sampler(0.0, batch_sampler), with_epoch_sampler(1.0, batch_sampler)
    trainer = make_trainer(max_epochs=2, limit_train_batches=1, limit_val_batches=1)
    trainer.fit(Regressor(), train, val)
    sampler_of = (lambda dl: dl.batch_sampler.sampler) if batch_sampler else (lambda dl: dl.sampler)
    assert (sampler_of(train).epochs, sampler_of(val).epochs) == ([0, 1], [0, 0, 1])
    later = with_epoch_sampler(1.0, batch_sampler)
    trainer.validate(trainer.module, later, verbose=False)
    assert sampler_of(later).epochs == [2]
