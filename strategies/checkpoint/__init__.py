"""Checkpoint files: the one home of how checkpoints lie on disk, are found, written and read.

The Trainer, the strategies and ``ModelCheckpoint`` all import from here (it sits in
``strategies``, the lowest of the three packages, so that every one of them imports it downward).
What a checkpoint holds, and putting it back into a run, is the Trainer's (``trainer/state.py``).

    files.py    one file written atomically (snapshot, then write), read with weights_only=True;
                directories swapped into place; links and removal for ModelCheckpoint
    sharded.py  a directory of shards written and read with torch.distributed.checkpoint (FSDP)
    format.py   the format version, what a resumable checkpoint holds, whether one fits a model
    lightning.py  Lightning's keys written into Cadence's checkpoints; Lightning's checkpoints read
    paths.py    which checkpoint a path, "last" or "best" names

Reading: every reader goes through :func:`read_checkpoint`. From ``Trainer.fit(ckpt_path=...)``
to the bytes read::

    Trainer.fit -> Trainer._launch -> prepare_launch (trainer/stage.py)
        -> resolve_ckpt_path (paths.py): "last", "best" or a path, checked before any process starts
    in each process: Trainer._run_fit -> read_checkpoint (trainer/state.py; a DataModule's state is
        restored from it before its loaders are made) -> Strategy.load_checkpoint (strategies/base.py;
        FSDP passes how each rank reads its part of the shards) -> read_checkpoint (here)
        -> read_file (files.py) -> torch.load(weights_only=True); or, for a sharded directory, its
        state file so, and its shards through DCP (sharded.py); a file Lightning wrote is
        translated (lightning.py)
    then restore (trainer/state.py) puts the state read into the module, optimizers and loop.

validate, test and predict take the same path with the weights only; ``load_from_checkpoint``
(``trainer/loading.py``), ``cadence convert-checkpoint`` (:func:`convert_checkpoint`) and the
command line's ``--ckpt_path best`` (``trainer/cli/runs.py``, ``weights=False``) call
:func:`read_checkpoint` directly. Reading never runs code from the file, and every failure names
the checkpoint and what to do.

Writing: ``Trainer.save_checkpoint`` (which ``ModelCheckpoint`` calls) -> ``write_checkpoint``
(trainer/state.py gathers the state) -> ``Strategy.save_checkpoint``: rank zero's
:func:`save_atomic`, which is :func:`snapshot` (checked plain; ``to_host`` copies it off the
device) then :func:`write_file` (serialize, fsync, atomic rename; it may run in the background);
under FSDP every rank writes its shards into a staging directory renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from callbacks.console import MisconfigurationException
from strategies.checkpoint.files import (
    check_plain, corrupted, link_checkpoint, read_file, recover_interrupted_replace, remove_checkpoint,
    replace_atomic, save_atomic, snapshot, staging_directory, symlink_checkpoint, write_file,
)
from strategies.checkpoint.format import (
    FORMAT_VERSION, TRAINING_STATE_KEYS, check_format, check_resumable, check_weights, inexact_hyperparameters,
    load_optimizers, load_weights, plain_hyperparameters,
)
from strategies.checkpoint.lightning import (
    LIGHTNING_LAYOUT_VERSION, from_lightning, is_lightning_checkpoint, lightning_keys, lightning_loops,
)
from strategies.checkpoint.paths import (
    LAST, check_exists, is_checkpoint, newest_last, resolve_ckpt_path, run_checkpoint_directories,
)
from strategies.checkpoint.sharded import STATE_FILE, read_whole_shards

__all__ = [
    "FORMAT_VERSION", "LAST", "LIGHTNING_LAYOUT_VERSION", "STATE_FILE", "TRAINING_STATE_KEYS", "check_exists", "check_format", "check_plain",
    "check_resumable", "check_weights", "convert_checkpoint", "inexact_hyperparameters", "is_checkpoint",
    "lightning_keys", "lightning_loops", "link_checkpoint", "load_optimizers", "load_weights", "newest_last", "plain_hyperparameters", "read_checkpoint",
    "read_file", "recover_interrupted_replace", "remove_checkpoint", "replace_atomic", "resolve_ckpt_path",
    "run_checkpoint_directories", "save_atomic", "snapshot", "staging_directory", "symlink_checkpoint", "write_file",
]


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", *,
                    shards: Callable[[Path], dict[str, Any]] | None = None, weights: bool = True) -> dict[str, Any]:
    """The checkpoint at ``path``, read safely and checked: the one read path of every reader.

    Args:
        path: a checkpoint file, or a sharded checkpoint directory (written under FSDP). A file
            Lightning wrote is returned in Cadence's layout (:func:`~strategies.checkpoint.lightning.from_lightning`).
        map_location: where a file's tensors go, as for ``torch.load``.
        shards: how this process reads a sharded directory's shards, ``shards(path)`` returning
            ``{"state_dict": ..., "optimizer_states": ...}``. Default: whole, on the CPU, in this
            process (:func:`~strategies.checkpoint.sharded.read_whole_shards`); FSDP reads each
            rank's part into its sharded parameters.
        weights: False reads the plain data only (counters, callbacks' states, hyperparameters):
            a file is memory-mapped, so no tensor's bytes are read, and of a sharded directory
            only its state file is.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory that is no checkpoint.
        ValueError: it would run code when unpickled, is truncated, incomplete or corrupted, is not
            a Cadence checkpoint, or was written by a newer Cadence.
    """
    path = check_exists(path)
    if path.is_dir():
        state = read_file(path / STATE_FILE)
        if not isinstance(state, dict):
            raise corrupted(path, TypeError(f"{STATE_FILE} holds a {type(state).__name__}"))
        if weights:
            state.update((shards or read_whole_shards)(path))
    else:
        state = read_file(path, map_location, mmap=not weights)
        if is_lightning_checkpoint(state):
            state = from_lightning(state)
    check_format(state, path, weights=weights or not path.is_dir())
    return state


def convert_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Write the checkpoint ``source`` (a sharded directory written under FSDP) as one file at
    ``target``: a plain Cadence checkpoint with the whole weights, the optimizer states by parameter
    index and the rest of the training state. It loads into the module on one device
    (``model.load_state_dict(torch.load(target, weights_only=True)["state_dict"])``) and resumes
    ``fit`` under any strategy. Needs memory for the whole model, in this one process.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_checkpoint`; ValueError when ``target`` is ``source``.
        OSError: the file could not be written (any previous file at ``target`` is intact).
    """
    target = Path(target)
    if target.exists() and target.resolve() == Path(source).resolve():
        raise MisconfigurationException(
            f"convert_checkpoint({str(source)!r}, {str(target)!r}): the target is the source; "
            "name a new file, e.g. model.ckpt.")
    if target.is_dir():
        raise MisconfigurationException(
            f"convert_checkpoint: the target {target} is a directory; name the file to write, "
            f"e.g. {target / 'model.ckpt'}.")
    return save_atomic(read_checkpoint(source), target)
