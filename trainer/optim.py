"""Reading what ``configure_optimizers`` returned into optimizers and scheduler configs.

Accepted, as in Lightning: an optimizer; a list or tuple of optimizers; ``(optimizers,
schedulers)``; a dict ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched,
"interval": "step" | "epoch", "frequency": n, "monitor": name}}``; or a list of such dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ACCEPTED = (
    "Return an optimizer, a list of optimizers, (optimizers, schedulers), or "
    '{"optimizer": ..., "lr_scheduler": ...}.'
)


@dataclass
class SchedulerConfig:
    """One LR scheduler and when the loop steps it."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None

    @property
    def needs_metric(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _scheduler_config(item: Any, where: str) -> SchedulerConfig:
    if isinstance(item, Mapping):
        unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if "scheduler" not in item or unknown:
            raise ValueError(
                f"configure_optimizers: the lr_scheduler dict {where} needs a 'scheduler' key and "
                f"takes only scheduler, interval, frequency, monitor, name, strict (got {sorted(item)})."
            )
        config = SchedulerConfig(
            item["scheduler"], item.get("interval", "epoch"), item.get("frequency", 1), item.get("monitor")
        )
    else:
        config = SchedulerConfig(item)
    if not hasattr(config.scheduler, "step") or not hasattr(config.scheduler, "state_dict"):
        raise ValueError(
            f"configure_optimizers returned {type(config.scheduler).__name__} as an LR scheduler {where}; "
            "use a torch.optim.lr_scheduler object."
        )
    if config.interval not in ("step", "epoch"):
        raise ValueError(f'configure_optimizers: interval={config.interval!r} {where}; use "step" or "epoch".')
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"configure_optimizers: frequency={config.frequency!r} {where}; use a whole number >= 1.")
    if config.needs_metric and not config.monitor:
        raise ValueError(
            "configure_optimizers returned ReduceLROnPlateau without a metric to watch; return "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/loss"}}.'
        )
    return config


def _optimizer(item: Any) -> torch.optim.Optimizer:
    if not isinstance(item, torch.optim.Optimizer):
        raise ValueError(f"configure_optimizers returned {type(item).__name__} where an optimizer was expected. {ACCEPTED}")
    return item


def parse_optimizers(returned: Any) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Split what ``configure_optimizers`` returned into optimizers and scheduler configs."""
    if returned is None:
        raise ValueError(f"configure_optimizers returned None. {ACCEPTED}")
    if isinstance(returned, torch.optim.Optimizer):
        return [returned], []
    if isinstance(returned, Mapping):
        returned = [returned]
    if not isinstance(returned, Sequence) or isinstance(returned, str) or not returned:
        raise ValueError(f"configure_optimizers returned {returned!r}. {ACCEPTED}")
    if all(isinstance(item, Mapping) for item in returned):
        optimizers, schedulers = [], []
        for index, item in enumerate(returned):
            if "optimizer" not in item:
                raise ValueError(f"configure_optimizers: dict {index} has no 'optimizer' key. {ACCEPTED}")
            optimizers.append(_optimizer(item["optimizer"]))
            if item.get("lr_scheduler") is not None:
                schedulers.append(_scheduler_config(item["lr_scheduler"], f"in dict {index}"))
        return optimizers, schedulers
    if len(returned) == 2 and isinstance(returned[0], (list, tuple)):
        optimizers = [_optimizer(item) for item in returned[0]]
        scheduler_items = returned[1] if isinstance(returned[1], (list, tuple)) else [returned[1]]
        return optimizers, [_scheduler_config(item, f"at {i}") for i, item in enumerate(scheduler_items)]
    return [_optimizer(item) for item in returned], []


def step_schedulers(configs: list[SchedulerConfig], interval: str, count: int, metrics: dict[str, Any]) -> None:
    """Step the schedulers of ``interval`` ("step" or "epoch") whose frequency divides ``count``
    (the global step, or the number of epochs done); ReduceLROnPlateau reads its metric."""
    for config in configs:
        if config.interval != interval or count % config.frequency != 0:
            continue
        if config.needs_metric:
            if config.monitor not in metrics:
                raise RuntimeError(
                    f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged; logged "
                    f"metrics are {sorted(metrics)}. Log it with self.log or fix 'monitor'."
                )
            config.scheduler.step(float(metrics[config.monitor]))
        else:
            config.scheduler.step()


class StepOptimizer:
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
        self.optimizer = optimizer
        self._step = step
        self.applied = False  # whether a step changed the weights (the schedulers then step)

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.applied = self._step(self.optimizer)
        return loss

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
