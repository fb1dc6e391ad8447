"""What else happens around the loop: progress, logging, checkpoints, early stopping, ...

``default_callbacks`` adds the ones the Trainer's flags ask for (``enable_progress_bar``,
``logger``, ``enable_checkpointing``) to the user's, which keep their order.
"""

from __future__ import annotations

from typing import Any

from callbacks.amp import AMP
from callbacks.base import Callback
from callbacks.checkpointing import GradientCheckpointing
from callbacks.compile import Compile
from callbacks.early_stopping import EarlyStopping
from callbacks.logging import AsyncLogger, CSVLogger, TensorBoardLogger, default_loggers
from callbacks.model_checkpoint import ModelCheckpoint
from callbacks.progress import ProgressBar

__all__ = [
    "AMP", "AsyncLogger", "CSVLogger", "Callback", "Compile", "EarlyStopping", "GradientCheckpointing",
    "ModelCheckpoint", "ProgressBar", "TensorBoardLogger", "default_callbacks",
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
    keys = [callback.state_key for callback in callbacks]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(
            f"Two callbacks share the checkpoint key {duplicates}; give one a different state_key "
            "(or different monitor/mode for ModelCheckpoint)."
        )
    return callbacks
