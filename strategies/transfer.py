"""Moving a batch to the device: every tensor inside tuples, lists, mappings, namedtuples,
dataclasses, and objects that move themselves with ``.to()``.

``non_blocking`` is used only where it is safe (:func:`copies_without_blocking`): to a CUDA
device. There a copy from pinned memory overlaps compute, and PyTorch's caching host allocator
keeps a pinned source alive until its copy has run even when the loop drops the CPU batch at
once; a copy from pageable memory is staged by the driver before the call returns. A
non-blocking copy to an Apple GPU (MPS) can read its source after it was freed and deliver
garbage (pytorch/pytorch#189690, #139550), so MPS and every other device copy synchronously.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import warnings
from collections import UserDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

#: Device types a non-blocking host-to-device copy is known to be safe for.
NON_BLOCKING_DEVICE_TYPES = ("cuda",)


def copies_without_blocking(device: torch.device) -> bool:
    """True when batches may move to ``device`` with ``non_blocking=True`` (see the module docstring)."""
    return device.type in NON_BLOCKING_DEVICE_TYPES


def move_to_device(batch: Any, device: torch.device, non_blocking: bool | None = None) -> Any:
    """Return ``batch`` with every tensor inside it on ``device``; other values are kept as is.

    Args:
        batch: a tensor, or a list, tuple, namedtuple, mapping (a dict, ``defaultdict``,
            ``UserDict`` such as Hugging Face's ``BatchEncoding``) or dataclass holding tensors, at
            any depth, or an object with its own ``.to(device)`` method (called as it is).
        device: where the tensors go.
        non_blocking: None decides by the device (:func:`copies_without_blocking`). Pass False for
            copies to the CPU that are read at once: a non-blocking copy from a GPU returns before
            its data has arrived.

    The loader's batch itself is left as it was (containers are rebuilt, not changed in place;
    a mapping is rebuilt even when it has a ``.to()`` of its own), except by an object's own
    ``.to()`` if that moves in place.
    """
    if non_blocking is None:
        non_blocking = copies_without_blocking(device)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        # Already there (a loader that yields device tensors): .to() would return the same tensor.
        return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)

    def move_object(obj: Any) -> Any:
        return _move_object(obj, device, non_blocking)

    return apply_to_tensors(batch, move, move_object)


def apply_to_tensors(batch: Any, function: Callable[[torch.Tensor], Any],
                     other: Callable[[Any], Any] | None = None) -> Any:
    """``batch`` rebuilt with ``function(tensor)`` in place of each tensor inside its containers.

    ``other`` is called on each value that is neither a tensor nor a container (default: kept).
    """
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, (list, tuple)):
        items = [apply_to_tensors(item, function, other) for item in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*items)
        return type(batch)(items)
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {key: apply_to_tensors(value, function, other) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        # A shallow copy keeps fields that __init__ does not take and runs no __post_init__;
        # object.__setattr__ also sets the fields of a frozen dataclass.
        rebuilt = copy.copy(batch)
        for field in dataclasses.fields(batch):
            object.__setattr__(rebuilt, field.name, apply_to_tensors(getattr(batch, field.name), function, other))
        return rebuilt
    return batch if other is None else other(batch)


def rebuild_mapping(mapping: Mapping, items: dict) -> Mapping:
    """``mapping`` with ``items`` in place of its values, of its own type (a copy for dicts and UserDicts)."""
    if type(mapping) is dict:
        return items
    if isinstance(mapping, (dict, UserDict)):
        # A copy keeps the type and what else it holds (a defaultdict's factory, a BatchEncoding's
        # encodings) and has its own storage, so setting items leaves the loader's batch alone.
        rebuilt = copy.copy(mapping)
        for key, value in items.items():
            rebuilt[key] = value
        return rebuilt
    try:
        return type(mapping)(items)
    except TypeError as error:
        raise TypeError(
            f"Cannot move a batch of type {type(mapping).__name__} to the device: it is a Mapping that "
            f"cannot be built from a dict ({error}). Yield a dict, or give the class a "
            "`to(device, non_blocking=False)` method that returns the moved object."
        ) from None


#: Per class: whether its ``.to`` takes ``non_blocking`` (read once per class, not per batch).
_TAKES_NON_BLOCKING: dict[type, bool] = {}


def _move_object(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """An object with its own ``.to(device, ...)`` (as Lightning moves them); anything else as is."""
    to = getattr(obj, "to", None)
    if not callable(to) or isinstance(obj, type):  # a class's `to` is an unbound function
        return obj
    cls = type(obj)
    takes = _TAKES_NON_BLOCKING.get(cls)
    if takes is None:
        try:
            parameters = inspect.signature(to).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            parameters = {}
        takes = "non_blocking" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        _TAKES_NON_BLOCKING[cls] = takes
    return to(device, non_blocking=non_blocking) if takes and non_blocking else to(device)


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor inside ``batch``: in its containers, and among the attributes of objects that
    moved themselves with ``.to()`` (one level of ``vars()``, then containers again)."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    def look_inside(obj: Any) -> Any:
        if callable(getattr(obj, "to", None)) and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                apply_to_tensors(value, collect)
        return obj

    apply_to_tensors(batch, collect, look_inside)
    return found


def pinned_loader(loader: Any) -> Any:
    """``loader`` rebuilt so that the CPU tensors of its batches are pinned, when it is a DataLoader
    that does not pin.

    A CUDA copy from pinned memory runs on the copy engine while the GPU computes; from pageable
    memory the driver first stages it through a pinned buffer of its own, on the host's time.
    Without workers the batch is pinned right after ``collate_fn`` (:class:`PinnedCollate`, where
    ``DataLoader(pin_memory=True)`` would pin it too), and only its CPU tensors: a dataset may
    yield tensors that are on the GPU already, which ``pin_memory=True`` refuses ("cannot pin
    'torch.cuda.FloatTensor'"). With workers the DataLoader pins in a background thread of this
    process (``pin_memory=True``): workers hand over CPU tensors (CUDA cannot start in a worker
    forked from a process that uses it). A subclass of DataLoader is kept (a rebuilt plain
    DataLoader would lose what the subclass adds), with a warning; other iterables are kept as
    they are.
    """
    from torch.utils.data import DataLoader

    from strategies.loaders import rebuild_dataloader

    if not isinstance(loader, DataLoader) or pins_batches(loader):
        return loader
    if type(loader) is not DataLoader:
        warnings.warn(
            f"The {type(loader).__name__} does not pin memory, so batches reach the GPU through pageable memory "
            "and their copies cannot overlap compute. Pass pin_memory=True to it.",
            stacklevel=4,
        )
        return loader
    if loader.num_workers > 0:
        return rebuild_dataloader(loader, pin_memory=True)
    return rebuild_dataloader(loader, collate_fn=PinnedCollate(loader.collate_fn))


def pins_batches(loader: Any) -> bool:
    """True when ``loader`` hands out batches in pinned memory (``pin_memory=True``, or rebuilt by
    :func:`pinned_loader` to pin after collating)."""
    return bool(getattr(loader, "pin_memory", False)) or isinstance(getattr(loader, "collate_fn", None), PinnedCollate)


class PinnedCollate:
    """A DataLoader's ``collate_fn``, then the batch's CPU tensors pinned; tensors already on a
    device pass as they are. Runs where the loader collates without workers: in this process.

    Args:
        collate_fn: the loader's own ``collate_fn``.
    """

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: Any) -> Any:
        return pin_cpu_tensors(self.collate_fn(samples))

    def __repr__(self) -> str:
        return f"PinnedCollate({self.collate_fn!r})"


def pin_cpu_tensors(batch: Any) -> Any:
    """``batch`` with each CPU tensor in pinned memory (a pinned one is kept), tensors on a device
    as they are, and objects with their own ``pin_memory()`` pinned by it, as the DataLoader does."""

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if tensor.device.type == "cpu" else tensor

    def pin_object(obj: Any) -> Any:
        method = getattr(obj, "pin_memory", None)
        return method() if callable(method) and not isinstance(obj, type) else obj

    return apply_to_tensors(batch, pin, pin_object)


def return_to_host(module: Any, device: torch.device, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """After a stage, move ``module`` (placed on the accelerator ``device`` by a strategy) back to
    the CPU, gradients with it, the states of its ``optimizers`` too, and give the device's cached
    blocks back, as Lightning's teardown does: memory the stage used is free for the rest of the
    script, and the next stage moves the module (and an optimizer that outlived the stage) to the
    device again. Nothing on the CPU."""
    if device.type not in ("cuda", "mps"):
        return
    module.to(torch.device("cpu"))
    optimizer_states_to(optimizers, torch.device("cpu"))
    gc.collect()  # tensors the stage left in reference cycles, before the cache is emptied
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        torch.mps.empty_cache()


def optimizer_states_to(optimizers: Sequence[torch.optim.Optimizer], device: torch.device | None) -> None:
    """Move every tensor of ``optimizers``' states to ``device``, in place: to the CPU when a stage
    ends (their memory on the GPU is then free); with ``device=None`` each parameter's state goes
    to that parameter's device, for an optimizer that outlived a stage (``torch.optim`` steps only
    with states beside their parameters; an offloading strategy's stay on the CPU). A ``"step"``
    count stays where it is: torch keeps it on the CPU unless the optimizer is capturable or fused
    (pytorch/pytorch#74424), as Lightning's move does."""
    for optimizer in optimizers:
        for parameter, state in optimizer.state.items():
            target = parameter.device if device is None else device

            def move(tensor: torch.Tensor, target: torch.device = target) -> torch.Tensor:
                return tensor if tensor.device == target else tensor.to(target)

            if isinstance(state, dict):
                optimizer.state[parameter] = {key: value if key == "step" else apply_to_tensors(value, move)
                                              for key, value in state.items()}
            else:
                optimizer.state[parameter] = apply_to_tensors(state, move)
