"""Lightning's ``DeviceStatsMonitor``: the device's statistics in the loggers at log steps.

Keys are ``DeviceStatsMonitor.<hook>/<stat>`` (the logger's group separator in place of ``/``), for
the train, validation and test batches' start and end hooks, written at the steps the metrics are
(``log_every_n_steps``), as in Lightning:

- CUDA: ``torch.cuda.memory_stats(device)`` (the caching allocator's counters, in bytes: a host-side
  read that does not wait for the device);
- CPU: ``cpu_percent``, ``cpu_vm_percent``, ``cpu_swap_percent`` from ``psutil``; on a GPU too with
  ``cpu_stats=True``. ``psutil`` is not one of Cadence's dependencies: without it, CPU statistics
  asked for (``cpu_stats=None`` on the CPU, or ``True``) are an error when fit starts that says to
  install it or pass ``cpu_stats=False`` (Lightning raises the same ``ModuleNotFoundError``, for
  ``cpu_stats=True`` only at the first log step);
- Apple GPUs: ``M1_vm_percent``, ``M1_percent``, ``M1_swap_percent`` from ``psutil`` (Lightning's keys).

A Trainer without loggers is refused. Between log steps the hooks compare two integers.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.console import MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


def psutil_available() -> bool:
    return importlib.util.find_spec("psutil") is not None


def cpu_stats(prefix: str = "cpu") -> dict[str, float]:
    """The system's CPU, memory and swap use in percent (``psutil``)."""
    import psutil

    return {f"{prefix}_vm_percent": psutil.virtual_memory().percent, f"{prefix}_percent": psutil.cpu_percent(),
            f"{prefix}_swap_percent": psutil.swap_memory().percent}


def device_stats(device: torch.device) -> dict[str, Any]:
    """What Lightning's accelerator reports for ``device``."""
    if device.type == "cuda":
        return dict(torch.cuda.memory_stats(device))
    if device.type == "mps":
        return cpu_stats("M1")
    return cpu_stats()


class DeviceStatsMonitor(Callback):
    """Log the device's statistics at log steps (Lightning's arguments).

    Args:
        cpu_stats: None (default): CPU statistics when training on the CPU; True: also on a GPU;
            False: never (on the CPU nothing is logged).
        filter_keys: log only these statistics (names before the prefix, e.g. ``"cpu_percent"``,
            ``"allocated_bytes.all.current"``); a name the device does not report is warned about.
    """

    def __init__(self, cpu_stats: bool | None = None, filter_keys: set[str] | None = None) -> None:
        if cpu_stats not in (None, True, False):
            raise MisconfigurationException(f"DeviceStatsMonitor(cpu_stats={cpu_stats!r}): use None, True or False.")
        self._cpu_stats = cpu_stats
        self._filter_keys = filter_keys
        self._batches = 0  # training batches this fit: the log-step clock (Lightning's batches that stepped)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `DeviceStatsMonitor` callback with `Trainer(logger=False)`: it writes to the "
                "loggers. Use Trainer(logger=True) or pass a logger, or remove the callback.")
        device = trainer.strategy.device
        wants_cpu = (self._cpu_stats is None and device.type in ("cpu", "mps")) or self._cpu_stats is True
        if wants_cpu and not psutil_available():
            raise ModuleNotFoundError(
                "`DeviceStatsMonitor` cannot log CPU stats as `psutil` is not installed (Cadence does not depend on "
                "it). Install it (pip install psutil), or pass DeviceStatsMonitor(cpu_stats=False)"
                + (" (on the CPU that logs nothing)." if device.type == "cpu" else "."))
        if stage == "fit":
            self._batches = 0
        if self._filter_keys is not None:
            unknown = set(self._filter_keys) - set(self._stats(device) or {})
            if unknown and trainer.is_global_zero:
                warn(f"`DeviceStatsMonitor` filter_keys contains keys not found in device stats and will be ignored: "
                     f"{sorted(unknown)}")

    def _stats(self, device: torch.device) -> dict[str, Any] | None:
        if self._cpu_stats is False and device.type == "cpu":
            return None
        stats = device_stats(device)
        if self._cpu_stats and device.type != "cpu":
            stats.update(cpu_stats())
        if self._filter_keys is not None:
            stats = {key: value for key, value in stats.items() if key in self._filter_keys}
        return stats

    def _log(self, trainer: Trainer, hook: str) -> None:
        if (self._batches + 1) % trainer.log_every_n_steps != 0 and not trainer.should_stop:
            return
        stats = self._stats(trainer.strategy.device)
        if not stats:
            return
        for logger in trainer.loggers:
            prefix = f"{type(self).__qualname__}.{hook}{logger.group_separator}"
            logger.log_metrics({prefix + key: value for key, value in stats.items()}, step=self._batches)

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_start")

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_end")
        self._batches += 1

    def on_validation_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._log(trainer, "on_validation_batch_start")

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._log(trainer, "on_validation_batch_end")

    def on_test_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._log(trainer, "on_test_batch_start")

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._log(trainer, "on_test_batch_end")
