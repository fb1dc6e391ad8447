"""``TrainingModule.load_from_checkpoint``: a module rebuilt from a checkpoint's hyperparameters.

The checkpoint is read by ``strategies.checkpoint.read_checkpoint`` (``torch.load(weights_only=True)``),
so loading never runs code from the file; the class comes from the caller, the arguments of its
``__init__`` from the hyperparameters ``save_hyperparameters`` kept, and every argument that is
missing, or was saved only as a description (an object's repr), is asked for by name.
"""

from __future__ import annotations

import difflib
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from strategies import checkpoint as checkpoint_io
from callbacks.console import warn

if TYPE_CHECKING:
    from trainer.module import TrainingModule


def load_module(cls: type[TrainingModule], path: str | os.PathLike, map_location: Any, strict: bool,
                overrides: dict[str, Any]) -> TrainingModule:
    """``cls`` built from the hyperparameters in the checkpoint at ``path``, with its weights loaded."""
    state = checkpoint_io.read_checkpoint(path, map_location=_available_or_cpu if map_location is None else map_location)
    path = Path(path)
    module = cls(**init_arguments(cls, state, overrides, path))
    module.configure_model()
    module.on_load_checkpoint(state)
    checkpoint_io.load_weights(module, state, path, strict=strict)
    device = next((value.device for value in state["state_dict"].values() if isinstance(value, torch.Tensor)), None)
    return module.to(device) if device is not None else module


def init_arguments(cls: type, state: dict[str, Any], overrides: dict[str, Any], path: Path) -> dict[str, Any]:
    """The keyword arguments for ``cls(...)``: the saved hyperparameters, then the overrides."""
    saved = dict(state.get("hyper_parameters") or {})
    parameters = {name: parameter for name, parameter in inspect.signature(cls.__init__).parameters.items()
                  if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())

    def usage(names: list[str]) -> str:
        return f"{cls.__name__}.load_from_checkpoint(path, {', '.join(f'{name}=...' for name in names)})"

    if not takes_any:
        for name in overrides:
            if name not in parameters:
                close = difflib.get_close_matches(name, list(parameters), n=1)
                raise ValueError(
                    f"{cls.__name__}.load_from_checkpoint(..., {name}=...): {name!r} is not an argument of "
                    f"{cls.__name__}.__init__{f'; did you mean {close[0]!r}?' if close else ''} It takes {list(parameters)}."
                )
        left_out = sorted(name for name in saved if name not in parameters)
        if left_out:
            warn(f"Checkpoint {path} saved the hyperparameters {left_out}, which {cls.__name__}.__init__ no "
                 "longer takes; they are left out.")
            saved = {name: value for name, value in saved.items() if name in parameters}
    described = [name for name in state.get("hyper_parameters_inexact", []) if name in saved and name not in overrides]
    if described:
        raise ValueError(
            f"Checkpoint {path} could keep the hyperparameters {described} only as descriptions "
            f"({', '.join(f'{name}={saved[name]!r}' for name in described)}): a checkpoint holds plain data. "
            f"Pass them again: {usage(described)}."
        )
    arguments = {**saved, **overrides}
    missing = [name for name, parameter in parameters.items()
               if parameter.default is parameter.empty and name not in arguments]
    if missing:
        if not saved:
            where = (f"Checkpoint {path} holds no hyperparameters ({cls.__name__}.__init__ does not call "
                     "self.save_hyperparameters())")
            fix = " or call self.save_hyperparameters() in __init__ so that checkpoints keep them"
        else:
            where = (f"Checkpoint {path} holds the hyperparameters {sorted(saved)}, not {missing} (left out with "
                     "save_hyperparameters(ignore=...)?)")
            fix = ""
        raise ValueError(f"{where}, and {cls.__name__}.__init__ needs {missing}. Pass them: {usage(missing)}{fix}.")
    return arguments


def _available_or_cpu(storage: Any, location: str) -> Any:
    """``map_location=None``: tensors go where they were saved, or to the CPU when that kind of
    device is missing here (a checkpoint from a GPU machine opened on a laptop)."""
    if (location.startswith("cuda") and not torch.cuda.is_available()) or (
            location.startswith("mps") and not torch.backends.mps.is_available()):
        return storage.cpu()
    return None
