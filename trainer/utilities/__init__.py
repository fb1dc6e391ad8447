"""Helpers Lightning users import from ``lightning.pytorch.utilities``: here ``trainer.utilities``.

- ``rank_zero_only`` runs a function on the process of global rank zero only. Its ``rank`` is read
  from ``RANK`` (torchrun, Cadence's DDP workers) or ``SLURM_PROCID`` when the process starts, and
  set by the Trainer when a stage starts, as in Lightning (``lightning_utilities``' own
  ``rank_zero_only`` too, when that package is installed: projects that use it directly, such as
  the lightning-hydra-template's logger, then work under Cadence).
- ``rank_zero_info``, ``rank_zero_debug`` (the ``"cadence"`` logger, which prints to stderr unless
  logging is configured), ``rank_zero_warn``, ``rank_zero_deprecation`` (warnings): on rank zero only.
- ``grad_norm``, ``AttributeDict``, ``LightningEnum``, ``GradClipAlgorithmType``,
  ``move_data_to_device``, ``is_picklable``, ``measure_flops``, ``suggested_max_num_workers``,
  ``find_shared_parameters``, ``set_shared_parameters``, ``is_shared_filesystem``: Lightning's meaning.
- ``extract_batch_size``: how ``self.log`` weighs epoch means (Lightning's rule).
- ``CombinedLoader``: several loaders iterated together (``trainer/combined_loader.py``).
- ``LRSchedulerConfig`` (Lightning's ``utilities.types``): what ``trainer.lr_scheduler_configs`` holds.
- ``model_summary`` (``trainer.utilities.model_summary``): ``ModelSummary``, ``summarize``, ``LayerSummary``,
  ``get_human_readable_count``..., the table the ``callbacks.ModelSummary`` callback prints.
- ``PossibleUserWarning`` and ``disable_possible_user_warnings``: Lightning's category for warnings that
  could be false positives, and the function that silences them (``POSSIBLE_USER_WARNINGS=0`` or ``off``
  in the environment when ``trainer`` is imported does the same, as Lightning's).
- ``_TunerExitException`` (``lightning.pytorch.utilities.exceptions``'), caught around ``Tuner.lr_find`` by user code.
- ``MisconfigurationException`` (``lightning.pytorch.utilities.exceptions``'): a ValueError, and what Cadence raises
  for a wrong setup (every ValueError of its own), as Lightning does; projects raise it for their own errors too.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import os
import pickle
import time
import uuid
import warnings
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from callbacks.console import cadence_logger, warn
from callbacks.console import (  # noqa: F401 (Lightning's names)
    MisconfigurationException, PossibleUserWarning, disable_possible_user_warnings,
)
from strategies.transfer import move_to_device
from trainer.combined_loader import CombinedLoader  # noqa: F401 (Lightning's lightning.pytorch.utilities name)
from trainer.scheduler_config import LRSchedulerConfig  # noqa: F401 (lightning.pytorch.utilities.types')
from trainer.utilities import model_summary  # noqa: F401 (pl.utilities.model_summary, as Lightning's)

Result = TypeVar("Result")


def rank_zero_only(fn: Callable[..., Result], default: Any = None) -> Callable[..., Result | Any]:
    """Decorate ``fn`` so that it runs on global rank zero only; elsewhere it returns ``default``.

    Example::

        @rank_zero_only
        def report(text):
            print(text)
    """

    @functools.wraps(fn)
    def on_rank_zero(*args: Any, **kwargs: Any) -> Result | Any:
        if rank_zero_only.rank == 0:
            return fn(*args, **kwargs)
        return default

    return on_rank_zero


def _rank_of_this_process() -> int:
    for variable in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


def set_rank(rank: int) -> None:
    """This process's global rank, for ``rank_zero_only`` (and ``lightning_utilities``' when installed)."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
    if importlib.util.find_spec("lightning_utilities") is not None:  # no dependency: only when it is there
        from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

        utilities_rank_zero_only.rank = rank


set_rank(_rank_of_this_process())


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on rank zero (the ``"cadence"`` logger)."""
    cadence_logger().info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on rank zero (the ``"cadence"`` logger)."""
    cadence_logger().debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn`` on rank zero; ``category=`` as there (UserWarning by default)."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_deprecation(message: str | Warning, stacklevel: int = 5, **kwargs: Any) -> None:
    """A DeprecationWarning on rank zero."""
    kwargs.setdefault("category", DeprecationWarning)
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The ``norm_type`` norm of each parameter's gradient and of all of them, as tensors (no host
    sync): ``{"grad_2.0_norm/layer.weight": ..., "grad_2.0_norm_total": ...}``, for ``self.log_dict``
    in ``on_before_optimizer_step``. Parameters without a gradient are left out."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise MisconfigurationException(
            f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}: "
            f"grad_norm(norm_type={norm_type}): use a positive number or 'inf' (the largest value).")
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": parameter.grad.detach().norm(norm_type)
             for name, parameter in module.named_parameters() if parameter.grad is not None}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


class AttributeDict(dict):
    """A dict whose keys are also attributes (``hparams.lr``), printed one key a line.

    Example::

        config = AttributeDict(lr=0.1, batch_size=32)
        config.lr, config["batch_size"]
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as error:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from error

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError as error:
            raise AttributeError(key) from error

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(key)) for key in self) + 3  # Lightning's layout: '"lr":   0.1'
        return "\n".join(f"{f'{chr(34)}{key}{chr(34)}:':{width}s} {self[key]}" for key in sorted(self, key=str))


class _TunerExitException(Exception):
    """Lightning's ``utilities.exceptions._TunerExitException``, which its finders raise to end the tuning run and
    its Trainer catches: code that catches it around ``Tuner.lr_find`` runs unchanged (it never reaches the
    caller, in Lightning as here, where the finders end their run without it)."""


class LightningEnum(str, enum.Enum):
    """A string enum compared by value, ignoring case: ``GradClipAlgorithmType.NORM == "Norm"``."""

    @classmethod
    def from_str(cls, value: str, source: str = "key") -> LightningEnum:
        """The member whose name (``source="key"``), value (``"value"``) or either (``"any"``) is ``value``."""
        for member in cls:
            if (source in ("key", "any") and member.name.lower() == value.lower()) or \
                    (source in ("value", "any") and member.value.lower() == value.lower()):
                return member
        raise MisconfigurationException(
            f"{cls.__name__}: no member named {value!r}; use one of "
            f"{', '.join(member.value for member in cls)}.")

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, enum.Enum) else str(other)
        return self.value.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.value.lower())


class GradClipAlgorithmType(LightningEnum):
    """``Trainer(gradient_clip_algorithm=...)``'s values."""

    VALUE = "value"
    NORM = "norm"

    @classmethod
    def supported_types(cls) -> list[str]:
        """The values ``gradient_clip_algorithm`` takes: ``["value", "norm"]``."""
        return [member.value for member in cls]

    @classmethod
    def supported_type(cls, value: str) -> bool:
        """Whether ``value`` is one of them (exactly, as Lightning compares)."""
        return value in cls.supported_types()


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """``batch`` (tensors in lists, tuples, dicts, dataclasses, ...) on ``device``, as the Trainer moves batches."""
    return move_to_device(batch, torch.device(device) if not isinstance(device, torch.device) else device)


def is_picklable(obj: object) -> bool:
    """Whether ``pickle`` can serialize ``obj`` (what DDP's spawned processes need)."""
    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RecursionError, RuntimeError, TypeError):  # RuntimeError: torch.jit
        return False
    return True


def measure_flops(model: nn.Module, forward_fn: Callable[[], torch.Tensor],
                  loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Floating-point operations of ``forward_fn()`` (and the backward of ``loss_fn`` of its result),
    counted by ``torch.utils.flop_counter``; run it on the meta device to count without computing."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return counter.get_total_flops()


def suggested_max_num_workers(local_world_size: int) -> int:
    """DataLoader workers per process: the CPUs this process may use, shared by ``local_world_size``
    processes, less one each for the process itself (at least 1)."""
    if local_world_size < 1:
        raise MisconfigurationException(
            f"suggested_max_num_workers(local_world_size={local_world_size}): use an int >= 1.")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_world_size - 1)


def find_shared_parameters(module: nn.Module) -> list[list[str]]:
    """The names of parameters that are one tensor (tied weights), grouped: ``[["encoder.w", "decoder.w"]]``."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def set_shared_parameters(module: nn.Module, shared_params: list[list[str]]) -> nn.Module:
    """Tie again the groups ``find_shared_parameters`` found (after a copy or a move untied them)."""
    for group in shared_params:
        first = module.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, first)
    return module


def is_shared_filesystem(strategy: Any, path: str | os.PathLike | None = None, timeout: int = 3) -> bool:
    """Whether every process of ``strategy`` sees ``path`` (default: the working directory) as one
    filesystem: rank zero writes a file there, and each process looks for it for ``timeout`` seconds."""
    if strategy.world_size == 1:
        return True
    directory = Path(path if path is not None else Path.cwd())
    check = directory / f".cadence_shared_fs_{strategy.broadcast_object(uuid.uuid4().hex)}"
    if strategy.is_global_zero:
        check.touch()
    strategy.barrier()
    deadline = time.monotonic() + timeout
    while not check.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    shared = not strategy.reduce_any(not check.exists())
    strategy.barrier()
    if strategy.is_global_zero:
        check.unlink(missing_ok=True)
    return shared


def cli_lightning_logo() -> None:
    """Lightning's banner for a script run from the command line (its examples call it first): the
    framework's name between blank lines; here Cadence's."""
    print()
    print("Cadence")
    print()


def get_torchvision_model(model_name: str, **kwargs: Any) -> nn.Module:
    """``torchvision.models``' model ``model_name`` built with ``kwargs`` (``weights="DEFAULT"``), as
    Lightning's ``lightning.pytorch.utilities.model_helpers.get_torchvision_model``."""
    try:
        from torchvision import models
    except ImportError as error:
        raise ImportError(f"get_torchvision_model({model_name!r}) needs torchvision: pip install torchvision") from error
    if hasattr(models, "get_model"):  # torchvision 0.14 and later
        return models.get_model(model_name, **kwargs)
    return getattr(models, model_name)(**kwargs)


_AMBIGUOUS_SIZES_WARNED: set[tuple[int | None, int | None]] = set()


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
            if (size, found) in _AMBIGUOUS_SIZES_WARNED:  # once a process, as Lightning's (not once per self.log line)
                break
            _AMBIGUOUS_SIZES_WARNED.add((size, found))
            warn(f"self.log could not tell the batch size for certain: the batch holds parts of size {size} and "
                 f"{found}; the epoch mean weighs each value by {size}. Pass self.log(..., batch_size=n) to say "
                 "which.")
            break
    if size is None:
        raise MisconfigurationException(
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
