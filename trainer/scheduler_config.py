"""Lightning's ``LRSchedulerConfig`` (``lightning.pytorch.utilities.types``) and the configs a callback sets as
``trainer.strategy.lr_scheduler_configs`` (a warm-up that swaps the schedulers in ``on_train_start``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainer.optim import SchedulerConfig


class LRSchedulerConfig(SchedulerConfig):
    """Lightning's ``lightning.pytorch.utilities.types.LRSchedulerConfig`` (its arguments in its order):
    a :class:`SchedulerConfig`, to set as ``trainer.strategy.lr_scheduler_configs``."""

    def __init__(self, scheduler: Any, name: str | None = None, interval: str = "epoch", frequency: int = 1,
                 reduce_on_plateau: bool = False, monitor: str | None = None, strict: bool = True) -> None:
        super().__init__(scheduler, interval, frequency, monitor, strict, name)
        if bool(reduce_on_plateau) != self.needs_metric:
            raise ValueError(f"LRSchedulerConfig(reduce_on_plateau={reduce_on_plateau}) with a "
                             f"{type(scheduler).__name__}: reduce_on_plateau says whether the scheduler is a torch "
                             "ReduceLROnPlateau (Cadence steps that one with its monitored metric, any other without): "
                             f"pass reduce_on_plateau={self.needs_metric}.")

    def __eq__(self, other: object) -> bool:  # equal to the loop's config of the same fields, as Lightning's test it
        if not isinstance(other, SchedulerConfig):
            return NotImplemented
        return all(getattr(self, field.name) == getattr(other, field.name)
                   for field in dataclasses.fields(SchedulerConfig) if field.compare)


def replacement_scheduler_configs(configs: Any, module: Any) -> list[SchedulerConfig]:
    """The configs set as ``trainer.strategy.lr_scheduler_configs``, checked, and stepped through the
    module's ``lr_scheduler_step`` when it overrides it (as the loop steps those of configure_optimizers)."""
    from trainer.datamodule import overrides  # trainer.utilities imports this module, and datamodule imports it

    configs = list(configs)
    for config in configs:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"trainer.strategy.lr_scheduler_configs takes LRSchedulerConfig objects (from "
                            f"trainer.utilities), not {type(config).__name__}.")
        if config.interval not in ("step", "epoch") or not isinstance(config.frequency, int) or config.frequency < 1:
            raise ValueError(f"LRSchedulerConfig(interval={config.interval!r}, frequency={config.frequency!r}): "
                             'interval is "step" or "epoch", frequency a positive int.')
        if config.step_with is None and module is not None and overrides(module, "lr_scheduler_step"):
            from trainer.stage_metrics import refused_in  # it imports trainer.utilities, which imports this module

            config.step_with = refused_in(module, "lr_scheduler_step")  # no self.log there, as in Lightning
    return configs


def check_scheduler_api(configs: list[SchedulerConfig], module_steps_them: bool) -> None:
    """As Lightning: a scheduler that is not one of torch's (``LRScheduler``, ``ReduceLROnPlateau``)
    needs the module's ``lr_scheduler_step`` to say how it steps (timm's take the epoch)."""
    for config in configs:
        if not module_steps_them and not isinstance(config.scheduler, (
                torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            name = type(config.scheduler).__name__
            raise TypeError(
                f"The provided lr scheduler `{name}` doesn't follow PyTorch's LRScheduler API. You should override "
                "the `LightningModule.lr_scheduler_step` hook with your own logic if you are using a custom LR "
                f"scheduler. configure_optimizers returned {name}, which is not a torch LR scheduler, so the Trainer "
                "cannot know how to step it: override lr_scheduler_step(self, scheduler, metric) in your module, e.g. "
                "scheduler.step(epoch=self.current_epoch).")
