"""What else happens around the loop: progress, logging, checkpoints, early stopping, ...

``default_callbacks`` adds the ones the Trainer's flags ask for (``enable_progress_bar``,
``logger``, ``enable_checkpointing``) to the user's, which keep their order;
``observability_callbacks`` those of ``profiler`` and ``report``.
"""

from __future__ import annotations

import _cadence_shadowing

_cadence_shadowing.check_packages()  # first: a user's trainer.py or strategies.py is named, not misread

from collections.abc import Iterable
from typing import Any

from callbacks.amp import AMP
from callbacks.base import Callback
from callbacks.checkpointing import GradientCheckpointing
from callbacks.compile import Compile
from callbacks.csv_logger import CSVLogger
from callbacks.early_stopping import EarlyStopping
from callbacks.async_logger import AsyncLogger
from callbacks.logging import Logger
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.model_summary import ModelSummary
from callbacks.performance import PerformanceReport
from callbacks.profiler import Profiler
from callbacks.progress import ProgressBar
from callbacks.sync_batchnorm import SyncBatchNorm
from callbacks.tensorboard_logger import TensorBoardLogger, tensorboard_available
from callbacks.timer import Timer
from callbacks.torch_flags import TorchFlags

__all__ = [
    "AMP", "AsyncLogger", "CSVLogger", "Callback", "Compile", "EarlyStopping", "GradientCheckpointing",
    "LearningRateMonitor", "Logger", "ModelCheckpoint", "ModelSummary", "PerformanceReport", "Profiler", "ProgressBar",
    "SyncBatchNorm", "TensorBoardLogger", "Timer", "TorchFlags", "default_callbacks", "observability_callbacks",
    "with_module_callbacks",
]


def default_callbacks(callbacks: Any, *, enable_progress_bar: bool, enable_checkpointing: bool, logger: Any) -> list[Callback]:
    """The user's callbacks, in order, plus the defaults the Trainer's flags ask for. As in Lightning,
    ``ModelCheckpoint``s move behind the user's other callbacks, so that a checkpoint holds the state
    they reached at the same moment (EarlyStopping's count after this epoch's check, say)."""
    if callbacks is None:
        callbacks = []
    elif isinstance(callbacks, Callback):
        callbacks = [callbacks]
    callbacks = list(callbacks)
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise ValueError(
                f"Trainer(callbacks=[...]) item {index} is {type(callback).__name__}, not a "
                "callbacks.Callback. Subclass Callback and pass an instance."
            )
    callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + [
        c for c in callbacks if isinstance(c, ModelCheckpoint)]
    if logger is True:
        callbacks += default_loggers()
    elif isinstance(logger, Callback):
        callbacks.append(logger)
    elif isinstance(logger, Iterable) and not isinstance(logger, (str, bytes)):  # any iterable, as in Lightning
        callbacks += list(default_callbacks(list(logger), enable_progress_bar=False, enable_checkpointing=False, logger=False))
    elif logger not in (False, None):
        raise ValueError(f"Trainer(logger={logger!r}) is a {type(logger).__name__}: use True, False, a logger "
                         "callback or an iterable of them (a list, a tuple, Hydra's ListConfig).")
    if enable_progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(ProgressBar())
    if enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(ModelCheckpoint())
    _check_state_keys(callbacks)
    return callbacks


def with_module_callbacks(callbacks: list[Callback], module_callbacks: Any, module_name: str) -> list[Callback]:
    """``callbacks`` with those the module's ``configure_callbacks`` returned, as Lightning merges them:
    a module callback replaces the Trainer's of the same class (or a base class of it), and every
    ``ModelCheckpoint`` moves to the end, so it saves after the other callbacks updated their state."""
    if module_callbacks is None:
        return callbacks
    extra = [module_callbacks] if isinstance(module_callbacks, Callback) else list(module_callbacks)
    for index, callback in enumerate(extra):
        if not isinstance(callback, Callback):
            raise ValueError(f"{module_name}.configure_callbacks() returned {type(callback).__name__} (item {index}), "
                             "not a callbacks.Callback. Return a Callback or a list of them.")
    if not extra:
        return callbacks
    replaced = {type(c) for c in callbacks if type(c) is not Callback and any(isinstance(e, type(c)) for e in extra)}
    merged = [c for c in callbacks if type(c) not in replaced] + extra
    merged = [c for c in merged if not isinstance(c, ModelCheckpoint)] + [c for c in merged if isinstance(c, ModelCheckpoint)]
    _check_state_keys(merged)
    return merged


def _check_state_keys(callbacks: list[Callback]) -> None:
    keys = [callback.state_key for callback in callbacks]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(
            f"Two callbacks share the checkpoint key {duplicates}; give one a different state_key "
            "(or different monitor/mode for ModelCheckpoint)."
        )


def default_loggers() -> list[Callback]:
    """``logger=True``: a TensorBoardLogger when tensorboard is installed (first, so that
    ``module.logger.experiment`` is its SummaryWriter, as in Lightning), and a CSVLogger."""
    return [TensorBoardLogger(), CSVLogger()] if tensorboard_available() else [CSVLogger()]


PROFILERS = (None, "simple", "pytorch")


def observability_callbacks(callbacks: list[Callback], *, profiler: Any, report: Any) -> list[Callback]:
    """``callbacks`` plus what ``Trainer(profiler=..., report=...)`` asks for.

    ``profiler``: None; ``"simple"``, the end-of-fit PerformanceReport (Lightning's SimpleProfiler
    times every hook; the report times the phases of the loop, which costs nothing per hook);
    ``"pytorch"``, a ``Profiler()`` with its defaults; or a ``Profiler``. ``report``: add the
    PerformanceReport (on by default).
    """
    if not isinstance(report, bool):
        raise ValueError(f"Trainer(report={report!r}): use True (print where the time went after fit) or False.")
    if not (profiler in PROFILERS or isinstance(profiler, Profiler)):
        raise ValueError(
            f"Trainer(profiler={profiler!r}): use None, \"simple\" (the performance report), \"pytorch\" "
            "(callbacks.Profiler with its defaults) or a callbacks.Profiler. For Python-level profiles, run "
            "python -m cProfile -o fit.prof your_script.py."
        )
    if profiler == "simple" and not report:
        raise ValueError('Trainer(profiler="simple", report=False): "simple" is the performance report that '
                         "report=False turns off. Pass one of them.")
    added: list[Callback] = []
    if (report or profiler == "simple") and not any(isinstance(c, PerformanceReport) for c in callbacks):
        added.append(PerformanceReport())
    if profiler == "pytorch" or isinstance(profiler, Profiler):
        if any(isinstance(c, Profiler) for c in callbacks):
            raise ValueError(f"Trainer(profiler={profiler!r}) and a Profiler in callbacks: pass one of them.")
        added.append(Profiler() if profiler == "pytorch" else profiler)
    return callbacks + added
