"""DistributedDataParallel: one process per device, spawned here or started by torchrun.

From a plain ``python train.py``, ``launch`` spawns one worker per device (:mod:`strategies.spawn`)
and hands rank zero's results back to the caller. Under torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set) the same script joins the group torchrun
started; that is also the path across machines. Each process uses ``cuda:LOCAL_RANK`` with NCCL
on GPUs, or the CPU with gloo, and wraps the model in ``DistributedDataParallel``.

Collectives the loop asks for on CPU tensors (flags, objects, barriers) go over gloo, so that on
GPUs they never wait for the device; metric tensors on the GPU go over NCCL. Every collective and
each step's backward note where this rank is (:mod:`strategies.forensics`) so that a timeout
names the rank that fell behind. What is checked before launch is in :mod:`strategies.ddp_checks`;
how DistributedDataParallel sees the training step (manual optimization included) is in
:mod:`strategies.step_runner`.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import multiprocessing
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from callbacks.console import MisconfigurationException
from strategies import forensics
from strategies.base import Strategy
from strategies.ddp_checks import check_arguments, check_backend_available, check_gpus_for, check_topology, settle_trainer_devices
from strategies.loaders import shard_dataloader
from strategies.prefetch import check_prefetch
from strategies.process_group import (connect_stores, end_process_group, is_communication_error, launched_by_torchrun,
                                      local_cuda_index, local_world_size, release_reducer)
from strategies.single import cuda_device_lines
from strategies.step_runner import TrainingStepRunner, prepare_manual_backward, with_cadence_advice
from strategies.transfer import pinned_loader, return_to_host

#: How long a collective may wait for the slowest rank before failing. Long enough for rank zero
#: to write a large checkpoint or run a long validation while the others wait at a barrier.
DEFAULT_TIMEOUT_S = 1800.0
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def join_launched_group(strategy: DDP, function: Callable[..., Any], args: tuple) -> Any:
    """Run ``function(*args)`` in this process, one rank of the group torchrun launched."""
    environ = os.environ
    world_size = int(environ["WORLD_SIZE"])
    strategy.set_process(
        rank=int(environ["RANK"]), local_rank=int(environ["LOCAL_RANK"]), world_size=world_size,
        store_address=(environ["MASTER_ADDR"], int(environ["MASTER_PORT"])), local_world_size=local_world_size(),
    )
    return function(*args)


def _nothing() -> None:
    return None


class DDP(Strategy):
    """Data-parallel training on several devices, one process each.

    Args:
        devices: processes per machine when spawning: an int, ``"auto"`` (every visible GPU
            with NCCL, else 1), or a list of the GPUs to use (``[0, 2]``: local rank r trains on
            the r-th of them). Under torchrun, ``--nproc-per-node`` decides; this must match or be "auto".
        backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPU); default NCCL when CUDA is available.
        start_method: how workers start when spawning: ``"spawn"``, ``"forkserver"`` or ``"fork"``.
        find_unused_parameters: passed to ``DistributedDataParallel``; None (the default): False,
            and True in manual optimization, where each ``manual_backward`` (a GAN's, with
            ``toggle_optimizer``) reaches only some of the parameters.
        gradient_as_bucket_view, static_graph: passed to ``DistributedDataParallel``. Gradients as views of the all-reduce buckets save a copy
            and memory; turn it off if your code replaces ``param.grad`` objects.
        timeout: seconds a collective waits for the slowest rank before failing with a report of
            where every rank was.
        num_nodes: machines; more than one needs torchrun (``Trainer(num_nodes=...)`` sets it).
        prefetch: on GPUs, copy the next batch on a side stream while the current one computes
            (:mod:`strategies.prefetch`). None (the default) is on with NCCL, off on the CPU.

    Example::

        Trainer(strategy=DDP(devices=4), max_epochs=10)   # or Trainer(strategy="ddp", devices=4)
    """

    def __init__(self, devices: int | str | list[int] = "auto", backend: str | None = None, start_method: str = "spawn",
                 find_unused_parameters: bool | None = None, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S,
                 num_nodes: int = 1, prefetch: bool | None = None) -> None:
        self.devices = devices
        self.num_nodes = num_nodes
        self.backend = backend
        self.start_method = start_method
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise MisconfigurationException(
                f"DDP(timeout={timeout!r}): use a number of seconds > 0 (or a datetime.timedelta).")
        self.timeout = datetime.timedelta(seconds=seconds)
        self.prefetch = prefetch
        self.ddp_arguments: dict[str, Any] = {}  # more DistributedDataParallel arguments (DDPStrategy's **kwargs)
        self.comm_hook: tuple[Any, Callable, Callable | None] | None = None  # (state, hook, wrapper)
        self.device = torch.device("cpu")
        self._mode: str | None = None  # "spawn" or "join", fixed by launch
        self._rank: int | None = None
        self._local_rank = 0
        self._world_size: int | None = None
        self._local_world_size: int | None = None
        self._store_address: tuple[str, int] | None = None
        self._session = 0  # setup_environment calls in this process; keys of each live apart
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._manual_model: DistributedDataParallel | None = None  # during a manual-optimization step
        self._wrapped: DistributedDataParallel | None = None  # fit's wrapper, until teardown
        self._manual = False  # the module trains with manual optimization (set by wrap_module)
        self._store: Any = None
        self._control_group: Any = None  # gloo group for CPU-side collectives (None: the default group)
        self._owns_group = False
        self._whereabouts: forensics.Whereabouts | None = None
        self._failure_recorded = False
        self._collective_failed = False
        self._placed: nn.Module | None = None  # the module setup_module moved, until teardown

    def __getstate__(self) -> dict[str, Any]:
        # Stores, groups and threads belong to one process; a spawned worker makes its own.
        state = self.__dict__.copy()
        for key in ("_store", "_control_group", "_whereabouts", "_base_store", "_thread_store", "_placed", "_trainer",
                    "_wrapped"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # --- topology -------------------------------------------------------------------------
    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")

    @property
    def num_processes(self) -> int:
        """Processes on this machine: torchrun's count when joined, else ``devices``."""
        if self._local_world_size is not None:
            return self._local_world_size
        if launched_by_torchrun():
            return local_world_size() or int(os.environ["WORLD_SIZE"])
        if self.devices == "auto":
            return torch.cuda.device_count() if self.resolved_backend == "nccl" else 1
        return len(self.devices) if isinstance(self.devices, list) else self.devices

    @property
    def global_rank(self) -> int:
        return self._rank or 0

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else self.num_processes

    @property
    def launches_subprocesses(self) -> bool:
        mode = self._mode or ("join" if launched_by_torchrun() else "spawn")
        return mode == "spawn"

    def set_process(self, rank: int, local_rank: int, world_size: int, store_address: tuple[str, int],
                    local_world_size: int | None = None) -> None:
        """Which rank this process is, and where the group's store is (called by the launchers)."""
        self._rank, self._local_rank, self._world_size = rank, local_rank, world_size
        self._local_world_size = local_world_size
        self._store_address = store_address

    # --- checks and launch -----------------------------------------------------------------
    def validate(self) -> None:
        name, backend = type(self).__name__, self.resolved_backend
        check_arguments(name, self.devices, self.num_nodes, self.start_method, backend)
        check_prefetch(self.prefetch, "cuda" if backend == "nccl" else "cpu", name)
        if backend == "nccl":
            check_gpus_for(self.devices, self.num_processes, self.start_method)
        check_backend_available(name, backend)
        check_topology(name, self.devices, self.num_nodes)

    def configure_devices(self, accelerator: str, devices: int | str | list[int], num_nodes: int) -> None:
        """Take the Trainer's ``accelerator``, ``devices`` and ``num_nodes`` where this DDP leaves them open."""
        self.backend, self.devices, self.num_nodes = settle_trainer_devices(
            accelerator, devices, num_nodes, backend=self.backend, own_devices=self.devices, own_num_nodes=self.num_nodes)

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Join torchrun's group when this process is one of its ranks; else spawn the workers."""
        if launched_by_torchrun():
            self._mode = "join"
            return join_launched_group(self, function, args)
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # A spawned worker is importing the user's script, and the script trains at import time.
            raise RuntimeError(
                "This process is a DDP worker starting up, and importing your script called fit again. "
                'Put the code that builds the Trainer and calls fit under `if __name__ == "__main__":`.'
            )
        from strategies.spawn import spawn_workers

        self._mode = "spawn"
        return spawn_workers(self, function, args)

    def describe(self) -> str:
        how = "spawned" if self._mode == "spawn" else "joined from torchrun"
        machines = ""
        if self._local_world_size:  # unknown when the launcher does not export LOCAL_WORLD_SIZE
            machines = f" on {max(1, self.world_size // self._local_world_size)} machine(s)"
        text = (f"{type(self).__name__}: {self.world_size} processes{machines}, {how}, backend {self.resolved_backend}; "
                f"rank 0 on {self.device}.")
        if self.device.type == "cuda":
            text += " CUDA devices: " + "; ".join(cuda_device_lines())
        else:
            text += f" {torch.get_num_threads()} CPU threads per process."
        return text

    # --- per process -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._rank is None:  # called without launch (a user's own loop under torchrun)
            self._mode = "join"
            join_launched_group(self, _nothing, ())
        self._reset_runtime()
        backend = self.resolved_backend
        if backend == "nccl":
            listed = self.devices[self._local_rank] if isinstance(self.devices, list) else None
            self.device = torch.device("cuda", listed if listed is not None
                                       else local_cuda_index(self._local_rank, torch.cuda.device_count()))
        else:
            self.device = torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif self._mode == "spawn" and "OMP_NUM_THREADS" not in os.environ:
            # Workers share the cores; oversubscribed threads make gloo collectives crawl.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self._local_world_size))
        prefix = forensics.session_prefix(self._session)
        self._session += 1
        thread_store = None
        if dist.is_initialized():  # the user's script set up the group itself: use it, leave it
            self._store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        else:
            base, thread_store = self._connect_stores()
            self._store = dist.PrefixStore(prefix, base)
            thread_store = dist.PrefixStore(prefix, thread_store)
            dist.init_process_group(
                self.process_group_backend(), store=dist.PrefixStore("group/", self._store), rank=self._rank,
                world_size=self._world_size, timeout=self.timeout,
                device_id=self.device if self.device.type == "cuda" else None,
            )
            self._owns_group = True
        if backend != "gloo":
            self._control_group = dist.new_group(backend="gloo", timeout=self.timeout)
        self._whereabouts = forensics.Whereabouts(thread_store, self._rank, self._world_size)
        if thread_store is not None:
            self._whereabouts.start(watch_parent=self._mode == "spawn")

    def process_group_backend(self) -> str:
        """The backend the default process group is created with (``init_process_group``)."""
        return self.resolved_backend

    def _connect_stores(self) -> tuple[Any, Any]:
        """Two clients of the group's store (the forensics thread gets its own connection). Kept
        for the life of the process: later stages reuse them under a new key prefix."""
        if getattr(self, "_base_store", None) is None:
            agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            hosts_here = self._mode == "join" and self._rank == 0 and not agent_hosts
            self._base_store, self._thread_store = connect_stores(
                *self._store_address, self._world_size, hosts_here, self.timeout)
        return self._base_store, self._thread_store

    def teardown(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        error = sys.exc_info()[1]  # teardown runs in the loop's `finally`: an error may be on its way out
        if error is not None:
            self.record_failure(error)
        if self._whereabouts is not None:
            self._whereabouts.stop()
        release_reducer(self._wrapped)  # before the group goes: see release_reducer
        self._wrapped = None
        if self._owns_group and dist.is_initialized():
            # After an error, destroying would wait for pending NCCL work that may never finish.
            end_process_group(abort=error is not None and self.resolved_backend == "nccl")
        self._owns_group = False
        self._control_group = None
        placed, self._placed = self._placed, None
        if placed is not None and self._mode == "join":  # under torchrun the script goes on; spawned workers end
            return_to_host(placed, self.device, optimizers)

    def record_failure(self, error: BaseException | None = None) -> None:
        """Tell the other ranks (and the launcher) that this rank failed, once."""
        if self._failure_recorded or self._store is None:
            return
        self._failure_recorded = True
        if self._whereabouts is not None:
            self._whereabouts.failed = True
        text = "".join(traceback.format_exception(error)) if error is not None else traceback.format_exc()
        kind = "collective" if self._collective_failed else "error"
        forensics.record_failure(self._store, self.global_rank, kind, text)

    # --- model and data --------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._take_module(module)
        self._placed = module
        return module.to(self.device)

    def _take_module(self, module: nn.Module) -> None:
        """Make ``module`` this process's own, and known to the forensics thread."""
        if self._whereabouts is not None:
            self._whereabouts.module = module
        if self._mode == "spawn":
            # torch.multiprocessing hands spawned workers the caller's CPU tensors in shared memory:
            # without a private copy every rank's optimizer would step the same weights.
            with torch.no_grad():
                for tensor in itertools.chain(module.parameters(), module.buffers()):
                    if tensor.is_shared() and tensor.device.type == "cpu":
                        tensor.data = tensor.data.clone()

    def wrap_module(self, module: nn.Module, stage: str) -> nn.Module:
        if stage != "fit":  # evaluation runs each rank's own forward: nothing to all-reduce
            return module
        self._manual = not module.automatic_optimization  # read per step: one attribute, not three
        wrapped = DistributedDataParallel(
            TrainingStepRunner(module, self._end_manual_step if self._manual else None),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self._manual if self.find_unused_parameters is None else self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            **self.ddp_arguments,
        )
        if self.comm_hook is not None:
            state, hook, wrapper = self.comm_hook
            wrapped.register_comm_hook(state, wrapper(hook) if wrapper is not None else hook)
        self._wrapped = wrapped
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, DistributedDataParallel):
            return model.module.module
        return model

    def setup_dataloader(self, dataloader: Any, *, shuffle: bool, contiguous: bool = False) -> Any:
        seed = self._shuffle_seed(dataloader) if shuffle else 0
        sharded = shard_dataloader(dataloader, rank=self.global_rank, world_size=self.world_size, shuffle=shuffle,
                                   seed=seed, warn=self.is_global_zero, contiguous=contiguous)
        return pinned_loader(sharded) if self.device.type == "cuda" else sharded

    def _shuffle_seed(self, loader: Any) -> int:
        # Every rank must shuffle alike, or shards overlap: rank zero's draw wins. Drawn from the
        # loader's generator when it has one, so a seeded generator keeps the run reproducible.
        generator = loader.generator if isinstance(loader, DataLoader) else None
        seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
        return self.broadcast_object(seed)

    def training_step(self, model: nn.Module, batch: Any, batch_idx: int) -> Any:
        self._whereabouts.start_batch(batch_idx)
        try:
            if not self._manual:
                return model(batch, batch_idx)  # through DDP's forward, which readies the gradient all-reduce
            self._manual_model = model  # manual_backward readies it before each backward (backward below)
            try:
                return model(batch, batch_idx)
            finally:
                self._manual_model = None
                model.require_backward_grad_sync = True
        except RuntimeError as error:
            if "find_unused_parameters=True" not in str(error) or model.find_unused_parameters:
                raise
            raise with_cadence_advice(error) from error

    def _end_manual_step(self) -> None:
        if self._manual_model is not None:
            self._manual_model.require_backward_grad_sync = False  # read by DDP's post-forward only

    # --- backward and collectives ----------------------------------------------------------
    def backward(self, loss: torch.Tensor, backward: Any = None) -> None:
        where = self._whereabouts
        where.enter("backward (gradient all-reduce)", waiting=True)
        try:
            if self._manual_model is not None:
                prepare_manual_backward(self._manual_model, loss)
            loss.backward() if backward is None else backward(loss)  # the module's override, if any
        except Exception as error:
            if is_communication_error(error):
                raise self._collective_error("the gradient all-reduce in backward", error) from error
            raise
        where.enter("after backward")

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return model.no_sync() if enabled else contextlib.nullcontext()

    def _collective(self, name: str, run: Callable[[], Any]) -> Any:
        where = self._whereabouts
        if where is None:
            raise RuntimeError(f"DDP.{name} was called outside a running stage; the process group is not set up.")
        where.enter(name, waiting=True)
        try:
            result = run()
        except Exception as error:
            raise self._collective_error(name, error) from error
        where.collectives += 1
        where.enter(f"after {name}")
        return result

    def _collective_error(self, name: str, error: Exception) -> RuntimeError:
        self._collective_failed = True
        return forensics.collective_error(name, error, self._store, self.world_size, self._whereabouts.record(),
                                          self.timeout.total_seconds())

    def _group_for(self, tensor: torch.Tensor) -> Any:
        # CPU tensors go over gloo: on GPUs they then never wait for the device.
        return self._control_group if tensor.device.type == "cpu" else None

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if op != "mean" and op not in _REDUCE_OPS:
            raise MisconfigurationException(f'all_reduce(op="{op}"): use "mean", "sum", "max" or "min".')
        result = tensor.clone()  # the caller's tensor stays as it was
        group = self._group_for(result)
        self._collective("all_reduce", lambda: dist.all_reduce(result, _REDUCE_OPS.get(op, dist.ReduceOp.SUM), group=group))
        return result / self.world_size if op == "mean" else result

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        self._collective("all_gather_object", lambda: dist.all_gather_object(gathered, obj, group=self._control_group))
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._collective("broadcast_object", lambda: dist.broadcast_object_list(box, src=src, group=self._control_group))
        return box[0]

    def barrier(self, name: str = "") -> None:
        self._collective(f"barrier({name!r})" if name else "barrier", lambda: dist.barrier(group=self._control_group))

    def reduce_any(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._collective("reduce_any", lambda: dist.all_reduce(value, dist.ReduceOp.MAX, group=self._control_group))
        return bool(value.item())
