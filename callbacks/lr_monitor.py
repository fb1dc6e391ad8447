"""LearningRateMonitor: every optimizer's learning rates (and momentum, weight decay) in the logs.

Lightning's callback, with its names: ``lr-SGD`` for one optimizer with one parameter group,
``lr-Adam/pg1``, ``lr-Adam/pg2`` (or the group's ``"name"``) for several groups, ``lr-Adam-1``
for a second optimizer of the same class, and ``-momentum`` / ``-weight_decay`` after the name.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import warnings

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class LearningRateMonitor(Callback):
    """Log the learning rate of every optimizer's parameter groups while training.

    Per-step values are logged like ``self.log(name, value, on_step=True)`` when each batch
    starts, so a log step holds the rate that step used (as in Lightning): they reach the loggers
    at log steps (``Trainer(log_every_n_steps)``), in the same row as the step's other metrics, and
    ``trainer.callback_metrics``. Reading them costs no device sync (learning rates are Python
    numbers; a tensor learning rate stays on its device until the log step).

    Lightning's members: ``lrs`` (name -> the rates written so far), ``last_momentum_values`` and
    ``last_weight_decay_values`` (name -> the last value written, None before one is).

    Args:
        logging_interval: ``"step"`` (at log steps), ``"epoch"`` (at each epoch start), or None:
            each optimizer by its scheduler's interval (per step when it has none).
        log_momentum: also log momentum (``betas[0]`` for Adam-like optimizers; 0 when there is none).
        log_weight_decay: also log weight decay.

    Example::

        Trainer(callbacks=[LearningRateMonitor(logging_interval="step")])
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f'LearningRateMonitor(logging_interval={logging_interval!r}): use "step", "epoch" or None.')
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._per_step: list[tuple[torch.optim.Optimizer, list[str]]] = []
        self._per_epoch: list[tuple[torch.optim.Optimizer, list[str]]] = []
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.loggers:
            raise ValueError(
                "LearningRateMonitor writes to the loggers, and this Trainer has none (logger=False). "
                "Use Trainer(logger=True), pass a logger, or remove the LearningRateMonitor."
            )
        epoch_interval = {id(config.scheduler.optimizer) for config in trainer.lr_scheduler_configs
                          if config.interval == "epoch"}
        if self.log_momentum and any("momentum" not in optimizer.defaults and "betas" not in optimizer.defaults
                                     for optimizer in trainer.optimizers):
            warnings.warn("You have set log_momentum=True, but some optimizers do not have momentum. This will log a "
                          "value 0 for the momentum.", RuntimeWarning, stacklevel=2)
        self._per_step, self._per_epoch = [], []
        all_names = [name for names in optimizer_names(trainer.optimizers) for name in names]
        self.lrs = {name: [] for name in all_names}
        self.last_momentum_values = {f"{name}-momentum": None for name in all_names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in all_names}
        for optimizer, names in zip(trainer.optimizers, optimizer_names(trainer.optimizers)):
            by_epoch = self.logging_interval == "epoch" or (self.logging_interval is None and id(optimizer) in epoch_interval)
            (self._per_epoch if by_epoch else self._per_step).append((optimizer, names))

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        # Every batch, before its step, without a sync: the metric store keeps the last value before a log step.
        for optimizer, names in self._per_step:
            for name, value in self._stats(optimizer, names).items():
                module.log(name, value, on_step=True, on_epoch=False)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        self._remember(metrics)  # what reached the loggers

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        stats = {name: float(value) for optimizer, names in self._per_epoch
                 for name, value in self._stats(optimizer, names).items()}
        if stats:
            self._remember(stats)
            for logger in trainer.loggers:  # after the previous epoch's values: rows stay in step order
                logger.log_metrics({**stats, "epoch": trainer.current_epoch}, step=trainer.global_step)
            trainer.callback_metrics.update({name: torch.tensor(value) for name, value in stats.items()})

    def _remember(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            if name in self.lrs:
                self.lrs[name].append(value)
            elif name in self.last_momentum_values:
                self.last_momentum_values[name] = value
            elif name in self.last_weight_decay_values:
                self.last_weight_decay_values[name] = value

    def _stats(self, optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
        stats = {}
        betas = "betas" in optimizer.defaults
        for group, name in zip(optimizer.param_groups, names):
            stats[name] = group["lr"]
            if self.log_momentum:
                stats[f"{name}-momentum"] = group["betas"][0] if betas else group.get("momentum", 0)
            if self.log_weight_decay:
                stats[f"{name}-weight_decay"] = group.get("weight_decay", 0)
        return stats


def optimizer_names(optimizers: list[torch.optim.Optimizer]) -> list[list[str]]:
    """Lightning's names for each optimizer's parameter groups."""
    seen: Counter = Counter()
    names = []
    for optimizer in optimizers:
        kind = type(optimizer).__name__
        seen[kind] += 1
        base = f"lr-{kind}" + (f"-{seen[kind] - 1}" if seen[kind] > 1 else "")
        groups = optimizer.param_groups
        if len(groups) == 1:
            names.append([f"{base}/{groups[0]['name']}" if groups[0].get("name") else base])
        else:
            names.append([f"{base}/{group.get('name', f'pg{index}')}" for index, group in enumerate(groups, start=1)])
    return names
