"""Single-device strategies: choosing the device, reporting it, refusing one that does not exist,
and moving batches.

This machine has no GPU; where a test needs one, it mocks the few ``torch.cuda`` /
``torch.backends.mps`` queries the strategy makes, never Cadence's own code.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies
from linear_regression import LinearRegression
from strategies import SingleDevice, Strategy, resolve_strategy
from strategies.transfer import pins_batches
from trainer import Trainer


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as a CPU-only one, even where the test suite runs on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


# --- choosing the device ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cpu", "CPU", " cpu "])
def test_cpu_strings_choose_the_cpu(name):
    strategy = resolve_strategy(name)
    assert isinstance(strategy, SingleDevice) and strategy.device == torch.device("cpu")


def test_a_strategy_object_is_used_as_given():
    strategy = SingleDevice("cpu")
    assert Trainer(strategy=strategy).strategy is strategy


def test_auto_on_a_cpu_machine_chooses_the_cpu_and_warns_it_will_be_slow(no_gpu):
    strategy = resolve_strategy("auto")
    assert strategy.device == torch.device("cpu")
    assert "Training on the CPU (detected" in strategy.describe()
    assert "No CUDA or MPS device was found: training will be slow." in strategy.describe()


def test_auto_prefers_cuda_and_reports_every_gpu(two_gpus):
    strategy = Trainer(strategy="auto").strategy
    assert strategy.device == torch.device("cuda", 0)
    report = strategy.describe()
    assert report.startswith("Training on cuda:0 (detected).")
    assert "cuda:0 NVIDIA Test GPU, 80.0 GiB, compute capability 9.0" in report
    assert "cuda:1 NVIDIA Test GPU" in report


def test_auto_chooses_mps_on_an_apple_gpu(no_gpu, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    strategy = resolve_strategy("auto")
    assert strategy.device == torch.device("mps")
    assert strategy.describe() == "Training on the Apple GPU (mps, detected)."


def test_cuda_means_the_first_gpu_and_cuda_n_the_nth(two_gpus):
    assert Trainer(strategy="cuda").strategy.device == torch.device("cuda", 0)
    assert Trainer(strategy="cuda:1").strategy.device == torch.device("cuda", 1)


def test_fit_reports_the_device_on_stderr(make_trainer, regression_loader, capsys):
    make_trainer(max_steps=1).fit(LinearRegression(), regression_loader)
    assert "Training on the CPU (chosen, " in capsys.readouterr().err


# --- refusing what does not exist ----------------------------------------------------------------
def test_cuda_on_a_machine_without_gpus_says_what_pytorch_sees(no_gpu):
    with pytest.raises(ValueError, match=r'strategy="cuda:0" asks for a CUDA device, but PyTorch sees none'):
        Trainer(strategy="cuda")


def test_a_gpu_index_that_does_not_exist_names_the_visible_ones(two_gpus):
    with pytest.raises(ValueError, match=r"asks for cuda:5; 2 CUDA device\(s\) visible \(cuda:0, cuda:1\)"):
        Trainer(strategy="cuda:5")


def test_mps_without_an_apple_gpu_is_an_error(no_gpu):
    with pytest.raises(ValueError, match=r'strategy="mps" asks for an Apple GPU, but torch.backends.mps.is_available\(\) is False'):
        Trainer(strategy="mps")


@pytest.mark.parametrize("strategy", ["gpu", "cuda:x", "tpu", 3])
def test_an_unknown_strategy_lists_the_known_ones(strategy):
    with pytest.raises(ValueError, match=r'is not a strategy. Use "auto", "cpu", "cuda", "cuda:N", "mps", "ddp"'):
        Trainer(strategy=strategy)


def test_several_devices_on_a_single_device_strategy_is_an_error():
    with pytest.raises(ValueError, match=r'Trainer\(strategy="cpu", devices=4\) runs one process on one device'):
        Trainer(strategy="cpu", devices=4)


# --- moving batches ---------------------------------------------------------------------------------
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Example:
    image: torch.Tensor
    label: int
    name: str = "kept"


def test_batch_to_device_moves_every_tensor_inside_any_container():
    # The "meta" device shows a move without a GPU: a tensor that moved reports device "meta".
    strategy = SingleDevice(torch.device("meta"))
    batch = {
        "pair": Pair(torch.ones(2), [torch.zeros(1), (torch.ones(3), "text")]),
        "example": Example(torch.ones(2, 2), 7),
        "count": 3,
    }
    moved = strategy.batch_to_device(batch)
    assert type(moved["pair"]) is Pair and moved["pair"].x.device.type == "meta"
    assert moved["pair"].y[0].device.type == "meta" and moved["pair"].y[1][0].device.type == "meta"
    assert isinstance(moved["pair"].y, list) and isinstance(moved["pair"].y[1], tuple)
    assert moved["pair"].y[1][1] == "text"
    assert type(moved["example"]) is Example and moved["example"].image.device.type == "meta"
    assert (moved["example"].label, moved["example"].name, moved["count"]) == (7, "kept", 3)
    assert batch["example"].image.device.type == "cpu"  # the loader's batch is left as it was


def test_a_cuda_run_pins_a_loader_that_does_not_and_keeps_one_that_does(two_gpus):
    strategy = SingleDevice("cuda")
    data = TensorDataset(torch.arange(6.0).unsqueeze(1))
    unpinned = DataLoader(data, batch_size=2, shuffle=True)
    rebuilt = strategy.setup_dataloader(unpinned, shuffle=True)
    assert pins_batches(rebuilt) and not pins_batches(unpinned)  # the user's loader is left as it was
    assert (rebuilt.dataset, rebuilt.batch_size, type(rebuilt.sampler)) == (data, 2, type(unpinned.sampler))
    with_workers = strategy.setup_dataloader(DataLoader(data, batch_size=2, num_workers=1), shuffle=True)
    assert with_workers.pin_memory  # the DataLoader's pinning thread does it, off the loop's thread
    pinned = DataLoader(data, batch_size=2, pin_memory=True)
    assert strategy.setup_dataloader(pinned, shuffle=True) is pinned


class NamedLoader(DataLoader):
    """A DataLoader subclass: rebuilding it as a plain DataLoader would lose what it adds."""


def test_a_cuda_run_keeps_a_dataloader_subclass_that_does_not_pin_and_says_what_it_costs(two_gpus):
    loader = NamedLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)
    with pytest.warns(UserWarning, match=r"The NamedLoader does not pin memory.*Pass pin_memory=True to it"):
        assert SingleDevice("cuda").setup_dataloader(loader, shuffle=True) is loader


def test_the_cpu_keeps_a_loader_without_pinned_memory_as_it_is():
    unpinned = DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SingleDevice("cpu").setup_dataloader(unpinned, shuffle=True) is unpinned


def test_the_base_strategy_is_one_process():
    strategy = Strategy()
    tensor = torch.ones(2)
    assert (strategy.global_rank, strategy.local_rank, strategy.world_size, strategy.is_global_zero) == (0, 0, 1, True)
    assert strategy.all_reduce(tensor) is tensor
    assert strategy.all_gather_object({"a": 1}) == [{"a": 1}]
    assert strategy.broadcast_object(5) == 5 and strategy.reduce_any(True) is True
    assert strategy.launch(lambda a, b: a + b, 2, 3) == 5
    assert hasattr(strategies, "resolve_strategy")


class _Regressor(LinearRegression):
    def test_step(self, batch, batch_idx):
        self.training_step(batch, batch_idx)


def test_the_device_report_is_printed_once_per_trainer_not_for_every_stage(make_trainer, regression_loader, capsys):
    trainer, module = make_trainer(max_epochs=1, enable_model_summary=False), _Regressor()
    trainer.fit(module, regression_loader)
    trainer.test(module, regression_loader, verbose=False)
    assert capsys.readouterr().err.count("Training on the CPU (chosen") == 1
    make_trainer(enable_model_summary=False).test(module, regression_loader, verbose=False)  # another Trainer says it
    assert capsys.readouterr().err.count("Training on the CPU (chosen") == 1
