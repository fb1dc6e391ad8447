"""FSDP2: each process holds a shard of the weights, gradients and optimizer state.

DDP keeps a whole copy of the model, its gradients and its optimizer state on every device; FSDP
(``torch.distributed.fsdp.fully_shard`` on a ``DeviceMesh``) splits each parameter across the N
processes, so each holds about 1/N of them. Before a block's forward (and backward) its shards
are all-gathered into whole parameters and freed again after; gradients are reduce-scattered,
so each process steps its own shard of the optimizer.

Launch, process group, faults and forensics are DDP's (this class extends :class:`DDP`): the same
script spawns its workers from ``python train.py`` or joins the group torchrun started. What
differs is what happens to the model, and checkpoints:

- ``wrap_module`` shards the blocks ``auto_wrap`` selects, then the root, in every stage; a block
  built on the meta device (in ``configure_model``) is materialized and initialized just before it
  is sharded, so no process ever holds more than one whole block.
- ``save_checkpoint`` writes a directory in which each rank writes its own shards
  (:mod:`strategies.checkpoint.sharded`), atomically, in the step or (``ModelCheckpoint(async_save=True)``)
  with DCP's ``async_save`` in the background; ``load_checkpoint`` reads each rank's part,
  from a checkpoint written by any number of processes, or from a one-file checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from callbacks.console import MisconfigurationException
from strategies.base import Strategy
from strategies.checkpoint import read_checkpoint, remove_checkpoint, replace_atomic, save_atomic, staging_directory
from strategies.checkpoint.background import BackgroundWriter
from strategies.checkpoint.files import plain_copy, snapshot
from strategies.ddp import DDP, DEFAULT_TIMEOUT_S
from strategies.process_group import launched_by_torchrun
from strategies.selection import ACCEPTED, select_submodules
from strategies.checkpoint.sharded import (
    SHARDED_KEYS, STATE_FILE, by_index, by_name, finish_in_background, parameter_names, read_metadata, read_shards,
    saved_entries, template_from_metadata, write_shards, write_shards_in_background,
)

#: The module's methods that run a forward: each gathers the root's parameters first.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FSDP(DDP):
    """Fully sharded data parallel training (FSDP2), one process per device.

    Args:
        devices, backend, start_method, timeout: as for :class:`DDP`.
        auto_wrap: the blocks sharded one by one (each all-gathered only while it computes): a module
            class, a tuple (or set) of classes, a list of submodule names, or a predicate ``(name,
            module) -> bool`` (see ``strategies/selection.py``). Default: every direct child that holds
            parameters. A container without a forward (``nn.ModuleList``) stands for its members.
            For a transformer, pass its block class.
        reshard_after_forward: free each block's gathered parameters after its forward (True, less
            memory), keep them for the backward (False, less communication), or reshard them to
            groups of this many processes (an int).
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (compute and reduce
            dtypes). ``Trainer(precision="bf16-mixed")`` sets ``param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32`` here instead of autocast.
        cpu_offload: keep the shards, their gradients and the optimizer step on the CPU between
            uses (CUDA only: slower, for models whose shards do not fit on the GPUs). The process
            group then has gloo for CPU tensors beside NCCL (``"cuda:nccl,cpu:gloo"``): clipping's
            norm and other collectives over the CPU gradient shards need it.
        device_mesh: None (shard over every process), ``(replicas, shard_size)`` for hybrid sharding
            (HSDP: each group of ``shard_size`` processes, usually one machine, holds one sharded
            copy, and the ``replicas`` copies are averaged), or a ``DeviceMesh`` you built under torchrun.

    Example::

        Trainer(strategy=FSDP(devices=8, auto_wrap=TransformerBlock), max_steps=10_000)
        Trainer(strategy="fsdp", devices=4)   # default options
    """

    whole_state_on_rank_zero = False  # each rank holds its shard of the weights and optimizer states

    def __init__(self, devices: int | str = "auto", auto_wrap: Any = None, reshard_after_forward: bool | int = True,
                 mixed_precision: Any = None, cpu_offload: bool = False, device_mesh: Any = None,
                 backend: str | None = None, start_method: str = "spawn",
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(devices=devices, backend=backend, start_method=start_method, timeout=timeout)
        # A set of classes is how Lightning users write it (FSDPStrategy(auto_wrap_policy={Block})).
        self.auto_wrap = tuple(auto_wrap) if isinstance(auto_wrap, (set, frozenset)) else auto_wrap
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mixed_precision
        self.cpu_offload = cpu_offload
        self.device_mesh = device_mesh

    def _reset_runtime(self) -> None:
        super()._reset_runtime()
        self._mesh: Any = None  # built per process in setup_environment
        self._save_group: Any = None  # async_save's gloo group, made at its first save

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_mesh", None)
        state.pop("_save_group", None)
        return state

    # --- checks ----------------------------------------------------------------------------
    def validate(self) -> None:
        super().validate()
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        wrap = self.auto_wrap
        if wrap is not None and not (isinstance(wrap, (type, tuple, list)) or callable(wrap)):
            raise MisconfigurationException(
                f"FSDP(auto_wrap={wrap!r}): use None (every direct child with parameters), {ACCEPTED}.")
        reshard = self.reshard_after_forward
        if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool) and reshard < 2):
            raise MisconfigurationException(
                f"FSDP(reshard_after_forward={reshard!r}): use True, False, or an int >= 2 "
                "(reshard to groups of that many processes).")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise MisconfigurationException(
                f"FSDP(mixed_precision={self.mp_policy!r}): use a torch.distributed.fsdp.MixedPrecisionPolicy, "
                "e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).")
        if self.cpu_offload and self.resolved_backend != "nccl":
            raise MisconfigurationException(
                "FSDP(cpu_offload=True) keeps the shards on the CPU while GPUs compute; this run trains on "
                "the CPU already. Leave cpu_offload=False.")
        mesh = self.device_mesh
        if isinstance(mesh, DeviceMesh):
            if mesh.ndim not in (1, 2):
                raise MisconfigurationException(
                    f"FSDP(device_mesh=...) has {mesh.ndim} dimensions; use a 1-D mesh (sharding) or "
                    "a 2-D one (replicate, shard).")
        elif mesh is not None:
            if not (isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                                       and n >= 1 for n in mesh)):
                raise MisconfigurationException(
                    f"FSDP(device_mesh={mesh!r}): use None, a pair (replicas, shard_size) of ints >= 1, "
                    "or a torch.distributed.device_mesh.DeviceMesh.")
            if self.devices != "auto" or launched_by_torchrun():
                self._check_mesh_size(mesh)

    def _check_mesh_size(self, shape: tuple[int, int]) -> None:
        if shape[0] * shape[1] != self.world_size:
            raise MisconfigurationException(
                f"FSDP(device_mesh={shape}) needs {shape[0] * shape[1]} processes ({shape[0]} replicas of "
                f"{shape[1]} shards), but this run has {self.world_size}. Use a shape whose product is "
                f"{self.world_size}.")

    def describe(self) -> str:
        text = super().describe()
        how = "hybrid (replicate x shard) " if self._mesh is not None and self._mesh.ndim == 2 else ""
        return f"{text} Sharding {how}over mesh {tuple(self._mesh.shape) if self._mesh is not None else '?'}, " \
               f"reshard_after_forward={self.reshard_after_forward}."

    # --- per process -----------------------------------------------------------------------
    def process_group_backend(self) -> str:
        # Offloaded gradients are CPU DTensors: the all-reduce of their norm (gradient clipping)
        # runs on the mesh's group, which NCCL alone refuses for CPU tensors.
        if self.cpu_offload and self.resolved_backend == "nccl":
            return "cuda:nccl,cpu:gloo"
        return super().process_group_backend()

    def setup_environment(self) -> None:
        super().setup_environment()
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if isinstance(self.device_mesh, DeviceMesh):
            self._mesh = self.device_mesh
        elif self.device_mesh is not None:
            self._check_mesh_size(self.device_mesh)
            self._mesh = init_device_mesh(self.device.type, self.device_mesh, mesh_dim_names=("replicate", "shard"))
        else:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("shard",))

    def teardown(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        # Under torchrun the user's module keeps its shards after fit (test, predict or a save may
        # follow in the same script), and shards live on the process group: keep the group for
        # the life of the process. Spawned workers end here, and a failed stage cleans up as DDP.
        if self._mode == "join" and sys.exc_info()[1] is None:
            self._owns_group = False
        super().teardown()  # its optimizers' states are sharded like the module: they stay
        self._mesh = None

    # --- the model ---------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Unlike DDP, the whole model never moves to the device: ``wrap_module`` moves each block
        as it shards it (a module on the meta device stays there until then)."""
        self._take_module(module)
        return module

    def wrap_module(self, module: nn.Module, stage: str) -> nn.Module:
        """Shard the blocks, then the root, in every stage (evaluation needs the memory as much).
        Returns the module itself: its forward and ``*_step`` methods gather what they use."""
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        if isinstance(module, FSDPModule):  # sharded by an earlier stage of this process (torchrun)
            return module
        options = {"mesh": self._mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        if self.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy()
        blocks = self._blocks(module)
        for name, block in blocks:
            materialize(block, self.device, name)
            fully_shard(block, **options)
        materialize(module, self.device, "", skip=[block for _, block in blocks])
        fully_shard(module, **options)
        for method in STEP_METHODS:
            register_fsdp_forward_method(module, method)
        return module

    def _blocks(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """What ``auto_wrap`` selects (default: the direct children), containers replaced by their
        members (``fully_shard`` needs a forward), blocks without parameters left out."""
        if self.auto_wrap is None:
            chosen = list(module.named_children())
        else:
            chosen = select_submodules(module, self.auto_wrap, "FSDP(auto_wrap=...)")
        return [unit for name, child in chosen for unit in _units(name, child)]

    def check_placement(self, module: nn.Module) -> None:
        if not self.cpu_offload:  # offloaded shards live on the CPU by design
            super().check_placement(module)

    def training_step(self, model: nn.Module, batch: Any, batch_idx: int) -> Any:
        self._whereabouts.start_batch(batch_idx)
        # The module's own training_step, called as on one device (no DDP wrapper around it): it is
        # registered as a forward, so the root's shards are gathered around it.
        return Strategy.training_step(self, model, batch, batch_idx)

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return _without_gradient_sync(model) if enabled else contextlib.nullcontext()

    def evaluation_context(self, inference_mode: bool = True) -> contextlib.AbstractContextManager:
        # FSDP gathers parameters into buffers it reuses: made under inference_mode, they could not
        # be used by the training step after validation.
        return torch.no_grad()

    def mixed_precision(self, dtype: torch.dtype) -> bool:
        """``Trainer(precision=...)``: compute in ``dtype`` through FSDP's MixedPrecisionPolicy
        (parameters gathered in ``dtype``, gradients reduced in float32, the optimizer steps the
        float32 shards), not autocast."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if dtype == torch.float16:
            raise MisconfigurationException(
                "float16 under FSDP needs loss scaling that agrees across shards, which Cadence does not provide. "
                'Use precision="bf16-mixed", or FSDP(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float16)) '
                "at your own risk of underflowing gradients."
            )
        if self.mp_policy is None:
            self.mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        elif self.mp_policy.param_dtype != dtype:
            raise MisconfigurationException(
                f"Trainer(precision=...) asks for {dtype}, but FSDP(mixed_precision=...) computes in "
                f"{self.mp_policy.param_dtype}. Pass one of the two.")
        return True

    def compute_dtype(self) -> torch.dtype | None:
        dtype = self.mp_policy.param_dtype if self.mp_policy is not None else None
        return dtype if dtype not in (None, torch.float32) else None

    # --- checkpoints -------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module, full: bool = False) -> dict[str, Any]:
        if not full:
            return module.state_dict()  # DTensors: this rank's shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered one parameter at a time to rank zero's CPU; the other ranks get {}.
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Keyed by parameter name, so that any number of processes can read it back.
        return by_name(optimizer.state_dict(), parameter_names(module, optimizer))

    def save_checkpoint(self, state: dict[str, Any], path: Any, background: BackgroundWriter | None = None) -> None:
        """Every rank writes its shards into a temporary directory next to ``path``; rank zero writes
        the plain state and the index, and renames the directory into place once all are done.
        With ``background`` (``ModelCheckpoint(async_save=True)``) every rank returns once its
        shards (and rank zero's plain state) are copied to the host: DCP's thread writes them, and
        ``background``'s renames the directory into place once every rank's are written."""
        path, staging, error = Path(path), None, None
        plain = {key: value for key, value in state.items() if key not in SHARDED_KEYS}
        if self.is_global_zero:
            try:
                staging = staging_directory(path)
                if background is None:
                    save_atomic(plain, staging / STATE_FILE)
                else:
                    plain = snapshot(plain, to_host=True, buffers=background.host_buffers)
            except (OSError, TypeError) as failure:
                error = failure
                if staging is not None:
                    remove_checkpoint(staging)
        shared = self.broadcast_object(None if error is not None else str(staging))
        if shared is None:
            raise error or RuntimeError(f"Rank zero could not write the checkpoint {path}; see its error.")
        staging = Path(shared)
        if self.reduce_any(not staging.is_dir()):
            raise OSError(f"Could not write the checkpoint {path}: some rank cannot see {staging.parent}. Every process "
                          "writes its own shards, so the checkpoint directory must be on a file system that all "
                          "machines share.")
        # NumPy learning rates as Python numbers, as in one-file checkpoints (the shards' plain values
        # are read with weights_only=True too).
        shards = plain_copy({key: state[key] for key in SHARDED_KEYS if key in state}, None)
        try:
            if background is not None:
                if self._save_group is None:  # DCP's thread has collectives of its own, beside training's
                    self._save_group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
                written = write_shards_in_background(shards, staging, self._save_group, background.host_buffers.stager)
            else:
                write_shards(shards, staging, self._control_group)
                if self.is_global_zero:
                    replace_atomic(staging, path)
        except OSError as failure:
            error = failure
        if self.reduce_any(error is not None):
            if self.is_global_zero:
                remove_checkpoint(staging)
            previous = f"the previous checkpoint {path} is intact" if path.exists() else f"nothing was written at {path}"
            raise OSError(f"Could not write the checkpoint {path} ({error or 'another rank failed'}); {previous}.")
        if background is not None:  # the link to last and the pruning that ModelCheckpoint submits follow it
            background.submit(str(path), functools.partial(finish_in_background, written, staging, path,
                                                           plain if self.is_global_zero else None))

    def load_checkpoint(self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """A sharded checkpoint: each rank reads the parts of the shards its own shards cover (any
        number of processes may have written it). A file: every rank reads it whole, and
        ``load_*_state_dict`` keep each rank's shard."""
        return read_checkpoint(path, shards=lambda directory: self._read_own_shards(directory, module, optimizers))

    def _read_own_shards(self, path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        metadata = read_metadata(path)
        model = module.state_dict()
        parameters = dict(module.named_parameters())
        saved = saved_entries(metadata)
        count = 1 + max((key[1] for key in saved if key[0] == "optimizer_states"), default=-1)

        def tensor_for(key: tuple, entry: Any) -> torch.Tensor:
            """What to read a saved tensor into: a DTensor like this rank's parameter (it reads only
            its part), a whole tensor (buffers, an optimizer's step), or a meta tensor (not read)."""
            if key[0] == "state_dict":
                like = model.get(key[1])
                if like is None or tuple(like.shape) != tuple(entry.size):
                    return torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
            else:
                like = parameters.get(key[3]) if key[2] == "state" else None
                if like is None or tuple(like.shape) != tuple(entry.size):
                    return torch.empty(entry.size, dtype=entry.properties.dtype)
            return torch.empty_like(like, dtype=entry.properties.dtype)

        template = template_from_metadata(metadata, tensor_for)
        if count != len(optimizers):  # model only, or a count the Trainer reports as an error
            template.pop("optimizer_states", None)
        # Weights that do not fit the model stay unread: the Trainer names them (check_weights).
        unread = {key: value for key, value in template.get("state_dict", {}).items() if value.is_meta}
        template["state_dict"] = {key: value for key, value in template.get("state_dict", {}).items() if key not in unread}
        read_shards(template, path, self._control_group)
        return {"state_dict": {**template["state_dict"], **unread},
                "optimizer_states": template.get("optimizer_states", [{}] * count)}

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        module.load_state_dict(self._as_shards(state_dict, module.state_dict()))

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any]) -> None:
        names = parameter_names(module, optimizer)
        if not all(isinstance(key, int) for key in state_dict["state"]):  # by name: from a sharded checkpoint
            unknown = sorted(set(state_dict["state"]) - set(names))
            if unknown:
                raise MisconfigurationException(
                    f"it holds states of parameters the model does not have: {unknown[:8]}.")
            state_dict = by_index(state_dict, names)
        parameters = dict(module.named_parameters())
        shards = {index: self._as_shards(values, dict.fromkeys(values, parameters[names[index]]))
                  for index, values in state_dict["state"].items()}
        optimizer.load_state_dict(dict(state_dict, state=shards))

    def _as_shards(self, values: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
        """``values`` with each whole tensor (from a one-file checkpoint) cut to this rank's shard
        where ``like`` holds a DTensor of its shape; shards and everything else pass through."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        result = {}
        for key, value in values.items():
            target = like.get(key)
            if (isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                    and value.shape == target.shape):
                # Every rank holds the whole tensor: cut locally, no communication (src_data_rank=None).
                value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
            result[key] = value
        return result


def _units(name: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module`` as blocks to shard: itself if it has a forward and parameters, else its members."""
    if type(module).forward is nn.Module.forward:  # a container (ModuleList, ModuleDict): fully_shard needs a forward
        for child_name, child in module.named_children():
            yield from _units(f"{name}.{child_name}", child)
    elif any(True for _ in module.parameters()):
        yield name, module


def materialize(module: nn.Module, device: torch.device, name: str, skip: list[nn.Module] = ()) -> None:
    """Allocate on ``device`` and initialize the parts of ``module`` built on the meta device
    (outside ``skip``): with the module's ``init_weights()`` if it has one, else each part's
    ``reset_parameters()``. Called on one block at a time, just before it is sharded, so a whole
    model never exists on any process; every rank draws the same numbers (same seed) and keeps
    its shard, so the model starts as it would in one process."""
    skipped = {id(inner) for block in skip for inner in block.modules()}
    owners = [(sub_name, sub) for sub_name, sub in module.named_modules(prefix=name)
              if id(sub) not in skipped and any(t.is_meta for t in itertools.chain(sub.parameters(recurse=False),
                                                                                 sub.buffers(recurse=False)))]
    if not owners:
        return
    for _, sub in owners:
        sub.to_empty(device=device, recurse=False)
    if not skip and callable(getattr(module, "init_weights", None)):
        module.init_weights()
        return
    for sub_name, sub in owners:
        if not callable(getattr(sub, "reset_parameters", None)):
            raise RuntimeError(
                f"{sub_name or 'The module'} ({type(sub).__name__}) was built on the meta device, and FSDP materializes "
                "such blocks one at a time, but it has no reset_parameters() to initialize its parameters and "
                "buffers. Define reset_parameters() on it, or init_weights() on the block FSDP shards it in "
                "(see FSDP(auto_wrap=...)), or build it outside torch.device('meta')."
            )
        sub.reset_parameters()


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the window's last backward reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


