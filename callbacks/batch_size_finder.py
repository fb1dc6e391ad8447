"""BatchSizeFinder: the largest batch size that fits in memory, found by trying (Lightning's).

At the start of fit (or of validate, test, predict) the finder sets the module's ``batch_size``
(attribute, hparams key, or the DataModule's), makes the loaders again from their hooks
(``Trainer.reload_dataloaders``), and runs ``steps_per_trial`` steps (``Trainer.run_trial``, which
puts weights, optimizer, counters and RNG states back afterwards), doubling the size until a trial
runs out of memory (``"power"``), then, in ``"binsearch"``, bisecting between the last size that
fit and the first that did not. The stage then runs with the size found. ``Tuner(trainer)
.scale_batch_size(model)`` runs the same search without the stage.

The loaders must come from ``train_dataloader()`` (or the stage's hook) of the module or a
DataModule, which read the attribute: loaders passed to ``fit`` cannot be remade. One process
only: under DDP a rank that runs out of memory would leave the others waiting.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from callbacks.search import SearchProgress, free_memory, get_attribute, has_attribute, is_out_of_memory, set_attribute

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Each stage's batch counts, as the Trainer reports them (Lightning's names).
NUM_BATCHES = {"validate": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}


class BatchSizeFinder(Callback):
    """Find the largest batch size that does not run out of memory, and use it.

    Args:
        mode: ``"power"``: double the size until a trial runs out of memory; ``"binsearch"``:
            then bisect between the last size that fit and the first that did not.
        steps_per_trial: the optimizer steps (evaluation: batches) each size is tried for.
        init_val: the size the search starts from.
        max_trials: the most sizes tried.
        batch_arg_name: the attribute (of the module, its hparams, the DataModule or its hparams)
            that the loader hooks read.
        margin: in ``"binsearch"``, take this fraction off the size found, for safety.
        max_val: never try a size above this.

    ``optimal_batch_size`` holds the size found. Override ``on_fit_start`` and call
    ``self.scale_batch_size(trainer, module)`` from another hook to search again later.
    """

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                 batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192) -> None:
        mode = mode.lower() if isinstance(mode, str) else mode
        if mode not in self.SUPPORTED_MODES:
            raise MisconfigurationException(
                f"BatchSizeFinder(mode={mode!r}): `mode` should be either of {self.SUPPORTED_MODES}.")
        if not 0.0 <= margin < 1.0:
            raise MisconfigurationException(f"BatchSizeFinder(margin={margin!r}): `margin` should be between 0 and 1.")
        for name, value, least in (("steps_per_trial", steps_per_trial, 1), ("init_val", init_val, 1),
                                   ("max_trials", max_trials, 0), ("max_val", max_val, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MisconfigurationException(f"BatchSizeFinder({name}={value!r}): use an int >= {least}.")
        self.optimal_batch_size: int | None = init_val
        self._mode, self._steps_per_trial = mode, steps_per_trial
        self._init_val, self._max_trials = init_val, max_trials
        self._batch_arg_name, self._margin, self._max_val = batch_arg_name, margin, max_val

    def setup(self, trainer: Trainer, pl_module: TrainingModule, stage: str | None = None) -> None:
        if trainer.world_size > 1:
            raise MisconfigurationException(
                "Batch size finder is not supported with distributed strategies: a process that ran "
                "out of memory would leave the others waiting. Find the batch size on one device "
                "(Trainer(devices=1)), then pass it to the distributed run.")
        name = self._batch_arg_name
        if hasattr(pl_module, name) and name in getattr(pl_module, "hparams", {}):
            warnings.warn(f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! "
                          f"`model.{name}` will be used as the initial batch size for scaling. If this is not the "
                          "intended behavior, please remove either one.", stacklevel=2)

    def check_attribute(self, pl_module: TrainingModule, datamodule: Any = None) -> None:
        """Raise if neither the module nor the DataModule (nor their hparams) holds ``batch_arg_name``."""
        name = self._batch_arg_name
        if not has_attribute(pl_module, name, datamodule):
            raise MisconfigurationException(
                f"Field {name} not found in `model`, `datamodule`, nor their `hparams` attributes. "
                f"The batch size finder sets it and makes the loaders again: read it in the "
                f"*_dataloader hooks (DataLoader(..., batch_size=self.{name})).")

    def on_fit_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        if trainer.sanity_checking or trainer.stage != "validate":  # fit's validation uses fit's size
            return
        self.scale_batch_size(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_predict_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        """Search now (from a hook of a running stage); see the class docstring."""
        if trainer.fast_dev_run:
            warnings.warn("Skipping batch size scaler since `fast_dev_run` is enabled.", stacklevel=2)
            self.optimal_batch_size = None
            return
        if trainer.stage == "fit":  # the train loader's hook reads it; evaluation checks its loaders first (Lightning)
            self.check_attribute(pl_module)
        try:
            loaders = trainer.reload_dataloaders()
        except ValueError as error:
            raise MisconfigurationException(
                f"Batch size finder cannot be used with dataloaders passed directly to "
                f"Trainer.{trainer.stage}(): it sets {self._batch_arg_name} and makes the loaders again "
                f"from their hooks. Return the loaders from the module's or a DataModule's hooks "
                f"(train_dataloader(), ...), reading {self._batch_arg_name}.") from error
        if len(loaders) > 1:
            prefix = {"fit": "train", "validate": "val"}.get(trainer.stage, trainer.stage)  # Lightning's word
            raise MisconfigurationException(
                f"Batch size finder cannot be used with multiple {prefix} dataloaders "
                f"({len(loaders)}); it tunes one loader's batch size.")
        self.check_attribute(pl_module)
        search = _Search(trainer, pl_module, self._batch_arg_name, self._steps_per_trial, self._max_val, loaders,
                         SearchProgress(trainer, "Finding the largest batch size", self._max_trials))
        try:
            size, _ = search.adjust(value=self._init_val)
            if self._mode == "power":
                size = search.power(size, self._max_trials)
            else:
                size = search.binsearch(size, self._max_trials, self._margin)
            search.progress.say(f"Finished batch size finder, will continue with full run using batch size {size}")
        finally:
            search.progress.close()
            trainer.reload_dataloaders()  # the stage goes on with the size found (or where a failure left it)
        self.optimal_batch_size = size


class _Search:
    """One batch-size search: trials and adjustments, as Lightning's ``_run_power_scaling`` and
    ``_run_binsearch_scaling`` make them (the same sizes in the same order)."""

    def __init__(self, trainer: Trainer, module: TrainingModule, name: str, steps_per_trial: int, max_val: int,
                 loaders: list[Any], progress: SearchProgress) -> None:
        self.trainer, self.module, self.name = trainer, module, name
        self.steps_per_trial, self.max_val, self.progress = steps_per_trial, max_val, progress
        self.loaders = loaders  # the stage's loaders as last made

    def trial(self) -> bool:
        """Run the current size; False if it ran out of memory (any other error propagates)."""
        self.loaders = self.trainer.reload_dataloaders()
        out_of_memory = False
        try:
            self.trainer.run_trial(self.steps_per_trial)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        if out_of_memory:  # outside the except block: the error's frames (and their tensors) are gone
            free_memory()
        self.progress.update(batch_size=get_attribute(self.module, self.name))
        return not out_of_memory

    def adjust(self, factor: float = 1.0, value: int | None = None, desc: str | None = None) -> tuple[int, bool]:
        """Set the size to ``value`` or ``factor`` times the current one (not past the dataset's
        length or ``max_val``); return it and whether it changed."""
        size = get_attribute(self.module, self.name)
        length = self._dataset_length()
        if length is not None and size >= length:
            self.progress.say(f"The batch size {size} is greater or equal than the length of your dataset: {length}.")
            return size, False
        new_size = value if value is not None else int(size * factor)
        if new_size > self.max_val:  # max_val itself is then tried (Lightning stops before it, untried)
            if desc:
                self.progress.say(f"Batch size {new_size} exceeds max_val limit {self.max_val}, "
                                  f"capping at {self.max_val}")
            new_size = self.max_val
        if new_size == size == self.max_val:
            self.progress.say(f"Reached the maximum batch size limit of {self.max_val}. Stopping search.")
        elif desc:
            self.progress.say(f"Batch size {size} {desc}, trying batch size {new_size}")
        set_attribute(self.module, self.name, new_size)
        return new_size, new_size != size

    def _dataset_length(self) -> int | None:
        try:
            return len(self.loaders[0].dataset)
        except (AttributeError, TypeError):  # no dataset, or an IterableDataset without a length
            return None

    def power(self, size: int, max_trials: int) -> int:
        any_success = False
        for trial in range(max_trials):
            if self.trial():
                if trial + 1 >= max_trials:
                    break
                size, changed = self.adjust(factor=2.0, desc="succeeded")
                if not changed:
                    break
                any_success = True
            else:
                size, _ = self.adjust(factor=0.5, desc="failed")
                if any_success:
                    break
        return size

    def binsearch(self, size: int, max_trials: int, margin: float) -> int:
        low, high, count = 1, None, 0
        while True:
            if self.trial():
                count += 1
                if count >= max_trials:
                    break
                low = size
                if high:
                    if high - low <= 1:
                        break
                    size, changed = self.adjust(value=(high + low) // 2, desc="succeeded")
                else:
                    size, changed = self.adjust(factor=2.0, desc="succeeded")
                if not changed:
                    break
            else:
                high = size
                size, _ = self.adjust(value=(high + low) // 2, desc="failed")
                if high - low <= 1:
                    break
        if margin > 0:
            reduced = max(1, int(size * (1 - margin)))
            if reduced != size:
                self.progress.say(f"Applying margin of {margin:.1%}, reducing batch size from {size} to {reduced}")
                size = reduced
                set_attribute(self.module, self.name, size)
        return size
