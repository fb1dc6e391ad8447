"""Checkpoint files: written atomically, loaded without executing code, checked with clear errors.

A checkpoint holds only tensors and plain Python data, so ``torch.load(weights_only=True)`` reads
it by construction; :func:`check_plain` refuses anything else before a byte is written. A write
goes to a temporary file in the target's directory, is flushed and fsynced, then renamed over the
target: a kill at any instant leaves the previous file whole, and a failed write (a full disk)
says that it did. Every load failure names the file and what to do.
"""

from __future__ import annotations

import collections
import enum
import errno
import glob
import os
import pickle
import re
import tempfile
import warnings
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

#: Bumped when the layout of a checkpoint changes, so an old reader can refuse a newer file.
FORMAT_VERSION = 1

#: What a full (resumable) checkpoint holds besides the weights.
TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "loops", "rng", "callbacks")

# The leaves torch.load(weights_only=True) accepts (see torch/_weights_only_unpickler.py). Exact
# types: a subclass (torch.__version__ is a str subclass, numpy.float64 a float one) pickles as a
# class reference that the safe loader refuses.
_PLAIN_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.Tensor,
                 torch.nn.Parameter, torch.Size, torch.dtype, torch.device)


# =============================================================================================
# Writing
# =============================================================================================
def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` so that ``path`` is always either the old file or the new one.

    Args:
        state: tensors and plain data only (checked first; a TypeError names the offending key).
        path: the target file; its directory is created if needed.

    Raises:
        OSError: the write failed (a full disk, no permission). The error says whether a previous
            checkpoint at ``path`` is intact; no temporary file is left behind.
    """
    check_plain(state)
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path)
        descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(descriptor, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _write_error(error, path) from error
        raise
    _fsync_directory(path.parent)
    return path


def _write_error(error: OSError, path: Path) -> OSError:
    previous = (f"the previous checkpoint {path} is intact" if path.exists()
                else f"no file was written at {path}")
    hint = ("The disk is full: free space or choose another dirpath." if error.errno == errno.ENOSPC
            else "Check the directory's permissions and free space, or choose another dirpath.")
    return OSError(error.errno, f"Could not write the checkpoint {path} ({error.strerror or error}); "
                                f"{previous}. {hint}")


def _remove_stale_temporaries(path: Path) -> None:
    # A writer killed mid-write (SIGKILL) leaves its temporary file; the next write of the same
    # target removes it so that dead runs do not slowly fill the disk.
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX).
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


# =============================================================================================
# Plain data
# =============================================================================================
def check_plain(value: Any, where: str = "checkpoint") -> None:
    """Raise a TypeError naming the first value that ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _PLAIN_LEAVES:
        return
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int, float, bool, type(None)):
                raise TypeError(f"{where} has a key of type {type(key).__name__} ({key!r}); checkpoint "
                                "keys must be str, int, float, bool or None.")
            check_plain(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}. A checkpoint holds only "
        "tensors and plain data (numbers, strings, lists, tuples, dicts) so that it loads with "
        "torch.load(weights_only=True) without running code; store this value as plain data (for "
        "an object, its state_dict() or str())."
    )


def plain_hyperparameters(hparams: Any) -> dict[str, Any]:
    """``hparams`` as plain data: paths and enums become their values, other objects their repr."""
    return {str(key): _plain(value) for key, value in dict(hparams).items()}


def _plain(value: Any) -> Any:
    if type(value) in (str, int, float, bool, type(None)):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, np.generic):  # numpy.float64(0.1), numpy.bool_(True)
        return _plain(value.item())
    for base in (str, int, float):  # subclasses (numpy.float64, TorchVersion) as their base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(item) for item in value]
    return repr(value)


# =============================================================================================
# Reading
# =============================================================================================
def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; every failure names the file and the fix.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file would run code when unpickled, is truncated or corrupted, is not a
            Cadence checkpoint, or was written by a newer Cadence.
    """
    path = check_exists(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe:
            raise ValueError(
                f"Refusing to load checkpoint {path}: it contains a pickled {unsafe.group(1)}, which "
                "would run code when loaded. Cadence loads only tensors and plain data "
                "(torch.load(weights_only=True)). If you trust the file, load it yourself and save "
                "the plain parts (state_dict()s) again."
            ) from error
        raise _corrupted(path, error) from error
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError) as error:
        raise _corrupted(path, error) from error
    if not isinstance(state, dict) or "state_dict" not in state:
        what = f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{path} is not a Cadence checkpoint: it has no 'state_dict' (it holds {what}). To start "
            "from bare weights, load them with model.load_state_dict(...) and call fit without ckpt_path."
        )
    if state.get("format", FORMAT_VERSION) > FORMAT_VERSION:
        raise ValueError(
            f"Checkpoint {path} has format {state['format']}, newer than this Cadence reads "
            f"({FORMAT_VERSION}); it was written by Cadence {state.get('versions', {}).get('cadence')}. "
            "Upgrade torchcadence."
        )
    return state


def check_exists(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it is a file; else a FileNotFoundError that says what is there."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"Checkpoint {path} is a directory; pass the path of a .ckpt file inside it.")
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist. Check the path, or pass ckpt_path=\"last\".")
    return path


def resolve_ckpt_path(ckpt_path: Any, stage: str, checkpoint_dirs: list[Path], versions: Path, warn: bool) -> Path | None:
    """The file ``Trainer.<stage>(ckpt_path=...)`` loads, checked before anything starts.

    ``"last"`` is the newest ``last.ckpt`` in ``checkpoint_dirs`` (the ModelCheckpoints' explicit
    dirpaths) if there are any, else under ``<versions>/version_*/checkpoints/`` (``versions``:
    the run's ``<default_root_dir>/cadence_logs``, or its first logger's ``<save_dir>/<name>``). When there
    is none, ``fit`` starts from scratch (returns None, with a warning if ``warn``), so one command
    both starts a run and resumes it; the other stages need a checkpoint.
    """
    if not isinstance(ckpt_path, (str, os.PathLike)):
        raise TypeError(f"Trainer.{stage}(ckpt_path={ckpt_path!r}): pass a checkpoint path, \"last\" or None.")
    if str(ckpt_path) != "last":
        return check_exists(ckpt_path)
    if checkpoint_dirs:
        candidates, where = [d / "last.ckpt" for d in checkpoint_dirs], " or ".join(map(str, checkpoint_dirs))
    else:
        candidates = list(versions.glob("version_*/checkpoints/last.ckpt"))
        where = f"{versions}/version_*/checkpoints"
    candidates = [candidate for candidate in candidates if candidate.is_file()]
    if candidates:
        return max(candidates, key=os.path.getmtime)
    if stage != "fit":
        raise FileNotFoundError(f"Trainer.{stage}(ckpt_path=\"last\") found no last.ckpt in {where}. Pass a checkpoint path.")
    if warn:
        warnings.warn(f"fit(ckpt_path=\"last\") found no last.ckpt in {where}; training starts from scratch.", stacklevel=5)
    return None


def _corrupted(path: Path, error: BaseException) -> ValueError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ValueError(
        f"Checkpoint {path} is truncated or corrupted ({detail}). Use an earlier checkpoint; Cadence "
        "writes checkpoints atomically, so this file was damaged after it was written or was not "
        "written by Cadence."
    )


def check_resumable(state: dict[str, Any], path: Path) -> None:
    """Raise unless ``state`` holds the training state that ``fit(ckpt_path=...)`` continues from."""
    missing = [key for key in TRAINING_STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"Checkpoint {path} holds weights but not the training state ({', '.join(missing)} "
            "missing), so fit cannot resume from it. To start a new run from these weights, load "
            "them with model.load_state_dict(...) and call fit without ckpt_path."
        )


def load_weights(module: torch.nn.Module, state: dict[str, Any], path: Path) -> None:
    """``module.load_state_dict`` with an error that names the file and every key that differs."""
    weights = state["state_dict"]
    expected = module.state_dict()
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {path} does not fit {type(module).__name__}: missing keys {_few(missing)}, "
            f"unexpected keys {_few(unexpected)}. Load it into the model class (and configuration) "
            "that wrote it."
        )
    mismatched = [f"{key}: checkpoint {tuple(weights[key].shape)}, model {tuple(value.shape)}"
                  for key, value in expected.items()
                  if isinstance(value, torch.Tensor) and isinstance(weights[key], torch.Tensor)
                  and weights[key].shape != value.shape]
    if mismatched:
        raise ValueError(
            f"Checkpoint {path} does not fit {type(module).__name__}: shapes differ for "
            f"{_few(mismatched)}. Build the model with the hyperparameters that wrote it "
            f"({state.get('hyper_parameters', {})})."
        )
    module.load_state_dict(weights)


def load_optimizers(optimizers: list[torch.optim.Optimizer], schedulers: list[Any], state: dict[str, Any],
                    path: Path) -> None:
    """Load optimizer and scheduler states; a different count or parameter layout is an error."""
    for what, objects, states in (("optimizers", optimizers, state["optimizer_states"]),
                                  ("LR schedulers", schedulers, state["lr_schedulers"])):
        if len(objects) != len(states):
            raise ValueError(
                f"Checkpoint {path} has {len(states)} {what}, but configure_optimizers returned "
                f"{len(objects)}. Resume with the configure_optimizers that wrote it."
            )
    for index, (optimizer, optimizer_state) in enumerate(zip(optimizers, state["optimizer_states"])):
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, RuntimeError) as error:
            raise ValueError(
                f"Checkpoint {path}: optimizer {index} ({type(optimizer).__name__}) does not fit: {error} "
                "Resume with the model and configure_optimizers that wrote it."
            ) from error
    for scheduler, scheduler_state in zip(schedulers, state["lr_schedulers"]):
        scheduler.load_state_dict(scheduler_state)


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit]) or "none"
    return f"[{shown}{f', ... ({len(items) - limit} more)' if len(items) > limit else ''}]"
