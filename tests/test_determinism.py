"""Determinism: the same seed trains the same weights, bit for bit, with DataLoader workers.

``Trainer(seed=...)`` seeds Python, NumPy and torch at the start of ``fit``, gives every
DataLoader worker its own seed (per worker and per rank) and every loader without a generator a
seeded one; ``deterministic=True`` also asks PyTorch for deterministic kernels.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer import Trainer, TrainingModule, seed_everything


class Augmented(Dataset):
    """Regression samples with noise drawn from torch, NumPy and Python in whichever process reads them."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(48, 4, generator=generator)
        self.y = self.x @ torch.randn(4, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        noise = 0.01 * (torch.rand(4) + float(np.random.rand()) + random.random())
        return self.x[index] + noise, self.y[index]


class Dropout(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.Linear(32, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.fixture
def restores_global_determinism(monkeypatch):
    """deterministic=True changes process-wide settings; put them back for the other tests."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def train(make_trainer, seed: int, validate: bool = False, **kwargs) -> dict[str, torch.Tensor]:
    seed_everything(0)  # the same initial weights every time; the Trainer's seed does the rest
    model = Dropout()
    loader = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=2)
    val_loader = DataLoader(Augmented(), batch_size=16, num_workers=2) if validate else None
    make_trainer(max_epochs=2, seed=seed, limit_val_batches=None if validate else 0, **kwargs).fit(model, loader, val_loader)
    return model.state_dict()


def same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(first[key], second[key]) for key in first)


def test_the_same_seed_trains_bit_identical_weights_and_another_seed_does_not(make_trainer, restores_global_determinism):
    first = train(make_trainer, seed=1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert same(first, train(make_trainer, seed=1, deterministic=True))
    assert not same(first, train(make_trainer, seed=2, deterministic=True))


def test_with_a_trainer_seed_validating_does_not_change_the_trained_weights(make_trainer):
    # Trainer(seed=...) gives each loader its own seeded generator, so the validation loader's
    # worker seed is not drawn from the global RNG that dropout draws from.
    assert same(train(make_trainer, seed=3), train(make_trainer, seed=3, validate=True, val_check_interval=2))


class Draws(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index):
        return torch.tensor([torch.rand(()).item(), float(np.random.rand()), random.random()])


class Collects(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.draws: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.draws.append(batch)
        return self.layer(batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_each_dataloader_worker_draws_its_own_random_numbers_reproducibly(make_trainer):
    def draws() -> torch.Tensor:
        module = Collects()
        make_trainer(max_epochs=1, seed=4).fit(module, DataLoader(Draws(), batch_size=2, num_workers=2))
        return torch.cat(module.draws)

    first = draws()
    for column in range(3):  # torch, NumPy and Python: no two samples (in either worker) alike
        assert len(set(first[:, column].tolist())) == 8
    assert torch.equal(first, draws())


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_a_seed_outside_the_range_is_refused(seed):
    with pytest.raises(ValueError, match=rf"seed_everything\(seed={seed!r}\): use an int in \[0, 2\*\*32 - 1\]"):
        Trainer(strategy="cpu", seed=seed, logger=False)


class Indexed(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index):
        return torch.full((3,), float(index))


class DrawsInTrainingStep(Collects):
    """Collects its batches; with ``extra_draws`` its training_step also draws from torch's RNG."""

    def __init__(self, extra_draws: bool) -> None:
        super().__init__()
        self.extra_draws = extra_draws

    def training_step(self, batch, batch_idx):
        if self.extra_draws:
            torch.rand(3)  # e.g. a new dropout layer: model code that consumes random numbers
        return super().training_step(batch, batch_idx)


def test_the_shuffle_order_follows_the_seed_alone_not_the_models_random_draws(make_trainer):
    def order(extra_draws: bool, seed: int = 6) -> list[float]:
        module = DrawsInTrainingStep(extra_draws)
        make_trainer(max_epochs=2, seed=seed).fit(module, DataLoader(Indexed(), batch_size=4, shuffle=True))
        return torch.cat(module.draws)[:, 0].tolist()

    plain = order(extra_draws=False)
    assert order(extra_draws=True) == plain  # epoch 2's order did not move with the extra draws
    assert sorted(plain[:16]) == sorted(plain[16:]) == list(range(16)) and plain[:16] != plain[16:]
    assert order(extra_draws=False, seed=7) != plain


def test_seed_everything_without_a_seed_picks_lightnings_says_which_and_returns_it(monkeypatch, capsys):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with pytest.warns(UserWarning, match="No seed found, seed set to 0"):
        assert seed_everything() == 0
    first = torch.rand(3)
    assert "Seed set to 0" in capsys.readouterr().err
    monkeypatch.setenv("PL_GLOBAL_SEED", "123")  # what a launcher that called seed_everything(123) leaves
    assert seed_everything() == 123 and os.environ["PL_GLOBAL_SEED"] == "123"
    assert capsys.readouterr().err == "Seed set to 123\n"
    seed_everything(0, verbose=False)
    assert torch.equal(torch.rand(3), first) and capsys.readouterr().err == ""
    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    with pytest.raises(ValueError, match=r"Invalid seed specified via PL_GLOBAL_SEED: 'abc'"):
        seed_everything()


def test_seed_everything_with_workers_has_the_trainer_seed_each_dataloader_worker(make_trainer, monkeypatch):
    monkeypatch.setenv("PL_SEED_WORKERS", "0")  # restored after the test

    def draws(workers: bool) -> torch.Tensor:
        seed_everything(5, workers=workers, verbose=False)
        module = Collects()
        make_trainer(max_epochs=1).fit(module, DataLoader(Draws(), batch_size=2, num_workers=2))
        return torch.cat(module.draws)

    seeded = draws(workers=True)
    assert os.environ["PL_SEED_WORKERS"] == "1"
    # Lightning 2.6.5's pl_worker_init_function gives these first two batches (worker 0, then worker 1) on
    # this script: the EXIST2024 k-fold script augments in its workers and trained other weights before.
    assert torch.allclose(seeded[:4], torch.tensor([
        [0.262900173664093, 0.5205332040786743, 0.08706415444612503], [0.1372377872467041, 0.4990329146385193, 0.24844206869602203],
        [0.5283021330833435, 0.6574605703353882, 0.6436907649040222], [0.7849060297012329, 0.6701934337615967, 0.4123179316520691]]))
    for column in range(3):  # torch, NumPy and Python: each worker its own numbers, the same in every run
        assert len(set(seeded[:, column].tolist())) == 8
    assert torch.equal(seeded, draws(workers=True))
    # The workers were seeded by the Trainer (per worker and rank), not left to PyTorch's default.
    assert not torch.equal(seeded[:, 1:], draws(workers=False)[:, 1:])


def test_validation_during_fit_draws_from_the_global_rng_as_in_lightning(make_trainer):
    """Lightning isolates only the sanity check's RNG: the validation loader's iter() draws its base
    seed from torch's RNG, so after seed_everything the second epoch's order is the one of a plain
    loop that iterates the validation loader between the epochs (the same as under Lightning 2.6)."""
    def loaders() -> tuple[DataLoader, DataLoader]:
        return DataLoader(Indexed(), batch_size=4, shuffle=True), DataLoader(Indexed(), batch_size=8)

    class Validated(Collects):
        def validation_step(self, batch, batch_idx):
            self.log("val/mean", self.layer(batch).mean())

    seed_everything(42)
    module = Validated()
    train_loader, val_loader = loaders()
    make_trainer(max_epochs=2).fit(module, train_loader, val_loader)  # with the default sanity check
    trained = torch.cat(module.draws)[:, 0].tolist()

    seed_everything(42)
    Collects()  # the same initial draws
    train_loader, val_loader = loaders()
    first_epoch = [float(index) for batch in train_loader for index in batch[:, 0]]
    list(val_loader)
    second_epoch = [float(index) for batch in train_loader for index in batch[:, 0]]
    assert trained == first_epoch + second_epoch
