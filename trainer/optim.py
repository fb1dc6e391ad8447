"""Reading what ``configure_optimizers`` returned into optimizers and scheduler configs (each scheduler's:
trainer/scheduler_config.py).

Accepted, as in Lightning: an optimizer; a list or tuple of optimizers; ``(optimizers,
schedulers)``; a dict ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched,
"interval": "step" | "epoch", "frequency": n, "monitor": name}}``; or a list of such dicts.
"""

from __future__ import annotations

import warnings

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from callbacks.console import MisconfigurationException, warn
from trainer.scheduler_config import SchedulerConfig, known_keys, parse_scheduler_config

ACCEPTED = (
    "Return an optimizer, a list of optimizers, (optimizers, schedulers), or "
    '{"optimizer": ..., "lr_scheduler": ...}.'
)
UNKNOWN = "Unknown configuration for model optimizers: "  # Lightning's words, which its tests match


class NoOptimizer(torch.optim.Optimizer):
    """What fit steps when ``configure_optimizers`` returns None (Lightning's ``_MockOptimizer``): its
    step changes no weight (it runs the closure, if given); ``global_step`` still counts the steps."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})

    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _optimizer(item: Any) -> torch.optim.Optimizer:
    if not isinstance(item, torch.optim.Optimizer):
        raise MisconfigurationException(
            f"{UNKNOWN}configure_optimizers returned {type(item).__name__} where an optimizer was expected. "
            f"{ACCEPTED}")
    return item


def parse_optimizers(returned: Any, manual: bool = False) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Split what ``configure_optimizers`` returned into optimizers and scheduler configs (``manual``:
    the module steps the schedulers, manual optimization); each scheduler's optimizer must be among them."""
    optimizers, schedulers = _parse_optimizers(returned, manual)
    for config in schedulers:
        optimizer = getattr(config.scheduler, "optimizer", None)
        if optimizer is not None and not any(optimizer is each for each in optimizers):
            raise MisconfigurationException(
                f"configure_optimizers: the {type(config.scheduler).__name__} scheduler is attached with an "
                "optimizer that wasn't returned (its learning rate would change nothing that trains); "
                "make the scheduler from an optimizer you return.")
    return optimizers, schedulers


def _parse_optimizers(returned: Any, manual: bool) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    if returned is None:  # as in Lightning: a warning, and an optimizer that moves nothing
        warn("configure_optimizers returned None: this fit will run with no optimizer (training_step and backward "
             f"run, no weight changes). If that is not what you want: {ACCEPTED}")
        return [NoOptimizer()], []
    if isinstance(returned, torch.optim.Optimizer):
        return [returned], []
    if isinstance(returned, Mapping):
        returned = [returned]
    if not isinstance(returned, Sequence) or isinstance(returned, str) or not returned:
        raise MisconfigurationException(f"{UNKNOWN}configure_optimizers returned {returned!r}. {ACCEPTED}")
    if all(isinstance(item, Mapping) for item in returned):
        optimizers, schedulers = [], []
        for index, item in enumerate(returned):
            if "optimizer" not in item:
                raise MisconfigurationException(
                    f"configure_optimizers: dict {index} has no 'optimizer' key. {ACCEPTED}")
            item = known_keys(item, "optimizer configuration", ("optimizer", "lr_scheduler", "monitor"),
                               f"They are ignored (dict {index} returned by `configure_optimizers`).")
            optimizers.append(_optimizer(item["optimizer"]))
            if item.get("lr_scheduler") is not None:
                schedulers.append(parse_scheduler_config(item["lr_scheduler"], f"in dict {index}", item.get("monitor"), manual))
        return optimizers, schedulers
    if len(returned) == 2 and isinstance(returned[0], (list, tuple)):
        optimizers = [_optimizer(item) for item in returned[0]]
        scheduler_items = returned[1] if isinstance(returned[1], (list, tuple)) else [returned[1]]
        return optimizers, [parse_scheduler_config(item, f"at {i}", manual=manual) for i, item in enumerate(scheduler_items)]
    return [_optimizer(item) for item in returned], []


class MissingMonitorError(MisconfigurationException, RuntimeError):
    """A ReduceLROnPlateau's monitored metric was not logged: Lightning's MisconfigurationException, a RuntimeError as
    Cadence's was."""


def step_schedulers(configs: list[SchedulerConfig], interval: str, count: int, metrics: Any,
                    plateau: bool | None = None) -> bool:
    """Step the schedulers of ``interval`` ("step" or "epoch") whose frequency divides ``count``
    (for "step", the batches done in this epoch, as Lightning counts: its ``frequency`` restarts each
    epoch and counts batches, not optimizer steps; for "epoch", the epochs done); ReduceLROnPlateau
    reads its metric.
    ``plateau``: only the ReduceLROnPlateau ones (True) or only the others (False). ``metrics``: a dict, or a
    callable returning one, called only when a ReduceLROnPlateau steps (this batch's values, as Lightning).
    Returns whether a ReduceLROnPlateau of ``interval`` is due and was left (``plateau=False``): Lightning steps
    the "step" ones after ``on_train_batch_end`` and the validation that batch runs, whose metric they may watch."""
    plateau_left = False
    for config in configs:
        if config.interval != interval or count % config.frequency != 0:
            continue
        if plateau is not None and plateau != config.needs_metric:
            plateau_left = plateau_left or config.needs_metric
            continue
        if config.needs_metric:
            metrics = metrics() if callable(metrics) else metrics
            if config.monitor not in metrics and not config.strict:
                warnings.warn(f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not available but "
                              f"strict is set to `False`. Skipping learning rate update: ReduceLROnPlateau watches "
                              f"{config.monitor!r}, which was not logged.", RuntimeWarning, stacklevel=2)
                continue
            if config.monitor not in metrics:
                raise MissingMonitorError(  # Lightning's words first
                    f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not available. Available metrics "
                    f"are: {sorted(metrics)}. ReduceLROnPlateau watches {config.monitor!r}, which was not logged: log "
                    "it with self.log or fix 'monitor'."
                )
            if config.step_with is not None:  # Lightning passes the logged value as it is
                config.step_with(config.scheduler, metrics[config.monitor])
            else:
                config.scheduler.step(float(metrics[config.monitor]))
        elif config.step_with is not None:
            config.step_with(config.scheduler, None)
        else:
            config.scheduler.step()
    return plateau_left


# ---------------------------------------------------------------------------------------------
# Clipping, and optimizers whose step a callback owns
# ---------------------------------------------------------------------------------------------
CLIP_ALGORITHMS = ("norm", "value")


def ends_accumulation_window(batch_idx: int, accumulate_grad_batches: int, num_batches: int | float) -> bool:
    """True after the batch that ends an accumulation window (every batch without accumulation, as
    in manual optimization): a checkpoint there holds no half-accumulated gradients."""
    return (batch_idx + 1) % accumulate_grad_batches == 0 or batch_idx + 1 == num_batches


def single_owner(owners: list[Any], seam: str) -> Any:
    """The one callback among ``owners`` (those that set the ``seam`` flag), or None; two are an error."""
    if len(owners) > 1:
        names = " and ".join(type(owner).__name__ for owner in owners)
        raise MisconfigurationException(
            f"{names} both set {seam}=True; one callback may own that seam. Remove one of them.")
    return owners[0] if owners else None


def step_owner(callbacks: list[Any]) -> Any:
    """The callback that owns the optimizer step (AMP's GradScaler), or None."""
    return single_owner([c for c in callbacks if c.owns_optimizer_step is True], "owns_optimizer_step")


def trainer_clipping(optimizer: torch.optim.Optimizer, value: float, algorithm: str | None) -> Any:
    """``Trainer(gradient_clip_val=value, gradient_clip_algorithm=algorithm)``'s clipping of the
    optimizer of automatic optimization (None: by norm): a function of the optimizer being stepped."""
    parameters, algorithm = ClippedParameters(optimizer), algorithm or "norm"

    def clip(stepped: torch.optim.Optimizer) -> None:
        clip_gradients(parameters(), value, algorithm)

    return clip


class ClippedParameters:
    """What gradient clipping walks: ``optimizer``'s parameters, every group's. Read again only when
    its list of param groups changes length (``add_param_group``: BaseFinetuning's unfrozen backbone;
    a search's trial putting the groups back), so a step pays a length check (~0.1 us) instead of a
    walk over the groups (~0.8 us for 4 parameters, ~11 us for 200). A parameter appended to an
    existing group's list by hand is not seen; add it with ``add_param_group``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._groups, self._parameters = -1, []

    def __call__(self) -> list[torch.nn.Parameter]:
        groups = self.optimizer.param_groups
        if len(groups) != self._groups:
            self._groups, self._parameters = len(groups), [p for group in groups for p in group["params"]]
        return self._parameters


def clip_gradients(parameters: list[torch.nn.Parameter], value: float, algorithm: str) -> None:
    """Clip the gradients of ``parameters`` by their total 2-norm or elementwise by ``value``."""
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(parameters, value)
    else:
        torch.nn.utils.clip_grad_value_(parameters, value)


def clip_optimizer_gradients(trainer: Any, optimizer: Any, value: Any, algorithm: Any) -> None:
    """``TrainingModule.clip_gradients``: unscale ``optimizer``'s gradients if a callback of the
    running ``trainer`` scaled them (AMP float16), then clip them. As in Lightning, ``value`` and
    ``algorithm`` None take the Trainer's (``gradient_clip_val`` None: nothing is clipped); given,
    they must agree with a ``Trainer(gradient_clip_val=...)``."""
    if value is None:
        value = trainer.gradient_clip_val
    elif trainer.gradient_clip_val is not None and value != trainer.gradient_clip_val:
        raise MisconfigurationException(
            f"You have set `Trainer(gradient_clip_val={trainer.gradient_clip_val!r})` and have passed "
            f"`clip_gradients(gradient_clip_val={value!r})`. Please use only one of them.")
    if algorithm is None:
        algorithm = trainer.gradient_clip_algorithm or "norm"
    elif trainer.gradient_clip_algorithm is not None and algorithm != trainer.gradient_clip_algorithm:
        raise MisconfigurationException(
            f"You have set `Trainer(gradient_clip_algorithm={trainer.gradient_clip_algorithm!r})` and "
            f"have passed `clip_gradients(gradient_clip_algorithm={algorithm!r}) Please use only one of them.")
    if algorithm not in CLIP_ALGORITHMS:
        raise MisconfigurationException(
            f'clip_gradients(gradient_clip_algorithm={algorithm!r}): use "norm" or "value".')
    if isinstance(value, bool) or not isinstance(value, (int, float, type(None))) or (value is not None and value < 0):
        raise MisconfigurationException(
            f"clip_gradients(gradient_clip_val={value!r}): use a positive number, or 0 or None to clip "
            "nothing.")
    if not value:  # None or 0: nothing is clipped, as in Lightning
        return
    optimizer = optimizer.optimizer if isinstance(optimizer, OptimizerView) else optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MisconfigurationException(
            f"clip_gradients got {type(optimizer).__name__}; pass an optimizer from self.optimizers().")
    owner = step_owner(trainer.callbacks)
    if owner is not None:
        owner.unscale_gradients(trainer, trainer.module, optimizer)
    clip_gradients([p for group in optimizer.param_groups for p in group["params"]], value, algorithm)


def freeze_other_optimizers(optimizers: list[Any], optimizer: Any) -> dict[torch.nn.Parameter, bool]:
    """``toggle_optimizer``: only ``optimizer``'s parameters (among ``optimizers``') keep requiring
    gradients; returns every parameter's ``requires_grad`` before, for :func:`unfreeze_other_optimizers`."""
    state: dict[torch.nn.Parameter, bool] = {}
    for other in optimizers:
        for group in other.param_groups:
            for parameter in group["params"]:
                if parameter not in state:
                    state[parameter] = parameter.requires_grad
                    parameter.requires_grad = False
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.requires_grad = state.get(parameter, parameter.requires_grad)
    return state


def unfreeze_other_optimizers(optimizers: list[Any], optimizer: Any, state: dict[torch.nn.Parameter, bool]) -> None:
    """``untoggle_optimizer``: the parameters of ``optimizers`` other than ``optimizer`` require
    gradients again as ``state`` (from :func:`freeze_other_optimizers`) says they did."""
    toggled = getattr(optimizer, "optimizer", optimizer)  # a wrapper, or the torch optimizer
    for other in optimizers:
        if other is toggled:
            continue
        for group in other.param_groups:
            for parameter in group["params"]:
                if parameter in state:
                    parameter.requires_grad = state[parameter]


class OptimizerView:
    """An optimizer seen through a wrapper whose ``step`` the Trainer takes: the rest reads through
    to the torch optimizer (``param_groups``, where a warm-up sets ``lr``; ``state``; ``zero_grad``;
    the state dicts), which is also ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class StepOptimizer(OptimizerView):
    """The optimizer a module's ``optimizer_step`` override receives (Lightning's LightningOptimizer).

    ``step(closure)`` runs ``closure`` (it returns the batch's loss: forward and backward have
    run), then the Trainer's step: ``on_before_optimizer_step``, gradient clipping and the
    optimizer's step, through the callback that owns the step when there is one (AMP's scaler).
    The rest reads through to the optimizer: ``param_groups`` (a warm-up sets ``lr`` there),
    ``state``, ``zero_grad``, ``state_dict``.

    Args:
        optimizer: the torch optimizer.
        step: the Trainer's step of ``optimizer``; returns False when the step was skipped (AMP).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        super().__init__(optimizer)
        self._step = step
        self.applied = False  # whether a step changed the weights (the schedulers then step)

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.applied = self._step(self.optimizer)
        return loss


class OwnedStepOptimizer(OptimizerView):
    """What ``self.optimizers()`` returns in manual optimization when a callback owns the
    optimizer step (AMP float16): ``step()`` goes through that callback (``GradScaler.step``,
    which skips the step when the gradients are not finite, then its update).

    It is not a ``torch.optim.Optimizer`` subclass; it offers what a ``training_step`` uses:
    ``step(closure=None)``, ``zero_grad(set_to_none=True)``, ``param_groups``, ``state``,
    ``defaults``, ``state_dict()``, ``load_state_dict()``, ``add_param_group()``, and the torch
    optimizer itself as ``.optimizer``. A skipped step counts in ``global_step``, as in automatic
    optimization and in Lightning.

    Args:
        optimizer: the optimizer from ``configure_optimizers``.
        owner: the callback that owns the optimizer step; it takes the step.
        trainer: the running Trainer, which the owner is called with.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, owner: Any, trainer: Any) -> None:
        super().__init__(optimizer)
        self._owner, self._trainer = owner, trainer

    def step(self, closure: Any = None) -> Any:
        """Run ``closure`` (if given, with grad enabled), then the owner's step."""
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        trainer = self._trainer
        if not self._owner.optimizer_step(trainer, trainer.module, self.optimizer):
            trainer.global_step += 1  # a step that ran is counted by the optimizer's step hook
        return result


def optimizers_for_module(trainer: Any) -> list[Any]:
    """What ``self.optimizers()`` hands a manual ``training_step``: the running ``trainer``'s
    optimizers, each wrapped in :class:`OwnedStepOptimizer` when a callback owns the optimizer step."""
    owner = step_owner(trainer.callbacks)
    if owner is None:
        return list(trainer.optimizers)
    return [OwnedStepOptimizer(optimizer, owner, trainer) for optimizer in trainer.optimizers]
