"""What DDP sends to the processes it spawns, and the check, before any starts, that it can.

:class:`PickledWork` is the strategy, the function and its arguments, pickled for each worker by
torch's pickler (tensors through shared memory) while that worker starts, and unpickled by the
worker itself, so that a failure there is an error the worker reports. ``torch.Generator``
objects (a DataLoader's ``generator=``) travel as their state: their own pickling makes a tensor
on the fly, and shared memory sends a tensor as a file descriptor that must stay open until the
worker has started, which that temporary tensor does not (the worker then failed with "unable to
resize file").

:func:`check_picklable` pickles the same objects to nowhere first and names the most specific
piece that cannot be sent: what pickle refuses, and what it would write but the workers should not
receive (a tensor on a GPU of the launching process, a tensor still attached to autograd).
"""

from __future__ import annotations

import copyreg
import inspect
import multiprocessing.reduction
import pickle
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from callbacks.console import MisconfigurationException

if TYPE_CHECKING:
    from strategies.ddp import DDP


class PickledWork:
    """The strategy, function and arguments the workers run (see the module docstring), in one
    pickle so that objects they share (the Trainer's strategy is ``strategy``) stay one object.

    Pickled once per worker, while that worker starts (the pickling then hands shared-memory file
    descriptors to that very process); with the "fork" start method it is not pickled at all.
    """

    def __init__(self, strategy: DDP, function: Callable[..., Any], args: tuple) -> None:
        self.contents = (strategy, function, args)
        self.data: bytes | None = None

    def __reduce__(self) -> tuple:
        return PickledWork._received, (bytes(_WorkPickler.dumps(self.contents)),)

    @staticmethod
    def _received(data: bytes) -> PickledWork:
        work = PickledWork.__new__(PickledWork)
        work.data = data
        return work

    def open(self, rank: int) -> tuple[DDP, Callable[..., Any], tuple]:
        """The strategy, function and arguments, unpickled in the worker."""
        if self.data is None:
            return self.contents
        try:
            return pickle.loads(self.data)
        except Exception as error:
            raise RuntimeError(
                f"DDP rank {rank} could not unpickle the work the launching process sent it ({type(error).__name__}: "
                f"{error}). Everything fit receives must be importable in a new process: define classes and "
                "functions at module level of an importable module, or launch with torchrun, where each "
                "process builds its own objects."
            ) from error


class _WorkPickler(multiprocessing.reduction.ForkingPickler):
    """torch.multiprocessing's pickler (tensors through shared memory), generators by their state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Generator] = _reduce_generator


def _reduce_generator(generator: torch.Generator) -> tuple:
    return _rebuild_generator, (str(generator.device), generator.get_state().numpy().tobytes())


def _rebuild_generator(device: str, state: bytes) -> torch.Generator:
    generator = torch.Generator(device)
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


# --- checked before any process starts ------------------------------------------------------------
class _CannotSend(pickle.PicklingError):
    """Something pickle could write but the workers cannot use as sent; carries its own fix."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.fix = fix


class _ProbePickler(pickle.Pickler):
    """Pickles to nowhere, as :class:`_WorkPickler` will (generators by their state), without
    copying tensors, but refusing the tensors that shared memory cannot or should not send."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatch_table = {**copyreg.dispatch_table, torch.Generator: _reduce_generator}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            _check_sendable(obj)
            return "tensor"
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            return "tensor"
        return None


def _check_sendable(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        raise _CannotSend(
            f"a tensor on {tensor.device} in the launching process",
            "Each worker would open a CUDA context on that GPU and share its memory through CUDA IPC (rank 0 "
            "training on the launcher's copy). Keep the model and the data on the CPU until fit (drop the "
            ".cuda() or .to(device) before it): each DDP process moves its own copy to its own GPU.",
        )
    if tensor.device.type not in ("cpu", "meta"):
        raise _CannotSend(
            f"a tensor on {tensor.device}, which cannot be shared with other processes",
            "Keep the model and the data on the CPU until fit: each DDP process moves its own copy to its device.",
        )
    if tensor.requires_grad and not tensor.is_leaf:
        raise _CannotSend(
            "a tensor computed with autograd (requires_grad, not a leaf), which cannot cross processes",
            "Store tensor.detach() instead, or build it in setup().",
        )


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _ProbePickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        return error
    main = sys.modules.get("__main__")
    defined_in = getattr(type(obj), "__module__", None)
    if defined_in == "__main__" and not hasattr(main, "__file__"):
        return pickle.PicklingError(
            f"{type(obj).__name__} is defined in an interactive session (a notebook or REPL), "
            "which new processes cannot import"
        )
    return None


def _parts(name: str, obj: Any) -> list[tuple[str, Any]]:
    """The pieces of ``obj`` worth naming in an error: a loader's dataset and collate_fn, the
    attributes of a module or the Trainer."""
    if isinstance(obj, torch.utils.data.DataLoader):
        fields = ("dataset", "collate_fn", "sampler", "batch_sampler", "worker_init_fn")
        return [(f"{name}.{field}", getattr(obj, field)) for field in fields]
    if isinstance(obj, (list, tuple)):
        return [(f"{name}[{index}]", item) for index, item in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"{name}[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, torch.nn.Module):
        attributes = [(key, value) for key, value in vars(obj).items() if not key.startswith("_")]
        tensors = list(obj.named_parameters(recurse=False)) + list(obj.named_buffers(recurse=False))
        return [(f"{name}.{key}", value) for key, value in list(obj.named_children()) + tensors + attributes]
    return [(f"{name}.{key}", value) for key, value in getattr(obj, "__dict__", {}).items()]


def _culprit(name: str, obj: Any, error: Exception, depth: int = 3) -> tuple[str, Exception]:
    """The most specific piece of ``obj`` that cannot be pickled."""
    if depth == 0:
        return name, error
    for part_name, part in _parts(name, obj):
        part_error = _pickle_error(part)
        if part_error is not None:
            return _culprit(part_name, part, part_error, depth - 1)
    return name, error


def check_picklable(function: Callable[..., Any], args: tuple, count: int, strategy_name: str = "DDP") -> None:
    """Raise a ValueError naming what cannot be sent to the spawned processes, and the fixes."""
    names = list(inspect.signature(function).parameters)
    named = [(names[i] if i < len(names) else f"argument {i}", arg) for i, arg in enumerate(args)]
    owner = getattr(function, "__self__", None)
    if owner is not None:
        named.append((type(owner).__name__.lower(), owner))
    for name, obj in named:
        error = _pickle_error(obj)
        if error is None:
            continue
        where, error = _culprit(name, obj, error)
        if isinstance(error, _CannotSend):
            raise MisconfigurationException(
                f"{strategy_name} starts {count} new processes and sends them the work, but `{where}` is {error}. "
                f"{error.fix}")
        raise MisconfigurationException(
            f"{strategy_name} starts {count} new processes and must pickle the work for them, but `{where}` cannot "
            f"be pickled ({error}). Define it at module level (not inside a function, and not a "
            "lambda) in a module the processes can import, or launch with torchrun, where each "
            f"process builds its own objects: `torchrun --nproc-per-node={count} your_script.py`."
        )
