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

from callbacks.console import MisconfigurationException
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
            raise MisconfigurationException(
                f'LearningRateMonitor(logging_interval={logging_interval!r}): use "step", "epoch" or None.')
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._per_step: list[tuple[torch.optim.Optimizer, list[str]]] = []
        self._per_epoch: list[tuple[torch.optim.Optimizer, list[str]]] = []
        self._names: set[str] = set()  # the rates' names (lrs' keys) now
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger. LearningRateMonitor writes "
                "to the loggers, and this Trainer has none (logger=False). Use Trainer(logger=True), pass a logger, or "
                "remove the LearningRateMonitor."
            )
        if self.log_momentum:  # Lightning's check: the optimizers with a scheduler when there are schedulers
            optimizers = [config.scheduler.optimizer for config in trainer.lr_scheduler_configs] or trainer.optimizers
            if all(any(key not in optimizer.defaults for optimizer in optimizers) for key in ("momentum", "betas")):
                warnings.warn("You have set log_momentum=True, but some optimizers do not have momentum. This will log "
                              "a value 0 for the momentum.", RuntimeWarning, stacklevel=2)
        groups = self._name_groups(trainer)
        names = [name for _, group_names, _ in groups for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        # Every batch, before its step, without a sync: the metric store keeps the last value before a log step.
        for optimizer, names in self._per_step:
            for name, value in self._stats(optimizer, names).items():
                # As Lightning's, the rates reach the loggers as they are (self.log would round them to float32).
                trainer.metrics.current.log(name, value, prog_bar=False, logger=None, on_step=True, on_epoch=False,
                                            reduce_fx="mean", sync_dist=False, sync_dist_group=None,
                                            add_dataloader_idx=True, batch_size=None, rank_zero_only=False)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        self._remember(metrics)  # what reached the loggers

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        groups = self._name_groups(trainer)  # a callback may have added parameter groups (BaseFinetuning)
        self._remap([name for _, names, _ in groups for name in names])
        stats = {name: float(value) for optimizer, names in self._per_epoch
                 for name, value in self._stats(optimizer, names).items()}
        if stats:
            self._remember(stats)
            for logger in trainer.loggers:  # after the previous epoch's values: rows stay in step order
                logger.log_metrics(stats, step=trainer.batches_that_stepped)  # no "epoch": as Lightning logs them
            trainer.callback_metrics.update({name: torch.tensor(value) for name, value in stats.items()})

    def _name_groups(self, trainer: Trainer) -> list[tuple[torch.optim.Optimizer, list[str], str | None]]:
        """Each optimizer's names, and when they are logged: Lightning's names and order (the optimizers with
        a scheduler first, named by its ``"name"`` when it has one, then the others); the per-step and the
        per-epoch lists."""
        groups = lightning_names(trainer.lr_scheduler_configs, trainer.optimizers)
        self._names = {name for _, names, _ in groups for name in names}
        self._per_step, self._per_epoch = [], []
        for optimizer, names, interval in groups:  # interval None: no scheduler, logged at steps and epochs alike
            if self.logging_interval == "step" or (self.logging_interval is None and interval in ("step", None)):
                self._per_step.append((optimizer, names))
            if self.logging_interval == "epoch" or (self.logging_interval is None and interval in ("epoch", None)):
                self._per_epoch.append((optimizer, names))
        return groups

    def _remap(self, names: list[str]) -> None:
        """Lightning's renaming when an optimizer gains parameter groups: ``lr-SGD`` goes on as ``lr-SGD/pg1``."""
        for name in names:
            old = name.replace("/pg1", "")
            if "/pg1" in name and old in self.lrs:
                self.lrs[name] = self.lrs.pop(old)
            elif name not in self.lrs:
                self.lrs[name] = []

    def _remember(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            if name in self._names:
                self.lrs.setdefault(name, []).append(value)
            elif name.endswith("-momentum") and name[:-9] in self._names:
                self.last_momentum_values[name] = value
            elif name.endswith("-weight_decay") and name[:-13] in self._names:
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


def lightning_names(configs: list[Any], optimizers: list[torch.optim.Optimizer],
                    ) -> list[tuple[torch.optim.Optimizer, list[str], str | None]]:
    """``(optimizer, names of its parameter groups, its scheduler's interval or None)``, as Lightning names them.

    The optimizers with a scheduler come first, in the schedulers' order, named by the scheduler's
    ``"name"`` or ``lr-<class>``; then the others, ``lr-<class>``. A second optimizer of a class gets
    ``-1`` (a named scheduler's does not count); several groups ``/pg1``, ``/pg2`` or their ``"name"``.
    """
    seen: Counter = Counter()
    named: list[tuple[torch.optim.Optimizer, str, str | None, bool]] = []  # (..., whether the name is the user's)
    for config in configs:
        optimizer = config.scheduler.optimizer
        named.append((optimizer, config.name or f"lr-{type(optimizer).__name__}", config.interval, bool(config.name)))
    with_scheduler = [optimizer for optimizer, *_ in named]
    named += [(optimizer, f"lr-{type(optimizer).__name__}", None, False) for optimizer in optimizers
              if not any(optimizer is other for other in with_scheduler)]
    result = []
    for optimizer, name, interval, users in named:
        kind = type(optimizer)
        if not users:
            seen[kind] += 1
        if seen[kind] > 1:
            name += f"-{seen[kind] - 1}"
        groups = optimizer.param_groups
        group_names = [group.get("name", f"pg{index}") for index, group in enumerate(groups, start=1)]
        duplicates = sorted({group for group in group_names if group_names.count(group) > 1})
        if duplicates:
            raise MisconfigurationException(
                f"A single `Optimizer` cannot have multiple parameter groups with identical `name` values. "
                f"{name} has duplicated parameter group names {duplicates}: give each group its own name.")
        if len(groups) > 1:
            result.append((optimizer, [f"{name}/{group}" for group in group_names], interval))
        else:
            result.append((optimizer, [f"{name}/{groups[0]['name']}" if groups[0].get("name") else name], interval))
    return result
