"""LR scheduler configs: :class:`SchedulerConfig` (what ``trainer.lr_scheduler_configs`` holds), read from what
``configure_optimizers`` returned (:func:`parse_scheduler_config`), Lightning's ``LRSchedulerConfig``
(``lightning.pytorch.utilities.types``), and the configs a callback sets as ``trainer.strategy.lr_scheduler_configs``
(a warm-up that swaps the schedulers in ``on_train_start``); both kinds are checked by :func:`check_stepping`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from callbacks.console import MisconfigurationException, warn


@dataclass
class SchedulerConfig:
    """One LR scheduler and when the loop steps it (Lightning's ``LRSchedulerConfig``, which
    ``trainer.lr_scheduler_configs`` holds; instances compare equal field by field, as Lightning's)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True  # False: a missing monitored metric skips the step with a warning (Lightning's)
    name: str | None = None  # the name LearningRateMonitor logs its rates under (Lightning's)
    step_with: Any = field(default=None, compare=False)  # the module's lr_scheduler_step override, called instead of scheduler.step()

    @property
    def needs_metric(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    reduce_on_plateau = needs_metric  # Lightning's field name; configs that say otherwise are refused where made


def parse_scheduler_config(item: Any, where: str, monitor: str | None = None, manual: bool = False) -> SchedulerConfig:
    if manual:  # the module steps its schedulers itself: what says when the loop steps one is ignored, as Lightning
        return _manual_scheduler_config(item, where)
    if isinstance(item, Mapping):
        plateau = isinstance(item.get("scheduler"), torch.optim.lr_scheduler.ReduceLROnPlateau)
        item = known_keys(item, "lr scheduler dict", _SCHEDULER_KEYS, "HINT: remove them from the output of "
                           f"`configure_optimizers`. They are ignored (the lr_scheduler dict {where}).")
        if "scheduler" not in item:
            raise MisconfigurationException(
                'The lr scheduler dict must have the key "scheduler" with its item being an lr scheduler: '
                f"configure_optimizers: the lr_scheduler dict {where} has {sorted(item)}.")
        if item.get("reduce_on_plateau", plateau) != plateau:  # Lightning's flag: step(metric) on any scheduler
            raise MisconfigurationException(
                f"configure_optimizers: reduce_on_plateau={item['reduce_on_plateau']!r} {where}: Cadence "
                "steps a torch ReduceLROnPlateau with its monitored metric and any other scheduler "
                "without; leave the key out.")
        config = SchedulerConfig(item["scheduler"], item.get("interval", "epoch"), item.get("frequency", 1),
                                 item.get("monitor"), bool(item.get("strict", True)), item.get("name"))
    else:  # a bare scheduler watches the dict's top-level "monitor", as in Lightning
        config = SchedulerConfig(item, monitor=monitor)
    if not hasattr(config.scheduler, "state_dict") or not hasattr(config.scheduler, "load_state_dict"):
        name = type(config.scheduler).__name__  # Lightning's words first; how it steps: scheduler_config.check_scheduler_api
        raise MisconfigurationException(
            f"The provided lr scheduler `{name}` is invalid. It should have `state_dict` and `load_state_dict` methods "
            f"defined. configure_optimizers returned {name} as an LR scheduler {where}; use a torch.optim.lr_scheduler "
            "object."
        )
    check_stepping(config, f"configure_optimizers: {{}} {where}")
    if config.needs_metric and not config.monitor:
        raise MisconfigurationException(
            "`configure_optimizers` must include a monitor when a `ReduceLROnPlateau` scheduler is used: "
            "configure_optimizers returned ReduceLROnPlateau without a metric to watch; return "
            '{"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/loss"}}.'
        )
    return config


_SCHEDULER_KEYS = ("scheduler", "name", "interval", "frequency", "reduce_on_plateau", "monitor", "strict")


def known_keys(item: Mapping, what: str, known: tuple[str, ...], advice: str) -> Mapping:
    """``item`` without the keys Lightning does not know, with Lightning's RuntimeWarning when there are some."""
    extra = [key for key in item if key not in known]
    if extra:
        warn(f"Found unsupported keys in the {what}: {{{', '.join(map(repr, extra))}}}. {advice}", RuntimeWarning)
    return {key: value for key, value in item.items() if key in known}


def _manual_scheduler_config(item: Any, where: str) -> SchedulerConfig:
    """Manual optimization (Lightning's ``_configure_schedulers_manual_opt``): any scheduler with a state
    (the module steps it: ReduceLROnPlateau needs no monitor, a non-PyTorch one is fine); ``monitor`` and
    ``strict`` are ignored with Lightning's warning."""
    if isinstance(item, Mapping):
        ignored = [key for key in item if key in ("reduce_on_plateau", "monitor", "strict")]
        if ignored:
            warnings.warn(f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. You need "
                          "to call `lr_scheduler.step()` manually in manual optimization.", RuntimeWarning, stacklevel=4)
        unknown = set(item) - {"scheduler", "interval", "frequency", "name", *ignored}
        if "scheduler" not in item or unknown:
            raise MisconfigurationException(
                f"configure_optimizers: the lr_scheduler dict {where} needs a 'scheduler' key and takes "
                f"only scheduler, interval, frequency, monitor, name, strict (got {sorted(item)}).")
        config = SchedulerConfig(item["scheduler"], item.get("interval", "epoch"), item.get("frequency", 1),
                                 name=item.get("name"))
    else:
        config = SchedulerConfig(item)
    if not hasattr(config.scheduler, "state_dict") or not hasattr(config.scheduler, "load_state_dict"):
        raise MisconfigurationException(
            f"configure_optimizers returned {type(config.scheduler).__name__} as an LR scheduler {where}: "
            "it needs state_dict and load_state_dict, so that checkpoints keep its state.")
    return config


def check_stepping(config: SchedulerConfig, where: str) -> None:
    """When the loop steps ``config``: ``interval`` "step" or "epoch", ``frequency`` an int >= 1 (Lightning's words
    first). ``where`` says where the config comes from, with ``{}`` for the setting."""
    if config.interval not in ("step", "epoch"):
        raise MisconfigurationException(
            f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is "{config.interval}": '
            + where.format(f"interval={config.interval!r}") + '; use "step" or "epoch".')
    if isinstance(config.frequency, bool) or not isinstance(config.frequency, int) or config.frequency < 1:
        raise MisconfigurationException(where.format(f"frequency={config.frequency!r}") + "; use a whole number >= 1.")


class LRSchedulerConfig(SchedulerConfig):
    """Lightning's ``lightning.pytorch.utilities.types.LRSchedulerConfig`` (its arguments in its order):
    a :class:`SchedulerConfig`, to set as ``trainer.strategy.lr_scheduler_configs``."""

    def __init__(self, scheduler: Any, name: str | None = None, interval: str = "epoch", frequency: int = 1,
                 reduce_on_plateau: bool = False, monitor: str | None = None, strict: bool = True) -> None:
        super().__init__(scheduler, interval, frequency, monitor, strict, name)
        if bool(reduce_on_plateau) != self.needs_metric:
            raise MisconfigurationException(
                f"LRSchedulerConfig(reduce_on_plateau={reduce_on_plateau}) with a "
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
        check_stepping(config, "trainer.strategy.lr_scheduler_configs: LRSchedulerConfig({})")
        if config.step_with is None and module is not None and overrides(module, "lr_scheduler_step"):
            from trainer.stage_metrics import refused_in  # it imports trainer.utilities, which imports this module

            config.step_with = refused_in(module, "lr_scheduler_step")  # no self.log there, as in Lightning
    return configs


class SchedulerAPIError(MisconfigurationException, TypeError):
    """A scheduler the loop cannot step: Lightning's MisconfigurationException, a TypeError as Cadence's was."""


def check_scheduler_api(configs: list[SchedulerConfig], module_steps_them: bool) -> None:
    """As Lightning: a scheduler that is not one of torch's (``LRScheduler``, ``ReduceLROnPlateau``)
    needs the module's ``lr_scheduler_step`` to say how it steps (timm's take the epoch)."""
    for config in configs:
        if not module_steps_them and not isinstance(config.scheduler, (
                torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            name = type(config.scheduler).__name__
            raise SchedulerAPIError(
                f"The provided lr scheduler `{name}` doesn't follow PyTorch's LRScheduler API. You should override "
                "the `LightningModule.lr_scheduler_step` hook with your own logic if you are using a custom LR "
                f"scheduler. configure_optimizers returned {name}, which is not a torch LR scheduler, so the Trainer "
                "cannot know how to step it: override lr_scheduler_step(self, scheduler, metric) in your module, e.g. "
                "scheduler.step(epoch=self.current_epoch).")
