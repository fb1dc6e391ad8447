"""The batch-size finder: ``Tuner(trainer).scale_batch_size`` and the ``BatchSizeFinder`` callback.

The machine has no GPU to run out of, so the modules here raise ``torch.OutOfMemoryError`` (what
CUDA raises) from their step above a chosen batch size: the search must find the largest size
below it, as Lightning's does, write it where Lightning does, run the stage with it, and leave
the weights, counters and RNG as they were.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import BatchSizeFinder
from trainer import DataModule, TrainingModule, Tuner


def batch_size_of(loader) -> int:
    """The size of the batches ``loader`` yields (the Trainer's loaders batch through a sampler)."""
    return len(next(iter(loader))[0])


def dataset(size: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(size, 4, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Net(TrainingModule):
    """Runs out of memory on batches larger than ``memory`` samples."""

    def __init__(self, batch_size: int | None = 2, memory: int = 10**9, samples: int = 64):
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        self.memory, self.samples = memory, samples
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.batch_sizes: list[int] = []

    def step(self, batch):
        x, y = batch
        self.batch_sizes.append(len(x))
        if len(x) > self.memory:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} samples")
        return F.mse_loss(self.layer(x), y)

    def training_step(self, batch, batch_idx):
        return self.step(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.step(batch))

    def predict_step(self, batch, batch_idx):
        return self.step(batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def loader(self):
        return DataLoader(dataset(self.samples), batch_size=self.batch_size, shuffle=True)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = loader


@pytest.mark.parametrize(("mode", "expected"), [("power", 62), ("binsearch", 95)])
def test_the_largest_size_that_fits_is_found_as_lightning_finds_it(make_trainer, mode, expected):
    """Lightning's test_dataloader_batch_size_updated_on_failure: memory for 100 samples of 1000."""
    model = Net(batch_size=16, memory=100, samples=1000)
    trainer = make_trainer(max_epochs=2)
    found = Tuner(trainer).scale_batch_size(model, mode=mode, init_val=500, max_trials=10, steps_per_trial=1)
    assert found == model.batch_size == expected  # binsearch: 100, less its 5% margin
    assert batch_size_of(trainer.train_dataloader) == expected  # the stage's loader, made again with it
    assert max(size for size in model.batch_sizes if size <= 100) <= 100


def test_the_search_doubles_until_max_trials_and_leaves_the_model_as_it_was(make_trainer):
    model = Net()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = make_trainer(max_epochs=3)
    assert Tuner(trainer).scale_batch_size(model, max_trials=4, steps_per_trial=2) == 16
    assert model.batch_sizes == [2, 2, 4, 4, 8, 8, 16, 16]  # steps_per_trial steps at each size
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert (trainer.global_step, trainer.current_epoch, trainer.max_epochs) == (0, 0, 3)


def test_the_callback_searches_then_fits_exactly_as_with_the_size_set_from_the_start(make_trainer):
    model = Net()
    torch.manual_seed(11)
    trainer = make_trainer(max_epochs=2, callbacks=[BatchSizeFinder(max_trials=4)])
    trainer.fit(model)
    assert model.batch_size == 16 and trainer.global_step == 2 * 64 // 16

    fresh = Net(batch_size=16)
    torch.manual_seed(11)  # the search left the RNG (the shuffling's) where it found it
    make_trainer(max_epochs=2).fit(fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert model.batch_sizes[-8:] == fresh.batch_sizes[-8:] == [16] * 8


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_the_callback_tunes_the_evaluation_stages_too(make_trainer, stage):
    model = Net(memory=20)
    trainer = make_trainer(callbacks=[BatchSizeFinder(max_trials=6, steps_per_trial=1)])
    getattr(trainer, stage)(model, verbose=False) if stage != "predict" else trainer.predict(model)
    assert model.batch_size == 16  # 32 ran out of memory
    counts = {"validate": trainer.num_val_batches, "test": trainer.num_test_batches,
              "predict": trainer.num_predict_batches}
    assert counts[stage] == [4] and model.batch_sizes[-4:] == [16] * 4  # the stage ran at that size
    assert trainer.global_step == 0


@pytest.mark.parametrize("holder", ["model", "model.hparams", "datamodule", "datamodule.hparams"])
def test_the_size_is_written_where_lightning_writes_it(make_trainer, holder):
    class Data(DataModule):
        def __init__(self):
            super().__init__()
            if holder == "datamodule":
                self.batch_size = 2
            elif holder == "datamodule.hparams":
                self.hparams.batch_size = 2

        def train_dataloader(self):
            size = self.batch_size if holder == "datamodule" else self.hparams.batch_size
            return DataLoader(dataset(), batch_size=size)

    class HparamsNet(Net):
        def __init__(self, batch_size: int = 2):
            super().__init__(batch_size=None)
            self.save_hyperparameters()

        def loader(self):
            return DataLoader(dataset(), batch_size=self.hparams.batch_size)

        train_dataloader = val_dataloader = loader

    model = HparamsNet() if holder == "model.hparams" else Net(batch_size=2 if holder == "model" else None)
    datamodule = Data() if holder.startswith("datamodule") else None
    trainer = make_trainer(max_epochs=1)
    Tuner(trainer).scale_batch_size(model, datamodule=datamodule, max_trials=3, steps_per_trial=1)
    owner = {"model": model, "model.hparams": model.hparams, "datamodule": datamodule,
             "datamodule.hparams": datamodule.hparams if datamodule else None}[holder]
    assert (owner["batch_size"] if isinstance(owner, dict) else owner.batch_size) == 8
    assert batch_size_of(trainer.train_dataloader) == 8


def test_no_trials_keep_the_size(make_trainer):
    model = Net(batch_size=2)
    assert Tuner(make_trainer(max_epochs=1)).scale_batch_size(model, max_trials=0) == 2
    assert model.batch_sizes == []


def test_max_val_caps_the_size_and_is_itself_tried(make_trainer, caplog):
    model = Net()
    with caplog.at_level(logging.INFO):  # the program configured logging: the messages go there, as Lightning's
        assert Tuner(make_trainer(max_epochs=1)).scale_batch_size(model, max_trials=10, steps_per_trial=1, max_val=6) == 6
    assert model.batch_sizes == [2, 4, 6]
    assert "Reached the maximum batch size limit of 6" in caplog.text
    assert caplog.text.count("trying batch size") == 2  # 2 -> 4, 4 -> 6


def test_the_dataset_length_ends_the_search(make_trainer, caplog):
    model = Net(samples=20)
    with caplog.at_level(logging.INFO):
        assert Tuner(make_trainer(max_epochs=1)).scale_batch_size(model, steps_per_trial=1) == 32
    assert "greater or equal than the length of your dataset: 20" in caplog.text


def test_an_error_other_than_memory_propagates_and_restores_the_model(make_trainer):
    class Broken(Net):
        def training_step(self, batch, batch_idx):
            if len(batch[0]) > 4:
                raise RuntimeError("a bug in training_step")
            loss = super().training_step(batch, batch_idx)
            return loss

    model = Broken()
    before = [value.clone() for value in model.state_dict().values()]
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        Tuner(make_trainer(max_epochs=1)).scale_batch_size(model, max_trials=5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before))


def test_loaders_passed_to_fit_are_refused(make_trainer):
    model = Net()
    with pytest.raises(ValueError, match="cannot be used with dataloaders passed directly to Trainer.fit"):
        Tuner(make_trainer(max_epochs=1)).scale_batch_size(model, train_dataloaders=model.loader())


def test_a_model_without_the_attribute_is_refused(make_trainer):
    with pytest.raises(ValueError, match="Field batch_size not found in `model`, `datamodule`, nor their `hparams`"):
        Tuner(make_trainer(max_epochs=1)).scale_batch_size(Net(batch_size=None))


def test_several_evaluation_loaders_are_refused(make_trainer):
    class Two(Net):
        def test_dataloader(self):
            return [self.loader(), self.loader()]

    with pytest.raises(ValueError, match="cannot be used with multiple test dataloaders"):
        Tuner(make_trainer()).scale_batch_size(Two(), method="test")


def test_distributed_strategies_are_refused(make_trainer):
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        Tuner(make_trainer(strategy="ddp", devices=2)).scale_batch_size(Net())


def test_bad_finder_arguments_are_refused(make_trainer):
    with pytest.raises(ValueError, match="`mode` should be either of"):
        Tuner(make_trainer()).scale_batch_size(Net(), mode="ThisModeDoesNotExist")
    with pytest.raises(ValueError, match="`margin` should be between 0 and 1"):
        BatchSizeFinder(margin=1.5)
    with pytest.raises(ValueError, match="already configured with a `BatchSizeFinder`"):
        Tuner(make_trainer(callbacks=[BatchSizeFinder()])).scale_batch_size(Net())
