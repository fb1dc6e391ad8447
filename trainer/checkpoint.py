"""Checkpoint files: written atomically, loaded without executing code.

A checkpoint holds only tensors and plain Python data, so ``torch.load(weights_only=True)`` reads
it by construction. A write goes to a temporary file in the target's directory, is flushed and
fsynced, then renamed over the target: a kill at any instant leaves the previous file whole.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` so that ``path`` is always either the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(
                error.errno,
                f"Could not write the checkpoint {path} ({error.strerror}); the previous file at that "
                "path, if any, is intact. Free disk space or choose another dirpath.",
            ) from error
        raise
    _fsync_directory(path.parent)
    return path


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


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``; every failure names the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist. Check the path, or pass ckpt_path='last'.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"Refusing to load checkpoint {path}: it contains objects that would run code when "
            f"unpickled ({str(error).splitlines()[0]}). Cadence checkpoints hold only tensors and "
            "plain data; re-save the weights with torch.save(model.state_dict()) from trusted code."
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ValueError(
            f"Checkpoint {path} is truncated or corrupted ({error}). Use an earlier checkpoint; "
            "Cadence writes checkpoints atomically, so this file was damaged after it was written "
            "or was not written by Cadence."
        ) from error
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{path} is not a Cadence checkpoint (no 'state_dict'); it holds {type(state).__name__}.")
    return state
