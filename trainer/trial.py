"""What a trial run changes, kept aside and put back: the undo of ``Trainer.run_trial``.

The searches of the Tuner (the learning-rate finder, the batch-size finder) run a few steps of
the running stage's loop on the live model and optimizer, from a hook. Two things are kept aside:

- The Trainer's own state. ``run_trial`` keeps every attribute of the Trainer as it is (its
  ``vars``) and puts them all back afterwards; what the loop changes in place (the position in
  ``state.Progress``, the ``LossGuard``'s losses, the ``MetricStore``, the phase times, the
  preemption flag) it first replaces with fresh objects for the trial, and the ``StagePlan`` with
  one whose hooks are the trial's callbacks'. The counters, ``should_stop``, the limits, the
  schedulers and loaders in use, and any attribute added later, come back without a list to keep.
- What training changes in objects the Trainer shares with the user (:class:`Snapshot`): the
  module's weights and buffers, each optimizer's state and param groups, the LR schedulers' and the
  seam owners' (AMP's) states, every global RNG and the training loader's own generators, and which
  submodules are in training mode. :meth:`Snapshot.restore` writes it back in place, into the same
  tensors (so DDP's buckets, FSDP's shards and a compiled module keep theirs), and clears the
  gradients a failed trial (an out-of-memory error) may have left.

The copies live in host memory, not on the device: a batch-size search measures how much device
memory the run has, and a second copy of the weights and optimizer state there would halve it.
Under FSDP each process keeps its own shards.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from callbacks.base import defines
from trainer.guards import LossGuard
from trainer.metrics import MetricStore
from trainer.preemption import Preemption
from trainer.seed import capture_rng_state, restore_rng_state
from trainer.state import Progress
from trainer.timing import PhaseTimes


def fresh_loop_state(strategy: Any, sampler: Any) -> tuple[MetricStore, Progress, LossGuard, Preemption, PhaseTimes]:
    """What the loop changes in place, new for a trial: a metric store, a position (on the same training
    ``sampler``, not resuming), a loss guard that checks nothing, no preemption, phase times."""
    return (MetricStore(strategy.all_reduce, strategy.all_gather_object), Progress(sampler=sampler), LossGuard("ignore"),
            Preemption(), PhaseTimes())


def seam_owners(callbacks: list[Any]) -> list[Any]:
    """The callbacks that change the math of a step (AMP: autocast, loss scaling), which a trial
    keeps: the others (loggers, checkpoints, early stopping, the progress bar) sit it out."""
    return [callback for callback in callbacks if callback.owns_backward is True or callback.owns_optimizer_step is True
            or defines(callback, "forward_context")]


@dataclasses.dataclass
class Snapshot:
    """The state a trial may change, copied to the host (see the module docstring), with the live
    objects :meth:`restore` writes it back into."""

    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    seam_owners: list[Any]  # the callbacks the trial keeps (:func:`seam_owners`)
    sampler: Any  # the training loader's ResumableBatchSampler, or None
    weights: dict[str, Any]
    training_modes: list[bool]
    optimizer_states: list[tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]]  # (param groups, state) each
    scheduler_states: list[dict[str, Any]]
    seam_states: list[dict[str, Any]]
    rng: dict[str, Any]
    generators: list[torch.Tensor]

    @classmethod
    def take(cls, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler_configs: list[Any],
             callbacks: list[Any], sampler: Any) -> Snapshot:
        """Copy what a trial may change: ``module`` (None: no stage runs, an error), ``optimizers``, the
        schedulers of ``scheduler_configs``, the seam owners among ``callbacks``, every RNG and
        ``sampler``'s generators."""
        if module is None:
            raise RuntimeError("Trainer.run_trial runs the loop of a running stage: call it from a hook (on_fit_start, "
                               "on_train_epoch_start, on_test_start, ...).")
        schedulers, seams = [config.scheduler for config in scheduler_configs], seam_owners(callbacks)
        return cls(
            module, list(optimizers), schedulers, seams, sampler,
            weights={name: _to_host(value) for name, value in module.state_dict(keep_vars=True).items()},
            training_modes=[submodule.training for submodule in module.modules()],
            optimizer_states=[_optimizer_snapshot(optimizer) for optimizer in optimizers],
            scheduler_states=[copy.deepcopy(scheduler.state_dict()) for scheduler in schedulers],
            seam_states=[copy.deepcopy(callback.state_dict()) for callback in seams],
            rng=capture_rng_state(),
            generators=sampler.generator_states() if sampler is not None else [],
        )

    def restore(self) -> None:
        """Put back what :meth:`take` copied, into the same objects it copied them from."""
        with torch.no_grad():
            for name, value in self.module.state_dict(keep_vars=True).items():
                _copy_into(value, self.weights[name])
            for parameter in self.module.parameters():
                parameter.grad = None  # a trial that failed mid-window leaves gradients behind
        for submodule, training in zip(self.module.modules(), self.training_modes):
            submodule.training = training
        for optimizer, saved in zip(self.optimizers, self.optimizer_states):
            _restore_optimizer(optimizer, *saved)
        for scheduler, state in zip(self.schedulers, self.scheduler_states):
            scheduler.load_state_dict(copy.deepcopy(state))
        for callback, state in zip(self.seam_owners, self.seam_states):
            callback.load_state_dict(copy.deepcopy(state))
        restore_rng_state(self.rng)
        if self.sampler is not None:
            self.sampler.set_generator_states(self.generators)


@contextlib.contextmanager
def kept_trainable(module: nn.Module) -> Iterator[None]:
    """Leave ``module``'s ``requires_grad`` flags as they were: a search's setup hooks may freeze
    some (BaseFinetuning's ``freeze_before_training``), which Lightning leaves frozen."""
    trainable = [parameter.requires_grad for parameter in module.parameters()]
    try:
        yield
    finally:
        for parameter, requires_grad in zip(module.parameters(), trainable):
            parameter.requires_grad_(requires_grad)


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
