"""The Strategy interface: where the loop runs and how many copies of it there are.

The Trainer's loop names only the methods below. A strategy that needs something the loop does
not offer adds a method here, with a single-process default, instead of the loop growing an
``isinstance`` check.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch import nn

from callbacks.console import MisconfigurationException
from strategies.accelerators import check_agrees, device_count
from strategies.checkpoint import read_checkpoint, save_atomic, snapshot, write_file
from strategies.checkpoint.background import BackgroundWriter
from strategies.transfer import move_to_device


class Strategy:
    """Where the loop runs and how many copies of it there are.

    The default implementation is one process on one device: collectives return their input,
    barriers return at once, and ``launch`` calls the function in this process.
    """

    #: The device this process computes on; set by the concrete strategy.
    device: torch.device = torch.device("cpu")
    #: True when rank zero holds the whole training state (weights, optimizer states): a spawned
    #: run then hands it back to the caller, for ``trainer.save_checkpoint`` after ``fit``. FSDP's
    #: ranks each hold a shard.
    whole_state_on_rank_zero: bool = True
    #: ``save_checkpoint`` takes a ``background`` writer (``ModelCheckpoint(async_save=True)``).
    supports_background_saves: bool = True
    #: Copy the next batch on a side stream while the current one computes: None is on for CUDA
    #: and off elsewhere (:meth:`batches_on_device`).
    prefetch: bool | None = None
    #: The Trainer whose fit runs in this process (set when it reads ``configure_optimizers``).
    _trainer: Any = None

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """Lightning's ``trainer.strategy.lr_scheduler_configs``: the running fit's scheduler configs
        (``trainer.lr_scheduler_configs``); replacing them (a warm-up callback's ``LRSchedulerConfig``
        list) changes what the loop steps from the next batch on."""
        return self._trainer.lr_scheduler_configs if self._trainer is not None else []

    @lr_scheduler_configs.setter
    def lr_scheduler_configs(self, configs: list[Any]) -> None:
        from trainer.scheduler_config import replacement_scheduler_configs

        if self._trainer is None:
            raise RuntimeError("trainer.strategy.lr_scheduler_configs was set outside a fit: the configs belong to the "
                               "running fit (set them in a callback hook, e.g. on_train_start).")
        self._trainer.lr_scheduler_configs = replacement_scheduler_configs(configs, self._trainer.lightning_module)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Lightning's ``trainer.strategy.optimizers``: the running fit's optimizers
        (``trainer.optimizers``); replacing them (an optimizer switched at an epoch's start) changes
        what the loop steps from the next batch on (``trainer.setup.replace_optimizers``)."""
        return self._trainer.optimizers if self._trainer is not None else []

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._trainer is None or self._trainer._plan is None or self._trainer.stage != "fit":
            raise RuntimeError("trainer.strategy.optimizers was set outside a fit: the optimizers belong to the "
                               "running fit (return them from configure_optimizers, or set them in a callback hook, "
                               "e.g. on_train_epoch_start).")
        self._trainer.replace_optimizers(optimizers)

    # --- process topology -----------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def configure_devices(self, accelerator: str, devices: int | str | list[int], num_nodes: int) -> None:
        """Take the Trainer's ``accelerator``, ``devices`` and ``num_nodes`` (read by
        ``strategies/accelerators.py``): fill in what this strategy leaves open, and raise a
        ValueError naming both sides when they contradict it. Here: one process on one device."""
        check_agrees(accelerator, f"{type(self).__name__}({self.device})", self.device.type)
        if device_count(devices) not in (None, 1) or num_nodes != 1:
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}, num_nodes={num_nodes}) with {type(self).__name__}, which runs one "
                'process on one device. Use strategy="ddp" (or a strategies.DDP) for several.'
            )

    def validate(self) -> None:
        """Check the request against this machine, before anything starts. Raise with a fix."""

    def describe(self) -> str:
        """One line for the start-of-run report: what runs where."""
        return f"{type(self).__name__} on {self.device}"

    @property
    def launches_subprocesses(self) -> bool:
        """True when ``launch`` runs the work in other processes (DDP spawn): the Trainer then
        copies rank zero's results (weights, counters, metrics) back into the caller's objects."""
        return False

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run ``function(*args)`` once per process of this strategy; return this process's result.

        Single-process strategies call it directly. DDP spawns workers here (and returns rank
        zero's result to the caller), or joins the group that torchrun started.
        """
        return function(*args)

    def setup_environment(self) -> None:
        """Per-process setup inside ``launch``: set the device, join the process group."""

    def teardown(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """Undo ``setup_environment``: leave the process group, free caches. A strategy that placed
        the module on an accelerator moves it back to the CPU with ``optimizers``' states."""

    # --- model and data -------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device once; return it. Called after the module's own
        ``configure_model`` and before the callbacks' (compile, activation checkpointing)."""
        return module.to(self.device)

    def wrap_module(self, module: nn.Module, stage: str) -> nn.Module:
        """Return the model the loop calls in ``stage`` (``"fit"``, ``"validate"``, ...): DDP wraps
        it for training. Called after the callbacks' ``configure_model`` and before
        ``configure_optimizers``, so the optimizer sees the parameters the wrapped model steps."""
        return module

    def mixed_precision(self, dtype: torch.dtype) -> bool:
        """Take mixed precision in ``dtype`` (``torch.bfloat16`` or ``torch.float16``) over; return True if so.

        ``Trainer(precision="bf16-mixed" | "16-mixed")`` asks this at construction. The default,
        False, lets the Trainer add a ``callbacks.AMP`` (autocast around forward and loss, and a
        GradScaler for float16). A strategy with its own mechanism (FSDP's MixedPrecisionPolicy,
        which keeps the parameters in ``dtype`` for compute and reduces gradients in float32)
        applies it in ``wrap_module`` and returns True; then no AMP callback is added.
        """
        return False

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module from what ``setup_module`` returned."""
        return model

    def compute_dtype(self) -> torch.dtype | None:
        """The lower precision this strategy computes in by itself (FSDP's MixedPrecisionPolicy),
        or None when it leaves precision to autocast (``callbacks.AMP``); the performance report asks."""
        return None

    def check_placement(self, module: nn.Module) -> None:
        """Before the first step: raise if a parameter left the device after the model moved there."""
        for name, parameter in module.named_parameters():
            device = parameter.device
            if device.type != self.device.type or (self.device.index is not None and device.index != self.device.index):
                raise RuntimeError(
                    f"Parameter {name!r} is on {device}, but this run trains on {self.device}. Something moved "
                    "it after the Trainer placed the model (a hook or callback calling .to()/.cpu()). Create "
                    "parameters in __init__ or setup() and let the strategy move the model."
                )

    def setup_dataloader(self, dataloader: Any, *, shuffle: bool, contiguous: bool = False) -> Any:
        """Return the loader this process iterates (DDP gives each rank its shard here; with
        ``contiguous``, for prediction, one block of the dataset in order per rank)."""
        return dataloader

    def batches_on_device(self, batches: Iterable[tuple[int, Any]]) -> Iterable[tuple[int, Any]]:
        """The loop's ``(batch_idx, batch)`` pairs with each batch on the device; called once per
        epoch and per evaluation, around the batches the loop iterates.

        On the CPU the pairs pass through untouched (no call per step). On CUDA with ``prefetch``
        (the default there) the next batch is copied on a side stream while the current one
        computes (:mod:`strategies.prefetch`); elsewhere each batch moves with :meth:`batch_to_device`.
        """
        if self.device.type == "cpu" and type(self).batch_to_device is Strategy.batch_to_device:
            return batches  # hot loop: a loader's tensors are on the CPU already
        if self.device.type == "cuda" and self.prefetch is not False:
            from strategies.prefetch import CudaCopyStream, prefetch_to_device

            return prefetch_to_device(batches, self.batch_to_device, CudaCopyStream(self.device))
        return ((batch_idx, self.batch_to_device(batch)) for batch_idx, batch in batches)

    def batch_to_device(self, batch: Any) -> Any:
        """Move the tensors inside ``batch`` to the device; without blocking the host where that
        is safe (CUDA; see :mod:`strategies.transfer`)."""
        if self.device.type == "cpu":
            return batch
        return move_to_device(batch, self.device)

    def training_step(self, model: nn.Module, batch: Any, batch_idx: int) -> Any:
        """Run the module's ``training_step`` through ``model`` (DDP must see the forward)."""
        return model.training_step(batch, batch_idx)

    def evaluation_context(self, inference_mode: bool = True) -> contextlib.AbstractContextManager:
        """The context validation, test and predict run in: ``torch.inference_mode``
        (``Trainer(inference_mode=True)``, the default), or ``torch.no_grad`` when the user asks for
        it or where tensors made during evaluation must stay usable in training (FSDP reuses the
        buffers it gathers parameters into)."""
        return torch.inference_mode() if inference_mode else torch.no_grad()

    @property
    def may_replay_graphs(self) -> bool:
        """Whether a CUDA graph replay may overwrite a training step's outputs in place before the
        loop reads them again: on CUDA devices, where the module's own
        ``torch.compile(mode="reduce-overhead")`` replays into the same output memory at the next
        step (``callbacks.Compile`` says so itself). The loop then keeps copies of the losses it
        checks later (``trainer/guards.py``)."""
        return self.device.type == "cuda"

    # --- backward and collectives ---------------------------------------------------------
    def backward(self, loss: torch.Tensor, backward: Any = None) -> None:
        """``loss.backward()``, or ``backward(loss)``: the module's ``backward`` override (Lightning's hook)."""
        loss.backward() if backward is None else backward(loss)

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """A context that skips the gradient all-reduce while ``enabled`` (accumulation)."""
        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over all processes with ``op`` in ``"mean" | "sum" | "max" | "min"``."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """``tensor`` from every process of ``group`` (default: all), stacked in rank order (a new
        first dimension); without a process group, ``tensor`` itself (Lightning's). Every process
        must call it with a tensor of the same shape. ``sync_grads``: gradients flow back through it."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return tensor
        group = group if group is not None else torch.distributed.group.WORLD
        tensor = tensor.contiguous()
        if sync_grads:
            import torch.distributed.nn.functional as distributed_autograd
            return torch.stack(distributed_autograd.all_gather(tensor, group))
        gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every process, in rank order. Not for the hot loop."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return ``obj`` as it is on process ``src``. Not for the hot loop."""
        return obj

    def barrier(self, name: str = "") -> None:
        """Wait until every process reaches this point."""

    def reduce_any(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any. Used at log steps, never per step."""
        return flag

    # --- checkpoints ----------------------------------------------------------------------
    # The loop writes and reads the whole training state through these (trainer/state.py); the
    # strategy decides the layout: one file written by rank zero (here), or shards (FSDP). The
    # files themselves, and the one read path, are strategies/checkpoint's.
    def module_state_dict(self, module: nn.Module, full: bool = False) -> dict[str, Any]:
        """The module's weights as a checkpoint stores them (FSDP: this process's shards), or with
        ``full``, whole on the CPU of rank zero (a collective under FSDP: call it on every rank)."""
        return module.state_dict()

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state as a checkpoint stores it."""
        return optimizer.state_dict()

    def save_checkpoint(self, state: dict[str, Any], path: str | os.PathLike,
                        background: BackgroundWriter | None = None) -> None:
        """Write the training state (``trainer/state.py``'s dict) at ``path`` atomically. Call it on
        every rank. Here rank zero writes one file and every rank waits, then fails with it if the
        write failed, so none is left waiting at the next collective. With ``background``, rank
        zero takes a snapshot on the host and ``background`` writes it while training goes on
        (every rank waits for the snapshot only)."""
        error = None
        if self.is_global_zero:
            try:
                if background is None:
                    save_atomic(state, path)
                else:
                    taken = snapshot(state, to_host=True, buffers=background.host_buffers)
                    background.submit(str(path), functools.partial(write_file, taken, path))
            except (OSError, TypeError) as failure:
                error = failure
        if self.reduce_any(error is not None):  # doubles as the barrier
            raise error or RuntimeError(f"Rank zero could not write the checkpoint {path}; see its error.")

    def load_checkpoint(self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """Read the checkpoint at ``path`` (a file, or a sharded directory gathered whole) as the
        dict ``save_checkpoint`` was given, through :func:`strategies.checkpoint.read_checkpoint`;
        its weights and optimizer states are then loaded with the two methods below. FSDP reads
        only this process's part of the shards, shaped like ``module``'s parameters and
        ``optimizers``' states. A collective under FSDP: call it on every rank."""
        return read_checkpoint(path)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        module.load_state_dict(state_dict, strict=getattr(module, "strict_loading", True))

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any]) -> None:
        optimizer.load_state_dict(state_dict)
