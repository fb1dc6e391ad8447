"""The Trainer's read-only properties with Lightning's names, each looked up where it lives: the
process's place in the run from the strategy, the callbacks that play a named role (the progress
bar, the loggers, the checkpoint callback) from ``trainer.callbacks``, in the order given.

``Trainer`` binds each function as a property (``loggers = property(properties.loggers)``), so
they are recomputed on every read: a callback added to ``trainer.callbacks`` is found at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import callbacks as callbacks_package

if TYPE_CHECKING:
    from callbacks import Callback
    from trainer.trainer import Trainer


def is_global_zero(trainer: Trainer) -> bool:
    """True in the process of global rank zero (the only one with one process)."""
    return trainer.strategy.is_global_zero


def global_rank(trainer: Trainer) -> int:
    """This process's rank among all processes of the run."""
    return trainer.strategy.global_rank


def world_size(trainer: Trainer) -> int:
    """How many processes run the loop."""
    return trainer.strategy.world_size


def progress_bar_callback(trainer: Trainer) -> Callback | None:
    """The first ``ProgressBar`` among the callbacks (Lightning's name), or None."""
    return next((c for c in trainer.callbacks if isinstance(c, callbacks_package.ProgressBar)), None)


def loggers(trainer: Trainer) -> list[Callback]:
    """The loggers among the callbacks (``callbacks.Logger``), in order (Lightning's name)."""
    return [callback for callback in trainer.callbacks if isinstance(callback, callbacks_package.Logger)]


def logger(trainer: Trainer) -> Callback | None:
    """The first logger, or None (Lightning's name)."""
    return next(iter(loggers(trainer)), None)


def checkpoint_callback(trainer: Trainer) -> Callback | None:
    """The first ``ModelCheckpoint`` among the callbacks (Lightning's name), or None."""
    return next((c for c in trainer.callbacks if isinstance(c, callbacks_package.ModelCheckpoint)), None)
