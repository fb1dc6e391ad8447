"""What a checkpoint must hold, which one ``ckpt_path`` names, and loading it with clear errors.

How checkpoints lie on disk (one file written atomically by rank zero, or a directory of shards
under FSDP) is the strategy's (``Strategy.save_checkpoint``/``load_checkpoint``, with the storage in
``strategies/checkpoint_files.py`` and ``strategies/sharded_checkpoint.py``); both layouts load
without executing code. Here: the format version, resolving ``"last"``, checking that a checkpoint
can resume training and fits the model, with every failure naming the checkpoint and what to do.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

# save_atomic and check_plain are part of this module's interface (writing a file by hand).
from strategies.checkpoint_files import check_plain, recover_interrupted_replace, save_atomic  # noqa: F401
from strategies.sharded_checkpoint import check_complete, is_sharded_checkpoint, read_checkpoint

#: Bumped when the layout of a checkpoint changes, so an old reader can refuse a newer file.
FORMAT_VERSION = 1

#: What a full (resumable) checkpoint holds besides the weights.
TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "loops", "rng", "callbacks")


def plain_hyperparameters(hparams: Any) -> dict[str, Any]:
    """``hparams`` as plain data: paths and enums become their values, other objects their repr."""
    return {str(key): _plain(value) for key, value in dict(hparams).items()}


def inexact_hyperparameters(hparams: Any) -> list[str]:
    """The names in ``hparams`` whose plain form is not the value itself (an object kept as its repr,
    an enum as its value, a dtype as its name): ``load_from_checkpoint`` asks for those again."""
    return sorted(str(key) for key, value in dict(hparams).items() if not _exact(value))


def _exact(value: Any) -> bool:
    if type(value) in (str, int, float, bool, type(None)) or isinstance(value, (np.generic, PurePath, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_exact(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _exact(item) for key, item in value.items())
    return False


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
    """Read a whole checkpoint in this process: a file with ``weights_only=True``, or a sharded
    directory gathered into the same layout (on the CPU). Every failure names it and the fix.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: it would run code when unpickled, is truncated, incomplete or corrupted, is not
            a Cadence checkpoint, or was written by a newer Cadence.
    """
    path = check_exists(path)
    state = read_checkpoint(path, map_location)
    check_format(state, path)
    return state


def check_format(state: Any, path: Path) -> None:
    """Raise unless ``state`` is a Cadence checkpoint this version reads."""
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


def check_exists(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it is a checkpoint file or a whole sharded checkpoint directory; else a
    FileNotFoundError that says what is there (or a ValueError naming what a directory lacks)."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise FileNotFoundError(f"Checkpoint {path} is a directory but not a sharded checkpoint; pass the path "
                                    "of a .ckpt file inside it.")
        check_complete(path)
        return path
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist. Check the path, or pass ckpt_path=\"last\".")
    return path


def resolve_ckpt_path(ckpt_path: Any, stage: str, checkpoint_dirs: list[Path], versions: Path, warn: bool,
                      best: str | None = None) -> Path | None:
    """The checkpoint ``Trainer.<stage>(ckpt_path=...)`` loads, checked before anything starts.

    ``"last"`` is the newest ``last.ckpt`` (a file, or a sharded directory) in ``checkpoint_dirs``
    (the ModelCheckpoints' explicit dirpaths) if there are any, else under
    ``<versions>/version_*/checkpoints/`` (``versions``: the run's ``<default_root_dir>/cadence_logs``,
    or its first logger's ``<save_dir>/<name>``). When there is none, ``fit`` starts from scratch
    (returns None, with a warning if ``warn``), so one command both starts a run and resumes it;
    the other stages need a checkpoint. ``"best"`` (validate, test, predict) is ``best``, the
    ModelCheckpoint's ``best_model_path`` (None: there is no ModelCheckpoint).
    """
    if not isinstance(ckpt_path, (str, os.PathLike)):
        names = '"last"' if stage == "fit" else '"last", "best"'
        raise TypeError(f"Trainer.{stage}(ckpt_path={ckpt_path!r}): pass a checkpoint path, {names} or None.")
    if str(ckpt_path) == "best":
        return _best(stage, best)
    if str(ckpt_path) != "last":
        recover_interrupted_replace(Path(ckpt_path))
        return check_exists(ckpt_path)
    if checkpoint_dirs:
        candidates, where = [d / "last.ckpt" for d in checkpoint_dirs], " or ".join(map(str, checkpoint_dirs))
    else:
        candidates = list(versions.glob("version_*/checkpoints/last.ckpt"))
        candidates += [path.with_name("last.ckpt") for path in versions.glob("version_*/checkpoints/.last.ckpt.*.old")]
        where = f"{versions}/version_*/checkpoints"
    for candidate in candidates:
        recover_interrupted_replace(candidate)
    candidates = [candidate for candidate in set(candidates) if candidate.is_file() or is_sharded_checkpoint(candidate)]
    if candidates:
        return check_exists(max(candidates, key=os.path.getmtime))
    if stage != "fit":
        raise FileNotFoundError(f"Trainer.{stage}(ckpt_path=\"last\") found no last.ckpt in {where}. Pass a checkpoint path.")
    if warn:
        warnings.warn(f"fit(ckpt_path=\"last\") found no last.ckpt in {where}; training starts from scratch.", stacklevel=5)
    return None


def _best(stage: str, best: str | None) -> Path:
    if stage == "fit":
        raise ValueError('Trainer.fit(ckpt_path="best"): fit continues from "last" or a checkpoint file; "best" '
                         "loads the best weights into validate, test or predict.")
    if best is None:
        raise ValueError(f'Trainer.{stage}(ckpt_path="best") loads the best checkpoint of a callbacks.ModelCheckpoint, '
                         'and this Trainer has none. Pass ckpt_path="last" or a path.')
    if not best:
        raise FileNotFoundError(f'Trainer.{stage}(ckpt_path="best"): the ModelCheckpoint has saved no ranked checkpoint '
                                'yet (no fit ran with it, or save_top_k=0). Pass ckpt_path="last" or a path.')
    return check_exists(best)


def check_resumable(state: dict[str, Any], path: Path) -> None:
    """Raise unless ``state`` holds the training state that ``fit(ckpt_path=...)`` continues from."""
    missing = [key for key in TRAINING_STATE_KEYS if key not in state]
    if missing and state.get("weights_only"):
        raise ValueError(
            f"Checkpoint {path} holds weights only (written with ModelCheckpoint(save_weights_only=True) or "
            "save_checkpoint(path, weights_only=True)): no optimizer, scheduler or loop state, so fit cannot resume "
            "from it. To train on from these weights, build the module with YourModule.load_from_checkpoint(path) "
            "and call fit without ckpt_path; to resume, use a checkpoint saved without save_weights_only."
        )
    if missing:
        raise ValueError(
            f"Checkpoint {path} holds weights but not the training state ({', '.join(missing)} "
            "missing), so fit cannot resume from it. To start a new run from these weights, load "
            "them with model.load_state_dict(...) and call fit without ckpt_path."
        )


def load_weights(module: torch.nn.Module, state: dict[str, Any], path: Path, strict: bool = True) -> None:
    """``module.load_state_dict`` with an error that names the file and every key that differs.

    ``strict=False`` loads the keys both have and warns about the others; shapes must match.
    """
    check_weights(module, state, path, strict)
    module.load_state_dict(state["state_dict"], strict=strict)


def check_weights(module: torch.nn.Module, state: dict[str, Any], path: Path, strict: bool = True) -> None:
    """Raise a ValueError naming the checkpoint and every key or shape in which it differs from
    ``module`` (with ``strict=False``, warn about the keys and raise for the shapes only)."""
    weights = state["state_dict"]
    expected = module.state_dict()
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if (missing or unexpected) and not strict:
        warnings.warn(f"Loaded {path} into {type(module).__name__} with strict=False: missing keys {_few(missing)}, "
                      f"unexpected keys {_few(unexpected)} (left as they are).", stacklevel=4)
    elif missing or unexpected:
        raise ValueError(
            f"Checkpoint {path} does not fit {type(module).__name__}: missing keys {_few(missing)}, "
            f"unexpected keys {_few(unexpected)}. Load it into the model class (and configuration) "
            "that wrote it."
        )
    mismatched = [f"{key}: checkpoint {tuple(weights[key].shape)}, model {tuple(value.shape)}"
                  for key, value in expected.items()
                  if key in weights and isinstance(value, torch.Tensor) and isinstance(weights[key], torch.Tensor)
                  and weights[key].shape != value.shape]
    if mismatched:
        raise ValueError(
            f"Checkpoint {path} does not fit {type(module).__name__}: shapes differ for "
            f"{_few(mismatched)}. Build the model with the hyperparameters that wrote it "
            f"({state.get('hyper_parameters', {})})."
        )


def load_optimizers(optimizers: list[torch.optim.Optimizer], schedulers: list[Any], state: dict[str, Any],
                    path: Path, load_state: Callable[[torch.optim.Optimizer, dict], None] | None = None) -> None:
    """Load optimizer and scheduler states; a different count or parameter layout is an error.
    ``load_state(optimizer, state)`` loads one optimizer's (default: ``optimizer.load_state_dict``)."""
    for what, objects, states in (("optimizers", optimizers, state["optimizer_states"]),
                                  ("LR schedulers", schedulers, state["lr_schedulers"])):
        if len(objects) != len(states):
            raise ValueError(
                f"Checkpoint {path} has {len(states)} {what}, but configure_optimizers returned "
                f"{len(objects)}. Resume with the configure_optimizers that wrote it."
            )
    for index, (optimizer, optimizer_state) in enumerate(zip(optimizers, state["optimizer_states"])):
        try:
            if load_state is None:
                optimizer.load_state_dict(optimizer_state)
            else:
                load_state(optimizer, optimizer_state)
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


def convert_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Write the checkpoint ``source`` (a sharded directory written under FSDP) as one file at
    ``target``: a plain Cadence checkpoint with the whole weights, the optimizer states by parameter
    index and the rest of the training state. It loads into the module on one device
    (``model.load_state_dict(torch.load(target, weights_only=True)["state_dict"])``) and resumes
    ``fit`` under any strategy. Needs memory for the whole model, in this one process.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_checkpoint`; ValueError when ``target`` is ``source``.
        OSError: the file could not be written (any previous file at ``target`` is intact).
    """
    target = Path(target)
    if target.exists() and target.resolve() == Path(source).resolve():
        raise ValueError(f"convert_checkpoint({str(source)!r}, {str(target)!r}): the target is the source; "
                         "name a new file, e.g. model.ckpt.")
    if target.is_dir():
        raise ValueError(f"convert_checkpoint: the target {target} is a directory; name the file to write, "
                         f"e.g. {target / 'model.ckpt'}.")
    return save_atomic(load_checkpoint(source), target)
