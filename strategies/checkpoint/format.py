"""The checkpoint format: what a Cadence checkpoint file must look like, and whether it fits a model.

A checkpoint is a dict of tensors and plain data (``trainer/state.py`` says what the Trainer puts
in it): the weights (``state_dict``), the training state (:data:`TRAINING_STATE_KEYS`), the
hyperparameters as plain data (:func:`plain_hyperparameters`), and the :data:`FORMAT_VERSION`
that wrote it. :func:`check_format` runs on every read (``strategies.checkpoint.read_checkpoint``);
the checks that it fits a model and its optimizers (:func:`check_weights`,
:func:`load_optimizers`) name the checkpoint and every key or shape that differs.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from callbacks.console import MisconfigurationException

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
    if type(value) is tuple:  # a tuple stays a tuple (an image shape added to a tuple when loaded)
        return tuple(_plain(item) for item in value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(item) for item in value]
    return repr(value)


# =============================================================================================
# Checks: is it a checkpoint this Cadence reads, can it resume, does it fit the model
# =============================================================================================
def check_format(state: Any, path: Path, weights: bool = True) -> None:
    """Raise unless ``state`` is a Cadence checkpoint this version reads (with its weights, unless
    ``weights`` is False: a sharded checkpoint's state file, read without its shards)."""
    if not isinstance(state, dict) or (weights and "state_dict" not in state):
        what = f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) else type(state).__name__
        raise MisconfigurationException(
            f"{path} is not a Cadence checkpoint: it has no 'state_dict' (it holds {what}). To start "
            "from bare weights, load them with model.load_state_dict(...) and call fit without ckpt_path."
        )
    if state.get("format", FORMAT_VERSION) > FORMAT_VERSION:
        raise MisconfigurationException(
            f"Checkpoint {path} has format {state['format']}, newer than this Cadence reads "
            f"({FORMAT_VERSION}); it was written by Cadence {state.get('versions', {}).get('cadence')}. "
            "Upgrade torchcadence."
        )


def check_resumable(state: dict[str, Any], path: Path) -> None:
    """Raise unless ``state`` holds the training state that ``fit(ckpt_path=...)`` continues from."""
    missing = [key for key in TRAINING_STATE_KEYS if key not in state]
    if missing and state.get("weights_only"):
        raise MisconfigurationException(
            f"Checkpoint {path} holds weights only (written with ModelCheckpoint(save_weights_only=True) or "
            "save_checkpoint(path, weights_only=True)): no optimizer, scheduler or loop state, so fit cannot resume "
            "from it. To train on from these weights, build the module with YourModule.load_from_checkpoint(path) "
            "and call fit without ckpt_path; to resume, use a checkpoint saved without save_weights_only."
        )
    if missing:
        raise MisconfigurationException(
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
        raise MisconfigurationException(
            f"Checkpoint {path} does not fit {type(module).__name__}: missing keys {_few(missing)}, "
            f"unexpected keys {_few(unexpected)}. Load it into the model class (and configuration) "
            "that wrote it."
        )
    mismatched = [f"{key}: checkpoint {tuple(weights[key].shape)}, model {tuple(value.shape)}"
                  for key, value in expected.items()
                  if key in weights and isinstance(value, torch.Tensor) and isinstance(weights[key], torch.Tensor)
                  and weights[key].shape != value.shape]
    if mismatched:
        raise MisconfigurationException(
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
            raise MisconfigurationException(
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
            raise MisconfigurationException(
                f"Checkpoint {path}: optimizer {index} ({type(optimizer).__name__}) does not fit: {error} "
                "Resume with the model and configure_optimizers that wrote it."
            ) from error
    for scheduler, scheduler_state in zip(schedulers, state["lr_schedulers"]):
        scheduler.load_state_dict(scheduler_state)


def _few(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit]) or "none"
    return f"[{shown}{f', ... ({len(items) - limit} more)' if len(items) > limit else ''}]"
