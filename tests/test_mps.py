"""Apple GPUs (MPS): choosing them and refusing them where there are none.

This machine has no Apple GPU, so these tests mock ``torch.backends.mps.is_available`` (and the CUDA
queries, to make the machine GPU-free or not); nothing runs on an MPS device. Training on one is
untested here (see docs/devices.md, "What runs where").
"""

from __future__ import annotations

import pytest
import torch

from strategies import MPS, SingleDevice, resolve_strategy
from trainer import Trainer


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
