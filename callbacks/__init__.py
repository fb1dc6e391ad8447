"""What else happens around the loop: progress, logging, checkpoints, early stopping, ...

``default_callbacks`` adds the ones the Trainer's flags ask for (``enable_progress_bar``,
``logger``, ``enable_checkpointing``) to the user's, which keep their order.
"""

from __future__ import annotations

import cadence_shadowing

cadence_shadowing.check_packages()  # first: a user's trainer.py or strategies.py is named, not misread

from typing import Any

from callbacks.amp import AMP
from callbacks.base import Callback
from callbacks.checkpointing import GradientCheckpointing
from callbacks.compile import Compile
from callbacks.early_stopping import EarlyStopping
from callbacks.logging import AsyncLogger, CSVLogger, TensorBoardLogger, default_loggers
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.model_summary import ModelSummary
from callbacks.progress import ProgressBar
from callbacks.sync_batchnorm import SyncBatchNorm
from callbacks.timer import Timer
from callbacks.torch_flags import TorchFlags

__all__ = [
    "AMP", "AsyncLogger", "CSVLogger", "Callback", "Compile", "EarlyStopping", "GradientCheckpointing",
    "ModelCheckpoint", "ModelSummary", "ProgressBar", "SyncBatchNorm", "TensorBoardLogger", "Timer", "TorchFlags",
    "default_callbacks", "with_module_callbacks",
]


def default_callbacks(callbacks: Any, *, enable_progress_bar: bool, enable_checkpointing: bool, logger: Any) -> list[Callback]:
    """The user's callbacks, in order, plus the defaults the Trainer's flags ask for."""
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
    if logger is True:
        callbacks += default_loggers()
    elif isinstance(logger, Callback):
        callbacks.append(logger)
    elif isinstance(logger, (list, tuple)):
        callbacks += list(default_callbacks(list(logger), enable_progress_bar=False, enable_checkpointing=False, logger=False))
    elif logger not in (False, None):
        raise ValueError(f"Trainer(logger={logger!r}): use True, False, a logger callback or a list of them.")
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
