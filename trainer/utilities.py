"""Helpers Lightning users import from ``lightning.pytorch.utilities``: here ``trainer.utilities``
(and ``trainer`` itself).

``rank_zero_only`` runs a function on the process of global rank zero only. Its ``rank`` is read
from ``RANK`` (torchrun, Cadence's DDP workers) or ``SLURM_PROCID`` when the process starts, and
set by the Trainer when a stage starts, as in Lightning. ``extract_batch_size`` is how ``self.log``
weighs epoch means.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, TypeVar

import torch

Result = TypeVar("Result")


def rank_zero_only(function: Callable[..., Result], default: Any = None) -> Callable[..., Result | Any]:
    """Decorate ``function`` so that it runs on global rank zero only; elsewhere it returns ``default``.

    Example::

        @rank_zero_only
        def report(text):
            print(text)
    """

    @functools.wraps(function)
    def on_rank_zero(*args: Any, **kwargs: Any) -> Result | Any:
        if rank_zero_only.rank == 0:
            return function(*args, **kwargs)
        return default

    return on_rank_zero


def _rank_of_this_process() -> int:
    for variable in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


rank_zero_only.rank = _rank_of_this_process()  # type: ignore[attr-defined]


def extract_batch_size(batch: Any) -> int:
    """The size of ``batch`` as Lightning infers it: dim 0 of the first tensor found walking it
    (sequences and mapping values in order, dataclass fields), 1 for a 0-d tensor.

    It weighs values in epoch means (``self.log(..., batch_size=n)`` overrides it). A warning says
    when later parts of the batch disagree; a batch without a tensor is an error.
    """
    size = None
    for found in _batch_sizes(batch):
        if size is None:
            size = found
        elif found != size:
            warnings.warn(
                f"self.log could not tell the batch size for certain: the batch holds parts of size {size} and "
                f"{found}; the epoch mean weighs each value by {size}. Pass self.log(..., batch_size=n) to say "
                "which.", stacklevel=4)
            break
    if size is None:
        raise ValueError(
            f"self.log found no tensor in the batch ({type(batch).__name__}) to tell its size, which weighs "
            "the value in the epoch mean. Pass self.log(..., batch_size=n), or make the batch hold tensors.")
    return size


def _batch_sizes(batch: Any) -> Iterator[int | None]:
    if isinstance(batch, torch.Tensor):
        yield batch.size(0) if batch.ndim else 1
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _batch_sizes(value)
    elif isinstance(batch, Iterable) and not isinstance(batch, str):
        for value in batch:
            yield from _batch_sizes(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _batch_sizes(getattr(batch, field.name))
    else:
        yield None
