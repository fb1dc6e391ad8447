"""Which checkpoint a path, ``"last"`` or ``"best"`` names, found before anything starts.

A checkpoint is a file, or a directory of shards written under FSDP (:func:`is_checkpoint`); a
kill between the two renames of replacing one leaves the previous one aside, and it is moved back
here before anyone looks (:func:`~strategies.checkpoint.files.recover_interrupted_replace`). Nothing
here needs a Trainer: the Trainer (``trainer/stage.py``) and the command line (``trainer/cli/runs.py``)
pass the directories they know of.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from callbacks.console import MisconfigurationException, refuse_url
from strategies.checkpoint.files import recover_interrupted_replace
from strategies.checkpoint.sharded import check_complete, is_sharded_checkpoint

#: The checkpoint ``ckpt_path="last"`` resumes from, in a ModelCheckpoint's directory.
LAST = "last.ckpt"


def is_checkpoint(path: Path) -> bool:
    """True for a checkpoint file or a (possibly incomplete) sharded checkpoint directory."""
    return path.is_file() or is_sharded_checkpoint(path)


def check_exists(path: str | os.PathLike, hint: str = "Check the path.") -> Path:
    """``path`` as a Path if it is a checkpoint file or a whole sharded checkpoint directory; else a
    FileNotFoundError that says what is there and ends with ``hint`` (or a ValueError naming what a
    sharded directory lacks)."""
    refuse_url(path, "checkpoint")  # Lightning reads it through fsspec
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise FileNotFoundError(f"Checkpoint {path} is a directory but not a sharded checkpoint; pass the path "
                                    "of a .ckpt file inside it.")
        check_complete(path)
        return path
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: {path} does not exist. {hint}")  # Lightning's words first
    return path


def run_checkpoint_directories(versions: Path) -> list[Path]:
    """``<versions>/version_*/checkpoints``: where each run's ModelCheckpoint writes by default."""
    return sorted(versions.glob("version_*/checkpoints"))


def newest_last(directories: Iterable[Path]) -> Path | None:
    """The newest ``last.ckpt`` (a file or a sharded directory) in ``directories``, or None."""
    candidates = {Path(directory) / LAST for directory in directories}
    for candidate in candidates:
        recover_interrupted_replace(candidate)
    found = [candidate for candidate in candidates if is_checkpoint(candidate)]
    return max(found, key=os.path.getmtime) if found else None


def resolve_ckpt_path(ckpt_path: Any, stage: str, checkpoint_dirs: list[Path], versions: Path, warn: bool,
                      best: str | None = None, also_last: Iterable[Path] = ()) -> Path | None:
    """The checkpoint ``Trainer.<stage>(ckpt_path=...)`` loads, checked before anything starts.

    ``"last"`` is the newest ``last.ckpt`` (a file, or a sharded directory) in ``checkpoint_dirs``
    (the ModelCheckpoints' explicit dirpaths) if there are any, else under
    ``<versions>/version_*/checkpoints/`` (``versions``: the run's ``<default_root_dir>/lightning_logs``,
    or its first logger's ``<save_dir>/<name>``). When there is none, nothing is loaded (returns None,
    with a warning if ``warn``), as in Lightning: ``fit`` starts from scratch, so one command both
    starts a run and resumes it, and the other stages run the module's own weights. ``"best"`` is
    ``best``, the ModelCheckpoint's ``best_model_path`` (None: there is no ModelCheckpoint); ``fit``
    continues from it, as in Lightning. ``also_last``: more candidates for ``"last"`` (an
    ``OnExceptionCheckpoint``'s file, as in Lightning): the newest wins.
    Lightning's ``"hpc"`` and ``"registry"`` are refused with the Cadence way.
    """
    if not isinstance(ckpt_path, (str, os.PathLike)):
        raise TypeError(f'Trainer.{stage}(ckpt_path={ckpt_path!r}): pass a checkpoint path, "last", "best" or None.')
    _refuse_lightning_sources(ckpt_path, stage)
    if str(ckpt_path) == "best":
        return _best(stage, best)
    if str(ckpt_path) != "last":
        recover_interrupted_replace(Path(ckpt_path))
        return check_exists(ckpt_path, hint='Check the path, or pass ckpt_path="last".')
    if checkpoint_dirs:
        last, where = newest_last(checkpoint_dirs), " or ".join(map(str, checkpoint_dirs))
    else:
        last, where = newest_last(run_checkpoint_directories(versions)), f"{versions}/version_*/checkpoints"
    found = [path for path in (last, *map(Path, also_last)) if path is not None and is_checkpoint(path)]
    last = max(found, key=os.path.getmtime) if found else None
    if last is not None:
        return check_exists(last)
    if warn and stage == "fit":
        warnings.warn(f".fit(ckpt_path=\"last\") is set, but there is no last checkpoint available. No checkpoint will be "
                      f"loaded: found no last.ckpt in {where}; training starts from scratch.", stacklevel=5)
    elif warn:  # as Lightning: not an error, so that "last" can be set before the first fit has written one
        warnings.warn(f".{stage}(ckpt_path=\"last\") is set, but there is no last checkpoint available. No checkpoint will "
                      f"be loaded: found no last.ckpt in {where}; the module keeps its weights. Pass a checkpoint path "
                      "to load one.", stacklevel=6)
    return None


def _refuse_lightning_sources(ckpt_path: Any, stage: str) -> None:
    """Lightning's ``ckpt_path="hpc"`` (its SLURM requeue checkpoints) and ``"registry[:name]"`` (its model
    registry, through the litmodels package), which Cadence does not have, refused with the Cadence way."""
    text = str(ckpt_path)
    if text == "hpc":
        raise MisconfigurationException(
            f'Trainer.{stage}(ckpt_path="hpc") loads Lightning\'s SLURM requeue checkpoint (hpc_ckpt_N.ckpt), '
            "which Cadence does not write: on SIGTERM or SIGUSR1 it saves last.ckpt and stops. Pass "
            'ckpt_path="last" (in the requeued job too) or a path.')
    if text.lower() == "registry" or text.lower().startswith("registry:"):
        raise MisconfigurationException(
            f"Trainer.{stage}(ckpt_path={text!r}) downloads from Lightning's model registry (litmodels); "
            "Cadence reads local checkpoint files only. Download the checkpoint and pass its path.")


def _best(stage: str, best: str | None) -> Path:
    if best is None:
        raise MisconfigurationException(
            f'Trainer.{stage}(ckpt_path="best") loads the best checkpoint of a callbacks.ModelCheckpoint, '
            'and this Trainer has none. Pass ckpt_path="last" or a path.')
    if not best:
        raise FileNotFoundError(f'Trainer.{stage}(ckpt_path="best"): the ModelCheckpoint has saved no ranked checkpoint '
                                'yet (no fit ran with it, or save_top_k=0). Pass ckpt_path="last" or a path.')
    return check_exists(best)
