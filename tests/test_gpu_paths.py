"""The CUDA, NCCL and MPS paths, reached on a CPU: batch transfer, the prefetcher, metrics logged
on two devices, and the checks DDP makes before it starts processes on GPUs.

This machine has no GPU. Where a path branches on the device type, the ``meta`` device (which
holds no data) or a stand-in tensor that reports another device stands in; where it calls CUDA,
an object with the same methods records the calls. Mocked: only what the machine lacks (the
``torch.cuda`` queries, tensors on a GPU, copies to one), never Cadence's own code. The same
paths run for real in ``benchmarks/cuda_sync_check.py`` on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import importlib.util
import itertools
import os
import pickle
import signal
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import Callback, Compile, PerformanceReport
from strategies import DDP, MPS, SingleDevice, Strategy, forensics
from strategies.pickling import PickledWork
from strategies.prefetch import prefetch_to_device
from strategies.process_group import end_process_group, local_cuda_index
from strategies.spawn import failure_message
from strategies.transfer import move_to_device, optimizer_states_to
from tests.linear_regression import LinearRegression
from trainer import Trainer, TrainingModule

META = torch.device("meta")


# --- stand-ins for what this machine lacks ---------------------------------------------------------
class RecordedCopies(TorchFunctionMode):
    """Records ``(device type, non_blocking)`` of every ``Tensor.to``; a copy to a device this
    machine lacks (cuda, mps) returns an empty tensor on ``meta`` instead."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            device = torch.device(args[1])
            self.copies.append((device.type, kwargs.get("non_blocking", False)))
            if device.type in ("cuda", "mps"):
                return torch.empty_like(args[0], device=META)
        return func(*args, **kwargs)


class OnAnotherDevice(torch.Tensor):
    """A tensor on a device this machine lacks, as the code sees it: it reports ``meta``, computes
    on the CPU tensor it wraps, copies to the CPU with ``.to("cpu")``, and, like a GPU tensor,
    refuses to meet a CPU tensor in one operation."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=META)

    def __init__(self, data: torch.Tensor) -> None:
        self.on_cpu = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and not isinstance(a, cls)]
        # As on a GPU: a CPU scalar may join an elementwise op, nothing else may.
        if plain and (func in (torch.ops.aten.stack.default, torch.ops.aten.cat.default) or any(a.dim() for a in plain)):
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        unwrapped_args, unwrapped_kwargs = tree_map(lambda a: a.on_cpu if isinstance(a, cls) else a, (args, kwargs))
        result = func(*unwrapped_args, **unwrapped_kwargs)
        # .to("cpu") reaches here as _to_copy, or under inference_mode (evaluation's epoch end) as to.dtype_layout.
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout) and kwargs.get("device") == torch.device("cpu"):
            return result
        return tree_map(lambda r: cls(r) if isinstance(r, torch.Tensor) else r, result)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def plain_process(monkeypatch):
    """A process that neither torchrun nor a scheduler started."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


# --- batch transfer --------------------------------------------------------------------------------
class Encoding(collections.UserDict):
    """What Hugging Face tokenizers return (``BatchEncoding``): a UserDict with more state, and a
    ``.to()`` that moves its values in place."""

    def __init__(self, data=None, encodings=None):
        super().__init__(data)
        self.encodings = encodings

    def to(self, device, non_blocking=False):
        self.data = {key: value.to(device, non_blocking=non_blocking) for key, value in self.data.items()}
        return self


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    mask: torch.Tensor = dataclasses.field(init=False, default=None)
    name: str = "kept"


class MovesItself:
    """An object with its own ``.to(device, non_blocking=...)``, as Lightning moves them."""

    def __init__(self, tensor, moved_with=None):
        self.tensor, self.moved_with = tensor, moved_with

    def to(self, device, non_blocking=False):
        return MovesItself(self.tensor.to(device, non_blocking=non_blocking), ("to", non_blocking))


class MovesItselfOldStyle(MovesItself):
    def to(self, device):  # no non_blocking: called without it
        return MovesItselfOldStyle(self.tensor.to(device), ("to",))


def test_every_container_type_reaches_the_device_keeping_its_type_and_other_contents():
    sample = Sample(torch.ones(2))
    object.__setattr__(sample, "mask", torch.zeros(2))  # a field __init__ does not take
    counts = collections.defaultdict(list, {"ids": torch.ones(3)})
    batch = [
        Encoding({"input_ids": torch.ones(2, 4), "attention_mask": torch.ones(2, 4)}, encodings=["kept"]),
        counts,
        collections.OrderedDict(a=torch.ones(1)),
        Pair(torch.ones(1), torch.zeros(1)),
        sample,
        MovesItself(torch.ones(1)),
        MovesItselfOldStyle(torch.ones(1)),
        "text",
    ]
    moved = move_to_device(batch, META)
    encoding, defaults, ordered, pair, moved_sample, itself, old_style, text = moved
    assert type(encoding) is Encoding and encoding.encodings == ["kept"]
    assert encoding["input_ids"].device == META and encoding["attention_mask"].device == META
    assert type(defaults) is collections.defaultdict and defaults.default_factory is list
    assert defaults["ids"].device == META and defaults["missing"] == []
    assert type(ordered) is collections.OrderedDict and ordered["a"].device == META
    assert type(pair) is Pair and pair.x.device == META
    assert type(moved_sample) is Sample and moved_sample.image.device == META and moved_sample.mask.device == META
    assert moved_sample.name == "kept"
    assert itself.tensor.device == META and old_style.tensor.device == META and text == "text"
    # The loader's batch is left as it was.
    assert batch[0]["input_ids"].device.type == "cpu" and batch[4].mask.device.type == "cpu"
    assert "missing" not in counts


class ReadOnlyMapping(collections.abc.Mapping):
    def __init__(self):  # cannot be built from a dict
        self.items_ = {"x": torch.ones(1)}

    def __getitem__(self, key):
        return self.items_[key]

    def __iter__(self):
        return iter(self.items_)

    def __len__(self):
        return len(self.items_)


def test_a_mapping_that_cannot_be_rebuilt_is_an_error_saying_what_would_move():
    with pytest.raises(TypeError, match=r"batch of type ReadOnlyMapping to the device.*Yield a dict, or give the "
                                        r"class a `to\("):
        move_to_device(ReadOnlyMapping(), META)


@pytest.mark.parametrize(("strategy", "device_type", "non_blocking"), [
    (SingleDevice("cuda:0"), "cuda", True),  # from pinned memory the copy overlaps compute
    (MPS(), "mps", False),  # a non-blocking copy to MPS can read freed memory (pytorch#189690)
    (SingleDevice(META), "meta", False),
])
def test_batches_copy_without_blocking_only_to_cuda(strategy, device_type, non_blocking):
    batch = {"x": torch.ones(2), "objects": [MovesItself(torch.ones(1))]}
    with RecordedCopies() as recorded:
        moved = strategy.batch_to_device(batch)
    assert recorded.copies == [(device_type, non_blocking), (device_type, non_blocking)]
    assert moved["x"].device == META and moved["objects"][0].moved_with == ("to", non_blocking)


def test_a_cpu_strategy_hands_the_batches_through_untouched():
    batches = iter([(0, torch.ones(1))])
    assert SingleDevice("cpu").batches_on_device(batches) is batches


def test_an_mps_strategy_moves_each_batch_when_the_loop_asks_for_it():
    fetched = []
    batches = ((index, fetched.append(index) or torch.ones(1)) for index in range(3))
    with RecordedCopies() as recorded:
        for index, batch in MPS().batches_on_device(batches):
            assert fetched == list(range(index + 1))  # nothing read ahead
            assert batch.device == META
    assert recorded.copies == [("mps", False)] * 3


class RecordedPins(TorchFunctionMode):
    """Records the tensors pinned with ``Tensor.pin_memory`` and returns them as they are (pinning
    needs a CUDA driver, which this machine lacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.pin_memory:
            self.pinned.append(args[0])
            return args[0]
        return func(*args, **(kwargs or {}))


class YieldsGpuAndCpuTensors(Dataset):
    """A dataset that puts part of each sample on the GPU itself (a cached embedding table, say)."""

    def __init__(self) -> None:
        self.on_gpu = [GpuTensor() for _ in range(2)]

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return {"features": self.on_gpu[index], "labels": torch.full((2,), float(index))}


def test_a_dataset_yielding_gpu_tensors_trains_on_cuda_with_only_its_cpu_tensors_pinned(two_gpus):
    dataset = YieldsGpuAndCpuTensors()
    loader = SingleDevice("cuda").setup_dataloader(DataLoader(dataset, batch_size=None), shuffle=False)
    with RecordedPins() as recorded:  # pin_memory=True would raise "cannot pin 'torch.cuda.FloatTensor'"
        batches = list(loader)
    assert [id(batch["features"]) for batch in batches] == [id(t) for t in dataset.on_gpu]  # as they were
    assert [pinned.tolist() for pinned in recorded.pinned] == [[0.0, 0.0], [1.0, 1.0]]  # the labels, once each
    assert [id(batch["labels"]) for batch in batches] == [id(t) for t in recorded.pinned]


# --- the prefetcher --------------------------------------------------------------------------------
class RecordingCopyStream:
    """Stands in for ``CudaCopyStream``: records the CUDA calls, in order, in ``log``."""

    def __init__(self, log: list) -> None:
        self.log, self.inside, self.events = log, False, 0

    @contextlib.contextmanager
    def copying(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def record_copied(self):
        self.events += 1
        self.log.append(("copied", self.events))
        return self.events

    def wait_for(self, event):
        self.log.append(("compute waits for", event))

    def used_by_compute(self, tensor):
        self.log.append(("record_stream", int(tensor.shape[0])))


class CountingDataset(Dataset):
    """Sample i is ``torch.full((i + 1,), i)``; ``reads`` counts what the loader fetched."""

    def __init__(self, count: int) -> None:
        self.count, self.reads = count, 0

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        self.reads += 1
        return torch.full((index + 1,), float(index))


def prefetched(loader_batches, log):
    stream = RecordingCopyStream(log)
    mover = SingleDevice(META)

    def move(batch):
        log.append(("copy on the side stream" if stream.inside else "copy on the compute stream", int(batch.shape[0])))
        return mover.batch_to_device(batch)

    return prefetch_to_device(loader_batches, move, stream)


def test_the_next_batch_is_copied_on_the_side_stream_before_the_current_step_and_compute_waits_for_its_own():
    log: list = []
    loader = DataLoader(CountingDataset(3), batch_size=None)  # batch i has i + 1 elements
    for batch_idx, batch in prefetched(enumerate(loader), log):
        assert batch.device == META
        log.append(("step", batch_idx))
    assert log == [
        ("copy on the side stream", 1), ("copied", 1), ("record_stream", 1),
        ("copy on the side stream", 2), ("copied", 2), ("record_stream", 2),
        ("compute waits for", 1), ("step", 0),
        ("copy on the side stream", 3), ("copied", 3), ("record_stream", 3),
        ("compute waits for", 2), ("step", 1),
        ("compute waits for", 3), ("step", 2),
    ]


def test_the_prefetcher_reads_no_batch_past_the_limit_and_one_ahead_when_the_loop_stops():
    dataset = CountingDataset(10)
    limited = itertools.islice(enumerate(DataLoader(dataset, batch_size=None)), 3)  # limit_train_batches=3
    assert [index for index, _ in prefetched(limited, [])] == [0, 1, 2]
    assert dataset.reads == 3

    dataset = CountingDataset(10)
    for index, _ in prefetched(enumerate(DataLoader(dataset, batch_size=None)), []):
        if index == 1:  # max_steps, should_stop
            break
    assert dataset.reads == 3  # batch 2 was read (and copied) while step 1 ran


def test_prefetch_is_an_option_of_the_cuda_strategies_and_an_error_elsewhere(two_gpus, plain_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())  # the side stream, which this machine lacks
    chosen = Trainer(strategy=SingleDevice("cuda", prefetch=True), logger=False).strategy
    assert chosen.batches_on_device(iter([])).__name__ == "prefetch_to_device"
    assert SingleDevice("cuda").batches_on_device(iter([])).__name__ == "prefetch_to_device"  # on by default
    assert SingleDevice("cuda", prefetch=False).batches_on_device(iter([])).__name__ == "<genexpr>"  # moved one by one
    with pytest.raises(ValueError, match=r"SingleDevice\(prefetch=True\) copies the next batch to the GPU on a CUDA "
                                         r"side stream, but this strategy trains on cpu"):
        Trainer(strategy=SingleDevice("cpu", prefetch=True))
    with pytest.raises(ValueError, match=r"DDP\(prefetch=True\) .* trains on cpu"):
        Trainer(strategy=DDP(devices=2, backend="gloo", prefetch=True))
    with pytest.raises(ValueError, match=r"SingleDevice\(prefetch='yes'\): use True, False or None"):
        Trainer(strategy=SingleDevice("cuda", prefetch="yes"))


# --- GPU memory after a stage -----------------------------------------------------------------------
class RecordsMoves(nn.Module):
    """Records where ``.to()`` sends it; a move to a device this machine lacks changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.moves: list[str] = []

    def to(self, device, *args, **kwargs):
        self.moves.append(torch.device(device).type)
        return self if torch.device(device).type in ("cuda", "mps") else super().to(device, *args, **kwargs)


@pytest.mark.parametrize("strategy", [SingleDevice("cuda:0"), MPS()])
def test_at_teardown_a_gpu_strategy_moves_the_module_it_placed_back_and_empties_the_cache(strategy, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("cuda"))
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: emptied.append("mps"))
    module = RecordsMoves()
    strategy.setup_module(module)
    strategy.teardown()
    strategy.teardown()  # a second teardown (another stage's error path) moves nothing again
    assert module.moves == [strategy.device.type, "cpu"] and emptied == [strategy.device.type]
    cpu, on_cpu = RecordsMoves(), SingleDevice("cpu")
    on_cpu.setup_module(cpu)
    on_cpu.teardown()
    assert cpu.moves == ["cpu"]  # placed, and left there


def adam_after_one_step() -> tuple[nn.Module, torch.optim.Optimizer]:
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return layer, optimizer


def states_on_another_device(optimizer: torch.optim.Optimizer) -> None:
    """As a stage on a GPU leaves them: every state tensor but Adam's CPU step count."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = OnAnotherDevice(state[key])


def test_at_teardown_the_optimizers_states_go_back_to_the_cpu_with_the_module(monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    strategy, module = SingleDevice("cuda:0"), RecordsMoves()
    _, optimizer = adam_after_one_step()
    states_on_another_device(optimizer)
    steps = [state["step"] for state in optimizer.state.values()]
    strategy.setup_module(module)
    strategy.teardown([optimizer])
    for state, step in zip(optimizer.state.values(), steps):
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "cpu"
        assert state["step"] is step  # torch wants the count on the CPU unless capturable: never moved


class KeepsItsOptimizer(LinearRegression):
    """Returns the same optimizer from every configure_optimizers, as a module that builds it in
    __init__ does: it outlives each stage."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_optimizers(self):
        return self.optimizer


def test_an_optimizer_that_outlived_a_stage_gets_its_states_back_beside_its_parameters(tmp_path):
    module = KeepsItsOptimizer()
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)
    trainer = Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=tmp_path)
    trainer.fit(module, loader)
    states_on_another_device(module.optimizer)  # where the last stage's teardown would have left them
    Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
            default_root_dir=tmp_path).fit(module, loader)  # steps: it would fail on states across devices
    assert {value.device.type for state in module.optimizer.state.values() for value in state.values()} == {"cpu"}


def test_optimizer_states_move_with_every_tensor_inside_them_but_the_step_count():
    _, optimizer = adam_after_one_step()
    optimizer_states_to([optimizer], META)  # stands in for the GPU
    moved = [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]
    assert len(moved) == 4 and {value.device for value in moved} == {META}
    assert {state["step"].device.type for state in optimizer.state.values()} == {"cpu"}


def test_the_performance_reports_gpu_peak_is_the_fits(monkeypatch):
    class OnCuda(Strategy):
        device = torch.device("cuda", 0)

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    trainer = Trainer(strategy=OnCuda(), logger=False, enable_progress_bar=False)
    PerformanceReport().setup(trainer, LogsOnTwoDevices(), "fit")
    assert resets == [torch.device("cuda", 0)]


# --- metrics logged on two devices -----------------------------------------------------------------
class LogsOnTwoDevices(TrainingModule):
    """Logs its loss as a GPU value and the learning rate as a CPU tensor, per step and per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train/loss_on_gpu", OnAnotherDevice(loss.detach()))
        self.log("train/lr", torch.tensor(0.1))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/on_gpu", OnAnotherDevice(torch.tensor(2.0)))
        self.log("val/on_cpu", torch.tensor(3.0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_values_logged_on_different_devices_reach_the_logs_at_log_steps_and_after_validation(
        make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, log_every_n_steps=2)
    trainer.fit(LogsOnTwoDevices(), regression_loader, regression_loader)
    assert trainer.logged_metrics["train/lr"] == pytest.approx(0.1)
    assert trainer.logged_metrics["train/loss_on_gpu"] > 0
    assert (trainer.logged_metrics["val/on_gpu"], trainer.logged_metrics["val/on_cpu"]) == (2.0, 3.0)


# --- the non-finite loss guard under CUDA graphs -----------------------------------------------------
class OverwritesItsLastLoss(TrainingModule):
    """Overwrites the loss it returned at the previous step in place, as a CUDA graph replay
    (``torch.compile(mode="reduce-overhead")``) overwrites its output; the loss at batch 3 is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.last_loss = None

    def training_step(self, batch, batch_idx):
        if self.last_loss is not None:
            with torch.no_grad():
                self.last_loss.fill_(1.0)
        loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        if batch_idx == 3:
            loss = loss * float("nan")
        self.last_loss = loss
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReplaysGraphs(Callback):
    """Says its model changes replay CUDA graphs, as ``Compile(mode="reduce-overhead")`` does."""

    may_replay_graphs = True


def test_a_nan_loss_is_named_at_its_batch_even_when_the_loss_tensor_is_overwritten_by_the_next_step(
        make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, log_every_n_steps=8, callbacks=[ReplaysGraphs()])
    with pytest.raises(FloatingPointError, match=r"The training loss is nan at epoch 0, batch 3 \(global step 3\)"):
        trainer.fit(OverwritesItsLastLoss(), regression_loader)


@pytest.mark.parametrize(("compile_", "replays"), [
    (Compile(mode="reduce-overhead"), True),
    (Compile(mode="max-autotune"), True),  # its mode options include triton.cudagraphs
    (Compile(**{"triton.cudagraphs": True}), True),
    (Compile(), False),
    (Compile(mode="max-autotune-no-cudagraphs"), False),
    (Compile(backend="eager"), False),
])
def test_compile_configurations_that_replay_cuda_graphs_say_so(compile_, replays):
    # The loop then copies each loss it checks later; CUDA devices say so for the module's own compile.
    assert compile_.may_replay_graphs is replays


def test_cuda_devices_may_replay_graphs_and_the_cpu_does_not(two_gpus):
    assert SingleDevice("cuda:0").may_replay_graphs
    assert not SingleDevice("cpu").may_replay_graphs and not MPS().may_replay_graphs


# --- DDP on GPUs: checks before any process starts ---------------------------------------------------
def test_fork_with_cuda_is_refused_before_any_process_starts(two_gpus, plain_process):
    with pytest.raises(ValueError, match=r'DDP\(start_method="fork"\) cannot train on GPUs.*Cannot re-initialize '
                                         r'CUDA in forked subprocess.*start_method="spawn"'):
        Trainer(strategy=DDP(devices=2, start_method="fork"))
    forking = Trainer(strategy=DDP(devices=2, start_method="fork", backend="gloo"), logger=False).strategy
    assert forking.launches_subprocesses and forking.num_processes == 2  # CPU workers may fork


SCHEDULER = {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


def test_a_scheduler_without_local_world_size_runs_a_two_machine_job(monkeypatch):
    # srun exporting RANK, LOCAL_RANK and WORLD_SIZE (16 processes on 2 machines of 8 GPUs) only.
    for name, value in SCHEDULER.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_backend_available", lambda backend: True)  # NCCL, which this build lacks
    strategy = Trainer(strategy=DDP(devices=8), logger=False).strategy
    assert strategy.world_size == 16 and not strategy.launches_subprocesses  # joins the job, spawns nothing
    assert strategy.resolved_backend == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU per process (CUDA_VISIBLE_DEVICES per task)
    monkeypatch.setenv("LOCAL_RANK", "5")
    own_gpu = Trainer(strategy=DDP(), logger=False).strategy
    assert own_gpu.world_size == 16 and not own_gpu.launches_subprocesses
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=5 but sees 2 CUDA device\(s\) \(cuda:0, cuda:1\), so it has no "
                                         r"GPU of its own.*CUDA_VISIBLE_DEVICES"):
        Trainer(strategy=DDP())


@pytest.mark.parametrize(("local_rank", "visible", "device"), [(1, 8, 1), (5, 1, 0), (0, 1, 0)])
def test_each_process_takes_its_local_gpu_or_the_one_it_sees(local_rank, visible, device):
    assert local_cuda_index(local_rank, visible) == device


class GpuTensor(torch.Tensor):
    """A tensor on cuda:0 as far as its metadata goes (this machine cannot make a real one)."""

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_wrapper_subclass(cls, (2,), dtype=torch.float32, device="cuda")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a stand-in GPU tensor")


def fit_spawned(model: TrainingModule, root) -> None:
    loader = DataLoader(TensorDataset(torch.ones(4, 4), torch.ones(4, 2)), batch_size=2)
    trainer = Trainer(strategy=DDP(devices=2, backend="gloo"), max_epochs=1, default_root_dir=root, logger=False)
    trainer.fit(model, loader, loader)


def test_a_model_on_a_gpu_in_the_launching_process_is_refused_before_spawning(tmp_path, plain_process):
    model = LogsOnTwoDevices()
    model.layer.register_buffer("scale", GpuTensor())
    with pytest.raises(ValueError, match=r"`module.layer.scale` is a tensor on cuda(:0)? in the launching process\. "
                                         r"Each worker would open a CUDA context on that GPU.*Keep the model and the "
                                         r"data on the CPU until fit"):
        fit_spawned(model, tmp_path)
    assert mp.active_children() == []


def test_a_tensor_still_attached_to_autograd_is_named_before_spawning(tmp_path, plain_process):
    model = LogsOnTwoDevices()
    model.cached = model.layer(torch.ones(1, 4))  # requires grad, not a leaf: cannot cross processes
    with pytest.raises(ValueError, match=r"`module.cached` is a tensor computed with autograd.*tensor.detach\(\)"):
        fit_spawned(model, tmp_path)


def _fails_to_load():
    raise ModuleNotFoundError("No module named 'user_code'")


class LoadsOnlyHere:
    """Unpickling it fails, as a class from a module the worker cannot import does."""

    def __reduce__(self):
        return _fails_to_load, ()


def test_a_worker_that_cannot_unpickle_its_work_says_so_with_the_error():
    sent = pickle.loads(pickle.dumps(PickledWork(None, print, (LoadsOnlyHere(),))))  # as a spawned worker gets it
    with pytest.raises(RuntimeError, match=r"DDP rank 1 could not unpickle the work the launching process sent it "
                                           r"\(ModuleNotFoundError: No module named 'user_code'\)\. Everything fit "
                                           r"receives must be importable in a new process"):
        sent.open(1)


def test_a_generator_reaches_the_worker_as_its_state():
    generator = torch.Generator().manual_seed(11)
    torch.rand(3, generator=generator)
    _, _, (received,) = pickle.loads(pickle.dumps(PickledWork(None, print, (generator,)))).open(0)
    assert received is not generator and torch.equal(received.get_state(), generator.get_state())


# --- NCCL faults ---------------------------------------------------------------------------------
def test_a_rank_ended_by_the_nccl_watchdog_is_reported_as_a_timeout_naming_the_rank_that_lagged():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    waiting = forensics.Whereabouts(store, rank=0, world_size=2)
    for batch_idx in range(4):
        waiting.start_batch(batch_idx)
    waiting.enter("backward (gradient all-reduce)", waiting=True)
    waiting.phase_started -= 30.0  # its last report: 30 s in the collective
    waiting.publish()
    lagging = forensics.Whereabouts(store, rank=1, world_size=2)
    for batch_idx in range(3):
        lagging.start_batch(batch_idx)
    lagging.publish()
    aborted = mp.ProcessExitedException("process 0 terminated with signal SIGABRT", error_index=0, error_pid=4321,
                                        exit_code=-signal.SIGABRT, signal_name="SIGABRT")
    message = failure_message(store, 2, aborted, timeout_s=30.0)
    assert message.startswith("DDP rank 0 of 2 timed out in a collective; rank 1 lagged (in training_step at "
                              "training batch 2)")
    assert "NCCL's watchdog ended its process (SIGABRT)" in message and "raise DDP(timeout=...)" in message
    # The same abort with a short wait is a crash in native code, not a timeout.
    assert "crashed in native code" in failure_message(store, 2, aborted, timeout_s=600.0)


def test_leaving_the_process_group_after_a_failure_works_without_abort_process_group(monkeypatch):
    # torch 2.4 (the oldest the project allows) has no _abort_process_group.
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        end_process_group(abort=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the process group was left initialized")


# --- deterministic cuBLAS --------------------------------------------------------------------------
def test_deterministic_sets_the_cublas_workspace_when_the_trainer_is_built(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(deterministic=True, logger=False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_after_cuda_started_warns_that_cublas_may_have_read_it_already(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match=r"CUDA is already in use in this process.*Export "
                                         r"CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python"):
        Trainer(deterministic=True, logger=False)


# --- the GPU check script ----------------------------------------------------------------------------
def test_the_cuda_sync_check_says_it_needs_a_gpu_on_a_machine_without_one(monkeypatch, capsys):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_sync_check.py"
    spec = importlib.util.spec_from_file_location("cuda_sync_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["cuda_sync_check.py"])
    assert script.main() == 2
    assert capsys.readouterr().out.startswith("SKIPPED: no CUDA device")
