"""Apple GPUs (MPS): choosing them and refusing them where there are none.

This machine has no Apple GPU, so these tests mock ``torch.backends.mps.is_available`` (and the CUDA
queries, to make the machine GPU-free or not); nothing runs on an MPS device, and a CPU generator
stands in for the Apple GPU's. Training on one is untested here (see docs/devices.md,
"What runs where").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies import MPS, SingleDevice, resolve_strategy
from trainer import Trainer, TrainingModule


@pytest.fixture
def apple_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)


@pytest.fixture
def no_apple_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_mps_chooses_the_apple_gpu(apple_gpu):
    trainer = Trainer(strategy="mps", logger=False)
    assert isinstance(trainer.strategy, MPS)
    assert trainer.strategy.device == torch.device("mps")
    assert trainer.strategy.describe() == "Training on the Apple GPU (mps, chosen)."


def test_an_mps_strategy_object_passes_its_checks_on_a_mac(apple_gpu):
    strategy = MPS()
    assert Trainer(strategy=strategy, logger=False).strategy is strategy


def test_auto_prefers_cuda_to_mps(apple_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    strategy = resolve_strategy("auto")
    assert isinstance(strategy, SingleDevice) and strategy.device == torch.device("cuda", 0)


@pytest.mark.parametrize("strategy", ["mps", MPS()])
def test_mps_without_an_apple_gpu_is_an_error_that_says_what_would_work(no_apple_gpu, strategy):
    with pytest.raises(ValueError, match=r'asks for an Apple GPU, but torch.backends.mps.is_available\(\) is False.*"cpu"'):
        Trainer(strategy=strategy)


def test_mps_on_several_devices_is_an_error(apple_gpu):
    with pytest.raises(ValueError, match=r'strategy="mps", devices=2\) runs one process on one device'):
        Trainer(strategy="mps", devices=2)


# --- the Apple GPU's random numbers ----------------------------------------------------------------
@pytest.fixture
def apple_generator(apple_gpu, monkeypatch):
    """The Apple GPU's generator as ``torch.mps`` exposes it, stood in for by a CPU generator."""
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda device="mps": generator.get_state())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, device="mps": generator.set_state(state))
    return generator


class DrawsOnTheGpu(TrainingModule):
    """Draws from the Apple GPU's generator in every step, as dropout on MPS does."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.generator = generator
        self.draws: list[float] = []

    def training_step(self, batch, batch_idx):
        self.draws.append(torch.rand(1, generator=self.generator).item())
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        torch.rand(1, generator=self.generator)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_resume_leaves_the_apple_gpus_random_stream_as_an_uninterrupted_run_draws_it(
        apple_generator, make_trainer, regression_loader, tmp_path):
    # Validation draws from the stream during fit, as in Lightning; the checkpoint written after it
    # holds the state it left, so the resumed run draws what the uninterrupted one drew next.
    uninterrupted = DrawsOnTheGpu(apple_generator)
    make_trainer(max_epochs=2, num_sanity_val_steps=0).fit(uninterrupted, regression_loader, regression_loader)
    apple_generator.manual_seed(0)
    first = DrawsOnTheGpu(apple_generator)
    make_trainer(max_epochs=1, num_sanity_val_steps=0, enable_checkpointing=True).fit(first, regression_loader,
                                                                                      regression_loader)
    assert first.draws == uninterrupted.draws[:8]
    apple_generator.manual_seed(1234)  # a new process starts with another state
    resumed = DrawsOnTheGpu(apple_generator)
    make_trainer(max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=True).fit(
        resumed, regression_loader, regression_loader, ckpt_path="last")
    assert resumed.draws == uninterrupted.draws[8:]
    assert len(set(uninterrupted.draws)) == 16
