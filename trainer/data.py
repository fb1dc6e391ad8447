"""DataLoader helpers: how many batches, ``limit_*_batches``, and rebuilding a loader.

The loop never fetches a batch to learn something about a loader; these read its attributes.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

# Lives with the strategies, which rebuild loaders to shard them; re-exported for the loop.
from strategies.loaders import rebuild_dataloader  # noqa: F401


def loader_length(loader: Any) -> int | None:
    """The number of batches of ``loader``, or None when it cannot tell (an IterableDataset)."""
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        try:
            return len(loader)
        except TypeError:
            return None
    try:
        return len(loader)
    except TypeError:
        return None


def check_limit(value: Any, argument: str) -> None:
    """Raise a ValueError unless ``value`` is None, a fraction in [0, 1], or a whole number >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Trainer({argument}={value!r}) must be a float in [0.0, 1.0], an int >= 0, or None.")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(
            f"Trainer({argument}={value}) is a fraction outside [0.0, 1.0]. Use a float in that "
            f"range for a share of the batches, or an int for a number of batches."
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"Trainer({argument}={value}) is negative; use an int >= 0 or a float in [0.0, 1.0].")


def limited_length(length: int | None, limit: Any) -> int | None:
    """How many batches to run from a loader of ``length`` batches under ``limit_*_batches``."""
    if limit is None:
        return length
    if isinstance(limit, float):
        if length is None:
            if limit == 1.0:
                return None
            raise ValueError(
                f"limit_*_batches={limit} is a fraction, but the loader has no length (an "
                "IterableDataset); pass a whole number of batches instead."
            )
        return int(length * limit) if limit < 1.0 else length
    return limit if length is None else min(length, limit)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's sampler (or its batch sampler's) the epoch, when it shuffles by epoch."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
