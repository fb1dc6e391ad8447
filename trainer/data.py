"""DataLoader helpers: where a stage's loader comes from, how it is prepared for the strategy, how
many batches it has, ``limit_*_batches``, and rebuilding a loader.

The loop never fetches a batch to learn something about a loader; these read its attributes.
"""

from __future__ import annotations

import math
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

# These live with the strategies, which rebuild loaders to shard them.
from strategies.loaders import rebuild_dataloader, with_worker_init_fn
from trainer.combined_loader import CombinedLoader
from trainer.preemption import workers_ignore_preemption
from trainer.seed import seed_worker_of_rank, seeded_generator, workers_seeded
from callbacks.console import MisconfigurationException, PossibleUserWarning
from callbacks.console import warn as warn_at_users_line


def loader_length(loader: Any) -> int | None:
    """The number of batches of ``loader``, or None when it cannot tell (an IterableDataset)."""
    if isinstance(loader, CombinedLoader):  # its len() needs iter() first, as in Lightning
        length = loader.length()
        return None if length == math.inf else length
    try:  # an IterableDataset may define no __len__; a wrapper's may raise NotImplementedError
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def check_limit(value: Any, argument: str) -> None:
    """Raise a ValueError unless ``value`` is None, a fraction in [0, 1], or a whole number >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationException(
            f"Trainer({argument}={value!r}): you passed invalid value {value!r}; it must be a float in "
            "[0.0, 1.0], an int >= 0, or None.")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise MisconfigurationException(
            f"Trainer({argument}={value}): you passed invalid value {value}, a fraction outside [0.0, 1.0]. Use a "
            f"float in that range for a share of the batches, or an int for a number of batches."
        )
    if isinstance(value, int) and value < 0:
        raise MisconfigurationException(
            f"Trainer({argument}={value}): you passed invalid value {value}, a negative one; use an "
            "int >= 0 or a float in [0.0, 1.0].")


def explain_ones(given: dict[str, Any]) -> None:
    """Say what ``1`` and ``1.0`` mean for the ``given`` ``limit_*_batches``, ``overfit_batches`` and
    ``val_check_interval`` (an int is a number of batches, a float a share: the two are easy to mix
    up), on rank zero through the ``"cadence"`` logger, as Lightning's info messages; None: not given."""
    from trainer.utilities import rank_zero_info  # trainer.utilities imports the loaders' module

    for name, value in given.items():
        if isinstance(value, bool) or value not in (1, 1.0):
            continue
        if isinstance(value, int):
            means = {"limit_train_batches": "1 batch per epoch will be used",
                     "val_check_interval": "validation will run after every batch"}.get(name, "1 batch will be used")
        else:
            means = {"limit_train_batches": "100% of the batches per epoch will be used",
                     "val_check_interval": "validation will run at the end of the training epoch"}.get(
                name, "100% of the batches will be used")
        rank_zero_info(f"`Trainer({name}={value})` was configured so {means}.")


def limited_length(length: int | None, limit: Any, kind: str = "*") -> int | None:
    """How many batches to run from a loader of ``length`` batches under ``limit_{kind}_batches``."""
    if limit is None:
        return length
    if isinstance(limit, float):
        if length is None:
            if limit == 1.0:
                return None
            raise MisconfigurationException(
                  # Lightning's words first
                f"When using an `IterableDataset`, `Trainer(limit_{kind}_batches)` must be `1.0` or an int: "
                f"limit_{kind}_batches={limit} is a fraction, but the loader has no length. An int specifies "
                f"`num_{kind}_batches` to use."
            )
        if 0.0 < limit < 1.0 and length and int(length * limit) == 0:  # as Lightning, in every stage
            raise MisconfigurationException(  # Lightning's words, then the other way
                f"You requested to check {limit} of the `{kind}_dataloader` but {limit} * {length} < 1. Please increase "
                f"the `limit_{kind}_batches` argument. Try at least `limit_{kind}_batches={1.0 / length}`, "
                f"or an int number of batches.")
        return int(length * limit) if limit < 1.0 else length
    return limit if length is None else min(length, limit)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's sampler (or its batch sampler's) the epoch, when it shuffles by epoch."""
    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    for sampler in {id(each): each for each in samplers if hasattr(each, "set_epoch")}.values():  # once each
        sampler.set_epoch(epoch)


def default_max_epochs(max_epochs: int | None, max_steps: int, loader: Any, warn: bool = True) -> int | None:
    """``max_epochs``, or 1000 (with a warning if ``warn``) when neither it nor ``max_steps`` bounds the run
    (-1: no epoch limit, as in Lightning; a time limit or should_stop ends the run)."""
    if max_epochs is None and max_steps == -1:
        if loader_length(loader) is None:
            raise MisconfigurationException(
                "The training loader has no length (an IterableDataset) and neither max_epochs nor "
                "max_steps is set, so training would never end. Pass Trainer(max_steps=N) or max_epochs=N."
            )
        if warn:
            warn_at_users_line("`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch limit, set "
                               "`max_epochs=-1` (neither max_epochs nor max_steps is set).", PossibleUserWarning)
        return 1000
    return -1 if max_epochs is None else max_epochs  # max_steps ends the run (trainer.max_epochs reads -1, as in Lightning)


def shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` draws its samples in random order (a RandomSampler, as Lightning checks)."""
    if isinstance(loader.dataset, IterableDataset):
        return False
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", batch_sampler)
    return isinstance(sampler, RandomSampler)


def prepare_loader(loader: Any, stage: str, *, shuffle: bool, strategy: Any, seed: int | None,
                   limit: Any, sequential: bool = False, shard: bool = True) -> tuple[Any, int | float]:
    """The strategy's shard of ``loader``, seeded (generator and workers), and how many of its
    batches to run under ``limit`` (``limit_*_batches``; ``math.inf`` for a loader without length).

    Args:
        sequential: ``overfit_batches``: a shuffling loader reads in order instead (with a warning),
            so that the same batches come every epoch.
        shard: ``use_distributed_sampler``: let the strategy give each process its share (False:
            the loader is used as it is, on every rank).
    """
    if isinstance(loader, DataLoader):
        changes = {}
        kind = {"validate": "val"}.get(stage, stage)
        if stage != "train" and shuffles(loader) and strategy.is_global_zero:  # Lightning's warning, word for word
            warn_at_users_line(f"Your `{kind}_dataloader`'s sampler has shuffling enabled, it is strongly "
                               "recommended that you turn shuffling off for val/test dataloaders.", PossibleUserWarning)
        if seed is not None and loader.generator is None:
            # Its shuffle order and worker seeds then follow the seed alone, not whatever else
            # draws from torch's global RNG (model code, augmentation in the main process).
            changes.update(seeded_generator(loader, seed))
        if loader.num_workers > 0:
            init = loader.worker_init_fn
            if init is None and (seed is not None or workers_seeded()):  # seeded workers, distinct per rank
                init = seed_worker_of_rank(strategy.global_rank)
            # Workers ignore SIGTERM/SIGINT: the main process saves and stops (trainer/preemption.py).
            changes["worker_init_fn"] = workers_ignore_preemption(init)
        if (sequential and not isinstance(loader.sampler, SequentialSampler) and loader.batch_size is not None
                and not isinstance(loader.dataset, IterableDataset)):  # as Lightning: any other sampler
            if strategy.is_global_zero:
                warn_at_users_line(f"You requested to overfit but enabled {kind} dataloader shuffling: "
                                   f"Trainer(overfit_batches=...) overfits the same batches every epoch, so the {kind} "
                                   f"loader reads in order (a SequentialSampler in place of its "
                                   f"{type(loader.sampler).__name__}).")
            changes["sampler"] = SequentialSampler(loader.dataset)
        if set(changes) == {"worker_init_fn"}:  # what Lightning sets on the loader itself: a subclass is kept
            loader = with_worker_init_fn(loader, changes["worker_init_fn"])
        elif changes:
            loader = rebuild_dataloader(loader, **changes)
    if loader_length(loader) == 0:
        raise MisconfigurationException(
            f"The {stage} DataLoader is empty (len 0). Check the dataset and batch_size/drop_last.")
    # Prediction shards in blocks, so that the ranks' outputs put end to end keep the dataset's order.
    if shard:
        loader = strategy.setup_dataloader(loader, shuffle=shuffle, contiguous=stage == "predict")
    length = loader_length(loader)
    count = limited_length(length, limit, {"validate": "val"}.get(stage, stage))
    if count == 0 and stage == "train":
        raise MisconfigurationException(
            f"Trainer(limit_train_batches={limit}) leaves no batch to train on; use a value > 0.")
    return loader, math.inf if count is None else count
