"""What else happens around the loop: progress, logging, checkpoints, early stopping, ...

``default_callbacks`` adds the ones the Trainer's flags ask for (``enable_progress_bar``,
``logger``, ``enable_checkpointing``) to the user's, which keep their order;
``observability_callbacks`` those of ``profiler`` and ``report``.
"""

from __future__ import annotations

import _cadence_shadowing

_cadence_shadowing.check_packages()  # first: a user's trainer.py or strategies.py is named, not misread

import contextlib
import types
import typing
from collections.abc import Iterable
from typing import Any

from callbacks.console import MisconfigurationException
from callbacks.amp import AMP
from callbacks.base import Callback, Checkpoint
from callbacks.batch_size_finder import BatchSizeFinder
from callbacks.checkpointing import GradientCheckpointing
from callbacks.compile import Compile
from callbacks.csv_logger import CSVLogger
from callbacks.device_stats_monitor import DeviceStatsMonitor
from callbacks.early_stopping import EarlyStopping
from callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from callbacks.async_logger import AsyncLogger
from callbacks.logging import DummyExperiment, DummyLogger, Logger, LoggerAdapter, as_logger
from callbacks.lr_finder import LearningRateFinder, LRFinder
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.microbatch import AutoMicrobatch
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.model_summary import ModelSummary, RichModelSummary
from callbacks.performance import PerformanceReport
from callbacks.profiler import Profiler
from callbacks.profilers import AdvancedProfiler, PassThroughProfiler, ProfiledHooks, SimpleProfiler
from callbacks.profilers import Profiler as LightningProfiler
from callbacks.pytorch_profiler import PyTorchProfiler
from callbacks.gradient_accumulation import GradientAccumulationScheduler
from callbacks.lambda_callback import LambdaCallback
from callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from callbacks.prediction_writer import BasePredictionWriter
from callbacks.pruning import ModelPruning
# Lightning's names Cadence refuses (making one says what to use instead): importable, not offered in __all__.
from callbacks.refused import (  # noqa: F401
    CometLogger, LitLogger, MLFlowLogger, NeptuneLogger,  # noqa: F401
    SpikeDetection, WandbLogger,  # noqa: F401
    ServableModule, ServableModuleValidator, XLAProfiler,  # noqa: F401
)
from callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar, get_standard_metrics
from callbacks.stochastic_weight_avg import StochasticWeightAveraging
from callbacks.sync_batchnorm import SyncBatchNorm
from callbacks.tensorboard_logger import TensorBoardLogger, tensorboard_available
from callbacks.throughput_monitor import Throughput, ThroughputMonitor
from callbacks.timer import Timer
from callbacks.true_precision import TruePrecision
from callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging
from callbacks.torch_flags import TorchFlags

__all__ = [
    "AMP", "AdvancedProfiler", "AsyncLogger", "AutoMicrobatch", "BackboneFinetuning", "BaseFinetuning", "BasePredictionWriter",
    "BatchSizeFinder", "CSVLogger", "Callback", "Checkpoint", "Compile", "DeviceStatsMonitor", "DummyExperiment", "DummyLogger", "EarlyStopping",
    "GradientAccumulationScheduler",
    "GradientCheckpointing", "LRFinder", "LambdaCallback", "LearningRateFinder", "LearningRateMonitor", "Logger", "LoggerAdapter",
    "ModelCheckpoint", "ModelPruning", "ModelSummary", "OnExceptionCheckpoint", "PassThroughProfiler", "PerformanceReport",
    "ProfiledHooks", "Profiler", "ProgressBar", "PyTorchProfiler", "RichModelSummary", "RichProgressBar", "SimpleProfiler", "TQDMProgressBar", "get_standard_metrics", "profiler_of",
    "StochasticWeightAveraging", "SyncBatchNorm", "TensorBoardLogger", "Throughput", "ThroughputMonitor", "Timer", "TorchFlags", "TruePrecision", "WeightAveraging", "EMAWeightAveraging", "default_callbacks", "observability_callbacks",
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
            raise MisconfigurationException(
                f"Trainer(callbacks=[...]) item {index} is {type(callback).__name__}, not a "
                "callbacks.Callback. Subclass Callback and pass an instance."
            )
    if not enable_checkpointing and any(isinstance(c, Checkpoint) for c in callbacks):  # Lightning's words first
        raise MisconfigurationException(
            f"Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` in "
            f"callbacks list ({next(type(c).__name__ for c in callbacks if isinstance(c, Checkpoint))}). "
            "Drop enable_checkpointing=False (a ModelCheckpoint given replaces the default one), or it.")
    callbacks = [c for c in callbacks if not isinstance(c, Checkpoint)] + [  # checkpoints last, as in Lightning
        c for c in callbacks if isinstance(c, Checkpoint)]
    if logger is True:
        callbacks += default_loggers()
    elif isinstance(logger, Callback):
        callbacks.append(logger)
    elif isinstance(logger, Iterable) and not isinstance(logger, (str, bytes)):  # any iterable, as in Lightning
        callbacks += list(default_callbacks([as_logger(item) for item in logger], enable_progress_bar=False,
                                            enable_checkpointing=False, logger=False))
    elif isinstance(as_logger(logger), LoggerAdapter):  # Lightning's logger interface (a Mock too): called as there
        callbacks.append(as_logger(logger))
    elif logger not in (False, None):
        raise MisconfigurationException(
            f"Trainer(logger={logger!r}) is a {type(logger).__name__}: use True, False, a logger "
            "callback, an object with Lightning's logger methods (log_metrics...) or an iterable of "
            "them (a list, a tuple, Hydra's ListConfig).")
    bars = [c for c in callbacks if isinstance(c, ProgressBar)]
    if len(bars) > 1:
        raise MisconfigurationException(
            f"You added multiple progress bar callbacks to the Trainer: Trainer(callbacks=[...]) holds "
            f"{len(bars)} progress bars "
            f"({', '.join(type(bar).__name__ for bar in bars)}); only one is supported: pass one.")
    if bars and enable_progress_bar is False:
        name = "TQDMProgressBar" if type(bars[0]) is ProgressBar else type(bars[0]).__name__  # Lightning's wording
        raise MisconfigurationException(
            f"Trainer was configured with `enable_progress_bar=False` but found `{name}` in the callbacks "
            "list: remove one of them (ProgressBar(refresh_rate=0) keeps the bar object and draws nothing).")
    if enable_progress_bar and not bars:
        callbacks.append(ProgressBar())
    if enable_checkpointing and not any(isinstance(c, Checkpoint) for c in callbacks):
        callbacks.append(ModelCheckpoint())
    _check_state_keys(callbacks)
    return callbacks


def with_module_callbacks(callbacks: list[Callback], module_callbacks: Any, module_name: str) -> list[Callback]:
    """``callbacks`` with those the module's ``configure_callbacks`` returned, as Lightning merges them:
    a module callback replaces the Trainer's of the same class (or a base class of it), and every
    ``Checkpoint`` (``ModelCheckpoint``) moves to the end, so it saves after the other callbacks updated their state."""
    if module_callbacks is None:
        return callbacks
    extra = [module_callbacks] if isinstance(module_callbacks, Callback) else list(module_callbacks)
    for index, callback in enumerate(extra):
        if not isinstance(callback, Callback):
            raise MisconfigurationException(
                f"{module_name}.configure_callbacks() returned {type(callback).__name__} (item {index}), "
                "not a callbacks.Callback. Return a Callback or a list of them.")
    if not extra:
        return callbacks
    replaced = {type(c) for c in callbacks if type(c) is not Callback and any(isinstance(e, type(c)) for e in extra)}
    merged = [c for c in callbacks if type(c) not in replaced] + extra
    merged = [c for c in merged if not isinstance(c, Checkpoint)] + [c for c in merged if isinstance(c, Checkpoint)]
    _check_state_keys(merged)
    return merged


def _check_state_keys(callbacks: list[Callback]) -> None:
    """As Lightning's callback connector: two callbacks with state (their class defines state_dict) may not
    share a checkpoint key, or one's state would be lost. Callbacks without state (two loggers of one class,
    say) may: two file loggers of one class left to the run's version each get one of their own, as in
    Lightning, and two given the same directory are refused when the run starts (trainer/log_dir.py)."""
    stateful = [callback for callback in callbacks if getattr(type(callback), "state_dict", Callback.state_dict) is not Callback.state_dict]
    keys = [callback.state_key for callback in stateful]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        kind = next(type(callback).__name__ for callback in stateful if callback.state_key == duplicates[0])
        raise RuntimeError(
            f"Found more than one stateful callback of type `{kind}`: two callbacks share the checkpoint key "
            f"{duplicates}, so one's state would be lost. Give one a different state_key (or different "
            "monitor/mode for ModelCheckpoint)."
        )


def default_loggers() -> list[Callback]:
    """``logger=True``: a TensorBoardLogger when tensorboard is installed (first, so that
    ``module.logger.experiment`` is its SummaryWriter, as in Lightning), and a CSVLogger."""
    if not tensorboard_available():
        return [CSVLogger()]
    beside = CSVLogger()
    beside._beside_tensorboard = True  # not Lightning's: get_standard_metrics leaves it out
    return [TensorBoardLogger(), beside]


#: Trainer(profiler=<name>), as in Lightning (the name in any case).
PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}
_PASS_THROUGH = PassThroughProfiler()


def observability_callbacks(callbacks: list[Callback], *, profiler: Any, report: Any) -> list[Callback]:
    """``callbacks`` plus what ``Trainer(profiler=..., report=...)`` asks for.

    ``profiler``: None; ``"simple"``, ``"advanced"``, ``"pytorch"`` (Lightning's profilers with their
    defaults) or one of them (``callbacks.profilers.Profiler``), run by a :class:`ProfiledHooks` put
    first among the callbacks, so that it times the others' hooks; or a ``callbacks.Profiler``
    (Cadence's scheduled torch.profiler traces with a verdict). ``report``: add the
    PerformanceReport (on by default).
    """
    if not isinstance(report, bool):
        raise MisconfigurationException(
            f"Trainer(report={report!r}): use True (print where the time went after fit) or False.")
    if isinstance(profiler, str) and profiler.lower() in PROFILERS:
        profiler = PROFILERS[profiler.lower()]()
    if not (profiler is None or isinstance(profiler, (LightningProfiler, Profiler))):
        lightning = ("When passing string value for the `profiler` parameter of `Trainer`, it can only be one of "
                     f"{sorted(PROFILERS)}. " if isinstance(profiler, str) else "")  # Lightning's words first
        raise MisconfigurationException(
            f"{lightning}Trainer(profiler={profiler!r}): use None, \"simple\" (time per hook), \"advanced\" (cProfile per hook), "
            "\"pytorch\" (torch.profiler), a callbacks.SimpleProfiler/AdvancedProfiler/PyTorchProfiler (or your subclass "
            "of callbacks.profilers.Profiler), or a callbacks.Profiler (scheduled traces with a verdict)."
            + (" Cadence runs on CPUs, CUDA GPUs and Apple GPUs, not XLA." if profiler == "xla" else "")
        )
    added: list[Callback] = []
    if report and not any(isinstance(c, PerformanceReport) for c in callbacks):
        added.append(PerformanceReport())
    if isinstance(profiler, LightningProfiler):
        if any(isinstance(c, ProfiledHooks) for c in callbacks):
            raise MisconfigurationException(
                f"Trainer(profiler={profiler!r}) and a ProfiledHooks in callbacks: pass one of them.")
        return [ProfiledHooks(profiler)] + callbacks + added  # first: it times the other callbacks' hooks
    if isinstance(profiler, Profiler):
        if any(isinstance(c, Profiler) for c in callbacks):
            raise MisconfigurationException(
                f"Trainer(profiler={profiler!r}) and a Profiler in callbacks: pass one of them.")
        added.append(profiler)
    return callbacks + added


def profiler_of(callbacks: list[Callback]) -> LightningProfiler:
    """``trainer.profiler``: the profiler a :class:`ProfiledHooks` runs, else a PassThroughProfiler (as in Lightning)."""
    return next((c.profiler for c in callbacks if isinstance(c, ProfiledHooks)), _PASS_THROUGH)


def _types_for_signatures() -> None:
    """As Lightning's, ``inspect.signature(ModelCheckpoint)`` gives types, not the strings ``from __future__
    import annotations`` leaves: a CLI's parser takes them (jsonargparse's ``add_argument(type=...)``). A class
    whose arguments name a type only type checkers see keeps its strings."""
    for name in __all__:
        init = vars(value).get("__init__") if isinstance(value := globals()[name], type) else None
        if isinstance(init, types.FunctionType):
            with contextlib.suppress(Exception):
                init.__annotations__.update(typing.get_type_hints(init))


_types_for_signatures()
