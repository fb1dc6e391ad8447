"""Helpers Lightning users import from ``lightning.pytorch.utilities``: here ``trainer.utilities``
(and ``trainer`` itself).

``rank_zero_only`` runs a function on the process of global rank zero only. Its ``rank`` is read
from ``RANK`` (torchrun, Cadence's DDP workers) or ``SLURM_PROCID`` when the process starts, and
set by the Trainer when a stage starts, as in Lightning.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

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
