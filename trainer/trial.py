"""What a trial run changes, kept aside and put back: the undo of ``Trainer.run_trial``.

The searches of the Tuner (the learning-rate finder, the batch-size finder) train a few steps on
the live model and optimizer. Before they do, :func:`take_snapshot` copies what training changes
to the host: the module's weights and buffers, each optimizer's state and param groups, the LR
schedulers' and the seam owners' (AMP's) states, every global RNG and the training loader's own
generators, and which submodules are in training mode. :func:`restore_snapshot` writes it back in
place, into the same tensors (so DDP's buckets, FSDP's shards and a compiled module keep theirs),
and clears the gradients a failed trial (an out-of-memory error) may have left.

The copies live in host memory, not on the device: a batch-size search measures how much device
memory the run has, and a second copy of the weights and optimizer state there would halve it.
Under FSDP each process keeps its own shards.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from callbacks import Callback
from trainer.seed import capture_rng_state, restore_rng_state


def seam_owners(callbacks: list[Any]) -> list[Any]:
    """The callbacks that change the math of a step (AMP: autocast, loss scaling), which a trial
    keeps: the others (loggers, checkpoints, early stopping, the progress bar) sit it out."""
    return [callback for callback in callbacks if callback.owns_backward or callback.owns_optimizer_step
            or type(callback).forward_context is not Callback.forward_context]


@dataclasses.dataclass
class Snapshot:
    """The state a trial may change, on the host (see the module docstring)."""

    module: dict[str, Any]
    training_modes: list[bool]
    optimizers: list[tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]]  # (param groups, state) each
    schedulers: list[dict[str, Any]]
    callbacks: list[dict[str, Any]]
    rng: dict[str, Any]
    generators: list[torch.Tensor]


def take_snapshot(module: nn.Module, optimizers: list[torch.optim.Optimizer], schedulers: list[Any],
                  callbacks: list[Any], sampler: Any) -> Snapshot:
    """Copy what a trial run may change (``sampler``: the training loader's ResumableBatchSampler, or None)."""
    return Snapshot(
        module={name: _to_host(value) for name, value in module.state_dict(keep_vars=True).items()},
        training_modes=[submodule.training for submodule in module.modules()],
        optimizers=[_optimizer_snapshot(optimizer) for optimizer in optimizers],
        schedulers=[copy.deepcopy(scheduler.state_dict()) for scheduler in schedulers],
        callbacks=[copy.deepcopy(callback.state_dict()) for callback in callbacks],
        rng=capture_rng_state(),
        generators=sampler.generator_states() if sampler is not None else [],
    )


def restore_snapshot(snapshot: Snapshot, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                     schedulers: list[Any], callbacks: list[Any], sampler: Any) -> None:
    """Put back what :func:`take_snapshot` copied, into the same objects it copied them from."""
    with torch.no_grad():
        for name, value in module.state_dict(keep_vars=True).items():
            _copy_into(value, snapshot.module[name])
        for parameter in module.parameters():
            parameter.grad = None  # a trial that failed mid-window leaves gradients behind
    for submodule, training in zip(module.modules(), snapshot.training_modes):
        submodule.training = training
    for optimizer, saved in zip(optimizers, snapshot.optimizers):
        _restore_optimizer(optimizer, *saved)
    for scheduler, state in zip(schedulers, snapshot.schedulers):
        scheduler.load_state_dict(copy.deepcopy(state))
    for callback, state in zip(callbacks, snapshot.callbacks):
        callback.load_state_dict(copy.deepcopy(state))
    restore_rng_state(snapshot.rng)
    if sampler is not None:
        sampler.set_generator_states(snapshot.generators)


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    groups = [{key: (list(value) if key == "params" else copy.deepcopy(value)) for key, value in group.items()}
              for group in optimizer.param_groups]
    state = {parameter: {key: _to_host(value) for key, value in values.items()}
             for parameter, values in optimizer.state.items()}
    return groups, state


def _restore_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                       state: dict[Any, dict[str, Any]]) -> None:
    # The groups as they were: an LR the search set, a key its scheduler added ("initial_lr"), a
    # group added meanwhile, all go.
    for group, saved in zip(optimizer.param_groups, groups):
        group.clear()
        group.update(copy.deepcopy({key: value for key, value in saved.items() if key != "params"}))
        group["params"] = list(saved["params"])
    del optimizer.param_groups[len(groups):]
    # The state: tensors the optimizer had before are written back in place; states it made
    # during the trial (Adam's moments at its first step) are dropped, as a fresh optimizer has none.
    for parameter in [p for p in optimizer.state if p not in state]:
        del optimizer.state[parameter]
    for parameter, values in state.items():
        live = optimizer.state[parameter]
        for key in [k for k in live if k not in values]:
            del live[key]
        for key, value in values.items():
            if isinstance(value, _HostTensor) and isinstance(live.get(key), torch.Tensor):
                with torch.no_grad():
                    _copy_into(live[key], value)
            elif isinstance(value, _HostTensor):
                live[key] = value.tensor.to(value.device, copy=True)
            else:
                live[key] = copy.deepcopy(value)


@dataclasses.dataclass
class _HostTensor:
    """A tensor's values on the host (a DTensor's: this process's shard)."""

    tensor: torch.Tensor
    device: torch.device  # where it lived


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this process's values: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        local = _local(value).detach()
        return _HostTensor(local.to("cpu", copy=True), local.device)
    return copy.deepcopy(value)


def _copy_into(live: torch.Tensor, saved: Any) -> None:
    if isinstance(saved, _HostTensor):
        _local(live).copy_(saved.tensor)
