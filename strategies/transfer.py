"""Moving a batch to the device: tensors inside tuples, lists, dicts, namedtuples and dataclasses.

Tensors move with ``non_blocking=True``: from pinned memory to a CUDA device the copy overlaps
with compute; from pageable memory PyTorch falls back to a synchronous copy, which is why the
CUDA strategy warns about loaders without ``pin_memory``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Return ``batch`` with every tensor inside it on ``device``; other values are kept as is.

    ``non_blocking=False`` for copies to the CPU that are read at once: a non-blocking copy from a
    GPU returns before its data has arrived.
    """
    if isinstance(batch, torch.Tensor):
        # Already there (CPU training, a loader that yields device tensors): .to() would return
        # the same tensor; skipping it saves a dispatcher call per tensor per step.
        return batch if batch.device == device else batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        # A tensor already on the device is kept inline, without a call: most batches are a list
        # or tuple of tensors, and this runs every step.
        moved = [item if isinstance(item, torch.Tensor) and item.device == device else move_to_device(item, device, non_blocking)
                 for item in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*moved)
        return type(batch)(moved)
    if isinstance(batch, dict):
        return type(batch)((key, move_to_device(value, device, non_blocking)) for key, value in batch.items())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            field.name: move_to_device(getattr(batch, field.name), device, non_blocking)
            for field in dataclasses.fields(batch)
            if field.init
        }
        return dataclasses.replace(batch, **changes)
    return batch
