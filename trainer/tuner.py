"""Tuner: find a learning rate or a batch size before training (Lightning's ``Tuner``).

``Tuner(trainer).lr_find(model, ...)`` and ``.scale_batch_size(model, ...)`` set the model up as
``trainer.fit`` (or validate, test, predict) would, run the search of ``callbacks.LearningRateFinder``
or ``callbacks.BatchSizeFinder`` in place of the training, and tear down (``Trainer.run_search``):
the Trainer's callbacks see only ``setup`` and ``teardown``, nothing is logged or checkpointed, and
the model, the Trainer's counters and every RNG are left as they were, except for the
hyperparameter found. A ``trainer.fit(model)`` afterwards trains exactly as a fresh Trainer's would
with that value.

Example::

    trainer = Trainer(max_epochs=10)
    lr_finder = Tuner(trainer).lr_find(model)        # model.lr is now the suggestion
    print(lr_finder.suggestion(), lr_finder.results["lr"][:3])
    lr_finder.plot(suggest=True)                     # a figure with matplotlib; the numbers without
    trainer.fit(model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from callbacks import BatchSizeFinder, LearningRateFinder, LRFinder
from callbacks.lr_finder import lr_attribute
from callbacks.search import set_attribute
from trainer.datamodule import DataModule
from trainer.seed import capture_rng_state, restore_rng_state
from trainer.trial import kept_trainable

if TYPE_CHECKING:
    from trainer.module import TrainingModule
    from trainer.trainer import Trainer

METHODS = ("fit", "validate", "test", "predict")


class Tuner:
    """Tunes ``trainer``'s run: :meth:`lr_find` and :meth:`scale_batch_size`."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def scale_batch_size(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
                         dataloaders: Any = None, datamodule: DataModule | None = None, method: str = "fit",
                         mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                         batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192) -> int | None:
        """The largest batch size that does not run out of memory, written to ``batch_arg_name``
        of the model (or its hparams, or the DataModule's); see ``callbacks.BatchSizeFinder`` for
        the arguments. ``method`` is the stage whose steps are tried; its loaders must come from
        the hooks of the model or ``datamodule``, which read the attribute."""
        _check_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        if self._trainer.world_size > 1:
            raise MisconfigurationException(
                "Tuning the batch size is currently not supported with distributed strategies: find it "
                "with one device (Trainer(devices=1)), then pass it to the distributed run.")
        if any(isinstance(callback, BatchSizeFinder) for callback in self._trainer.callbacks):
            raise MisconfigurationException(
                "Trainer is already configured with a `BatchSizeFinder` callback. Please remove it if you "
                "want to use the Tuner.")
        finder = BatchSizeFinder(mode=mode, steps_per_trial=steps_per_trial, init_val=init_val, max_trials=max_trials,
                                 batch_arg_name=batch_arg_name, margin=margin, max_val=max_val)
        if method == "fit":  # before the train loader's hook reads it; evaluation checks its loaders first (Lightning)
            finder.check_attribute(model, datamodule if datamodule is not None else _datamodule_in(train_dataloaders))
        with kept_trainable(model), _kept_rng():
            size = self._trainer.run_search(_BatchSizeSearch(finder), model, method, train_dataloaders,
                                            val_dataloaders, dataloaders, datamodule)
        if size is not None:  # in the caller too, when the search ran in other processes
            set_attribute(model, batch_arg_name, size, datamodule or _datamodule_in(train_dataloaders))
        return size

    def lr_find(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
                dataloaders: Any = None, datamodule: DataModule | None = None, method: str = "fit",
                min_lr: float = 1e-8, max_lr: float = 1, num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                attr_name: str = "") -> LRFinder | None:
        """Try ``num_training`` learning rates from ``min_lr`` to ``max_lr`` and return the
        :class:`~callbacks.lr_finder.LRFinder` (``results``, ``suggestion()``, ``plot()``); with
        ``update_attr``, the suggestion becomes the model's ``lr``/``learning_rate`` (or
        ``attr_name``). See ``callbacks.LearningRateFinder`` for the arguments."""
        if method != "fit":
            raise MisconfigurationException(
                f"Tuner.lr_find(method={method!r}): method='fit' is the only valid configuration to run "
                "lr finder.")
        _check_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        if any(isinstance(callback, LearningRateFinder) for callback in self._trainer.callbacks):
            raise MisconfigurationException(
                "Trainer is already configured with a `LearningRateFinder` callback. Please remove it if "
                "you want to use the Tuner.")
        if update_attr:
            lr_attribute(model, attr_name)  # fails now, before anything is set up, if there is none
        finder = LearningRateFinder(min_lr=min_lr, max_lr=max_lr, num_training_steps=num_training, mode=mode,
                                    early_stop_threshold=early_stop_threshold, update_attr=update_attr,
                                    attr_name=attr_name)
        with kept_trainable(model), _kept_rng():  # a fine-tuning callback's setup froze some for the search
            result = self._trainer.run_search(_LRSearch(finder), model, "fit", train_dataloaders, val_dataloaders,
                                              dataloaders, datamodule)
        if result is not None and update_attr and (lr := result.suggestion()) is not None:
            set_attribute(model, lr_attribute(model, attr_name), lr)  # in the caller too, after a spawned search
        return result


class _LRSearch:
    """What ``run_search`` runs for :meth:`Tuner.lr_find` (a class, so that spawned processes get it)."""

    def __init__(self, finder: LearningRateFinder) -> None:
        self.finder = finder

    def __call__(self, trainer: Trainer, module: TrainingModule) -> LRFinder | None:
        self.finder.lr_find(trainer, module)
        return self.finder.optimal_lr


class _BatchSizeSearch:
    """What ``run_search`` runs for :meth:`Tuner.scale_batch_size`."""

    def __init__(self, finder: BatchSizeFinder) -> None:
        self.finder = finder

    def __call__(self, trainer: Trainer, module: TrainingModule) -> int | None:
        self.finder.setup(trainer, module, trainer.stage)
        self.finder.scale_batch_size(trainer, module)
        return self.finder.optimal_batch_size


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """Every global RNG as it was: the search's setup draws from them (loaders, a dataset made in a hook),
    so that two searches in a row, or a search and then fit, see the same numbers as the first would."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


def _datamodule_in(loaders: Any) -> DataModule | None:
    """fit(model, dm) passes the DataModule where the loaders go, as Lightning allows."""
    return loaders if isinstance(loaders, DataModule) else None


def _check_configuration(train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, method: str) -> None:
    if method not in METHODS:
        raise MisconfigurationException(f"method {method!r} is invalid. Should be one of {METHODS}.")
    if method == "fit" and dataloaders is not None:
        raise MisconfigurationException(
            "In tuner with method='fit', `dataloaders` argument should be None, please consider setting "
            "`train_dataloaders` and `val_dataloaders` instead.")
    if method != "fit" and (train_dataloaders is not None or val_dataloaders is not None):
        raise MisconfigurationException(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders` arguments "
            "should be None, please consider setting `dataloaders` instead.")
