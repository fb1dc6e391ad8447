"""Checkpoint files on disk: written atomically, read safely; one file, or a directory of shards.

A checkpoint holds only tensors and plain Python data, so ``torch.load(weights_only=True)`` reads
it by construction. Writing one file is two steps, so that the second can run in the background
while training goes on:

- :func:`snapshot` checks that the state is plain data (a TypeError names the first value that is
  not, before a byte is written) and, with ``to_host=True``, copies its tensors off the device;
- :func:`write_file` serializes it to a temporary file in the target's directory, flushes and
  fsyncs it, then renames it over the target: a kill at any instant leaves the previous file
  whole, and a failed write (a full disk) says that it did.

:func:`save_atomic` is the two in a row. A checkpoint directory (FSDP's shards,
:mod:`strategies.checkpoint.sharded`) is written under a temporary name (:func:`staging_directory`)
and swapped into place by :func:`replace_atomic`. Files and directories are created with the
user's umask, like any other file they write. ``ModelCheckpoint`` links and prunes checkpoints
with :func:`link_checkpoint` and :func:`remove_checkpoint`. :func:`read_file` is the one
``torch.load`` of the project's checkpoints; :func:`strategies.checkpoint.read_checkpoint` calls it.
"""

from __future__ import annotations

import collections
import errno
import glob
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from callbacks.console import MisconfigurationException

if TYPE_CHECKING:
    from strategies.checkpoint.background import HostBuffers

# The leaves torch.load(weights_only=True) accepts (see torch/_weights_only_unpickler.py). Exact
# types: a subclass (torch.__version__ is a str subclass, numpy.float64 a float one) pickles as a
# class reference that the safe loader refuses.
_PLAIN_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.Tensor,
                 torch.nn.Parameter, torch.Size, torch.dtype, torch.device)
# The mappings it accepts (exact types too); a MultiStepLR's milestones are a Counter.
_PLAIN_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)


# =============================================================================================
# Writing one file: a snapshot, then the write
# =============================================================================================
def snapshot(state: dict[str, Any], to_host: bool = False, buffers: HostBuffers | None = None) -> dict[str, Any]:
    """``state`` as a checkpoint will hold it: NumPy scalars as Python numbers, checked to be
    tensors and plain data only.

    A NumPy scalar (a learning rate a scheduler computed with ``np.cos``) becomes the Python number
    of the same value (``item()``: exact, a float64 is a Python float), so that the file loads with
    any ``torch.load(weights_only=True)``, which refuses NumPy's classes; torch's optimizers compute
    the same with either. Everything torch's safe loader accepts is kept as it is (a MultiStepLR's
    ``collections.Counter`` of milestones included).

    Args:
        state: the checkpoint's content (``trainer/state.py`` gathers it).
        to_host: copy every tensor (detached) into CPU memory, so that training may go on changing
            the originals while :func:`write_file` writes the copy (in another thread, say).
            Without it no tensor is copied, and the state must be written before training goes on.
            Tensors shared within ``state`` stay shared in the copy. The file then records the
            tensors on the CPU (``load_from_checkpoint(map_location=None)`` keeps them there),
            where a synchronous save records the device they were on.
        buffers: with ``to_host``, the pinned buffers to copy CUDA tensors into, kept across saves
            (:class:`~strategies.checkpoint.background.HostBuffers`); returns once the copies are done.

    Raises:
        TypeError: a value that ``torch.load(weights_only=True)`` would refuse, named by its key.
    """
    plain = plain_copy(state, {} if to_host else None, buffers.copy if buffers is not None else _host_copy)
    if buffers is not None:
        buffers.synchronize()
    check_plain(plain)
    return plain


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def plain_copy(value: Any, copies: dict[int, torch.Tensor] | None,
               copy: Callable[[torch.Tensor], torch.Tensor] = _host_copy) -> Any:
    """``value`` with NumPy scalars as Python numbers and, given ``copies`` (tensors copied so far,
    by id), its tensors copied to the host with ``copy``. Only the containers ``check_plain``
    accepts are rebuilt; anything else is left for it to name."""
    if isinstance(value, torch.Tensor):
        if copies is None:
            return value
        if id(value) not in copies:
            copies[id(value)] = copy(value)
        return copies[id(value)]
    if isinstance(value, np.generic) and isinstance(value, (np.number, np.bool_)):
        return value.item()
    if type(value) in _PLAIN_MAPPINGS:
        return type(value)({key: plain_copy(item, copies, copy) for key, item in value.items()})
    if type(value) in (list, tuple, set):
        return type(value)(plain_copy(item, copies, copy) for item in value)
    return value  # immutable plain data, or what check_plain refuses


def write_file(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` (from :func:`snapshot`) to ``path`` so that ``path`` is always either the
    old file or the new one: a temporary file beside it, flushed, fsynced, renamed over it.

    It touches only ``state`` and the file system, so it may run in a thread of its own while
    training goes on, given a ``snapshot(state, to_host=True)``.

    Raises:
        OSError: the write failed (a full disk, no permission). The error says whether a previous
            checkpoint at ``path`` is intact; no temporary file is left behind.
    """
    path = Path(path)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path)
        descriptor, temporary = _create_temporary(path)
        with os.fdopen(descriptor, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        replace_atomic(Path(temporary), path)  # also over a sharded checkpoint directory of the same name
    except BaseException as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _write_error(error, path) from error
        raise
    return path


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """:func:`snapshot` then :func:`write_file`, in this thread: a synchronous, atomic save.

    Raises:
        TypeError: ``state`` holds a value that is not tensors or plain data (nothing is written).
        OSError: as :func:`write_file`.
    """
    return write_file(snapshot(state), path)


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file next to ``path``, open for writing. Created with mode 0o666 so that the kernel
    applies the umask, as for any file the user writes (tempfile.mkstemp would make it 0600)."""
    while True:
        name = str(path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp"))
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue


def _write_error(error: OSError, path: Path) -> OSError:
    previous = (f"the previous checkpoint {path} is intact" if path.exists()
                else f"no file was written at {path}")
    hint = ("The disk is full: free space or choose another dirpath." if error.errno == errno.ENOSPC
            else "Check the directory's permissions and free space, or choose another dirpath.")
    return OSError(error.errno, f"Could not write the checkpoint {path} ({error.strerror or error}); "
                                f"{previous}. {hint}")


def _remove_stale_temporaries(path: Path) -> None:
    # A writer killed mid-write (SIGKILL) leaves its temporary file or directory; the next write of
    # the same target removes it so that dead runs do not slowly fill the disk.
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        remove_checkpoint(stale)


def fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable (POSIX: the entry is on disk once its directory is)."""
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
# Directories: a temporary name, then swapped into place
# =============================================================================================
def staging_directory(path: str | os.PathLike) -> Path:
    """A new, empty directory next to ``path`` to write a checkpoint directory into; stale ones
    that killed writers left for the same target are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    while True:
        staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            staging.mkdir()
            return staging
        except FileExistsError:
            continue


def replace_atomic(staging: Path, path: Path) -> None:
    """Put the finished ``staging`` (a file or directory) at ``path``, replacing what was there.

    A file replaces a file in one rename. A directory cannot be renamed over a non-empty one (nor
    a file over a directory, or the reverse), so the old checkpoint first moves aside to
    ``.<name>.<token>.old``, the new one takes its place, and the old one is deleted. A kill
    between the two renames leaves both whole: the old one is found by
    :func:`recover_interrupted_replace`, the new one is removed by the next write.
    """
    if path.exists() and not path.is_symlink() and (path.is_dir() or staging.is_dir()):
        aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
        os.rename(path, aside)
        os.rename(staging, path)
        remove_checkpoint(aside)
    else:
        os.replace(staging, path)
    fsync_directory(path.parent)


def recover_interrupted_replace(path: Path) -> None:
    """If a kill struck between the two renames of :func:`replace_atomic`, move the previous
    checkpoint back to ``path``, so that a resume finds it."""
    if path.exists():
        return
    aside = sorted(path.parent.glob(f".{glob.escape(path.name)}.*.old"), key=os.path.getmtime)
    if aside:
        try:
            os.rename(aside[-1], path)
        except OSError:  # another process (a torchrun rank) moved it back first
            pass


def link_checkpoint(source: Path, path: Path) -> None:
    """Make ``path`` the same checkpoint as ``source`` (hard links, or copies where the file system
    has none), replacing ``path`` atomically: it is always the old checkpoint or the new one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.link.tmp")
    try:
        remove_checkpoint(temporary)
        if source.is_dir():
            temporary.mkdir()
            for file in source.iterdir():
                _link_or_copy(file, temporary / file.name)
        else:
            _link_or_copy(source, temporary)
        replace_atomic(temporary, path)
    except OSError as error:
        remove_checkpoint(temporary)
        raise OSError(error.errno, f"Could not update {path} from {source} ({error.strerror or error}); "
                                   f"{source} is complete and {path} is unchanged.") from error


def symlink_checkpoint(source: Path, path: Path) -> None:
    """Make ``path`` a symbolic link to ``source`` (relative, so the directory can move), replacing
    ``path`` atomically (``ModelCheckpoint(save_last="link")``). Where the file system has no
    symbolic links, :func:`link_checkpoint` (as Lightning copies there)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.symlink.tmp")
    remove_checkpoint(temporary)
    try:
        os.symlink(os.path.relpath(source, path.parent), temporary)
    except OSError:
        link_checkpoint(source, path)
        return
    try:
        replace_atomic(temporary, path)
    except OSError as error:
        remove_checkpoint(temporary)
        raise OSError(error.errno, f"Could not link {path} to {source} ({error.strerror or error}); "
                                   f"{source} is complete and {path} is unchanged.") from error


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # no hard links here (some network file systems)
        shutil.copyfile(source, target)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or directory; nothing happens if it is not there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# =============================================================================================
# Plain data, and reading it back
# =============================================================================================
def check_plain(value: Any, where: str = "checkpoint") -> None:
    """Raise a TypeError naming the first value that ``torch.load(weights_only=True)`` would refuse."""
    if type(value) in _PLAIN_LEAVES:
        return
    if type(value) in _PLAIN_MAPPINGS:
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


def read_file(path: Path, map_location: Any = "cpu", what: str = "Checkpoint", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; every failure is a ValueError naming ``what`` and the fix.

    ``mmap``: map the file instead of reading it; a tensor's bytes are read only when it is used
    (to read a checkpoint's counters and callback states without its weights)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
        if unsafe:
            raise MisconfigurationException(
                f"Refusing to load {what.lower()} {path}: it contains a pickled {unsafe.group(1)}, which "
                "would run code when loaded. Cadence loads only tensors and plain data "
                "(torch.load(weights_only=True)), whatever weights_only= the Trainer's stages or "
                "load_from_checkpoint are given. If you trust the file, load it yourself and save "
                "the plain parts (state_dict()s) again."
            ) from error
        raise corrupted(path, error, what) from error
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError) as error:
        raise corrupted(path, error, what) from error


def corrupted(path: Path, error: BaseException, what: str = "Checkpoint") -> ValueError:
    """The error for a checkpoint that cannot be read: it names the checkpoint and the cause."""
    return ValueError(
        f"{what} {path} is truncated or corrupted ({_cause(error)}). Use an earlier checkpoint; Cadence "
        "writes checkpoints atomically, so this one was damaged after it was written or was not "
        "written by Cadence."
    )


def _cause(error: BaseException) -> str:
    """The first line of ``error`` that says what is wrong. torch's weights-only refusal opens with
    advice to load the file with ``weights_only=False``, which would run any code in it: that
    advice is never passed on, only the unpickler's own finding after it."""
    text = str(error).strip()
    text = text.partition("WeightsUnpickler error:")[2].strip() or text
    line = text.splitlines()[0].strip() if text else ""
    return line if line and "weights_only" not in line else type(error).__name__
