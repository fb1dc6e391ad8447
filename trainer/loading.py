"""``load_from_checkpoint``: a TrainingModule (or DataModule) rebuilt from a checkpoint's hyperparameters.

The checkpoint is read by ``strategies.checkpoint.read_checkpoint`` (``torch.load(weights_only=True)``),
so loading never runs code from the file; the class comes from the caller, the arguments of its
``__init__`` from the hyperparameters ``save_hyperparameters`` kept, and every argument that is
missing, or was saved only as a description (an object's repr), is asked for by name.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from strategies import checkpoint as checkpoint_io
from callbacks.console import MisconfigurationException, warn
from trainer.hparams import HParams

if TYPE_CHECKING:
    from trainer.datamodule import DataModule
    from trainer.module import TrainingModule


class class_only_method(classmethod):
    """``load_from_checkpoint``'s decorator, as Lightning's ``_restricted_classmethod``: called on an instance
    (``model.load_from_checkpoint(path)``, which would leave ``model`` untouched and return a new object) it
    raises a TypeError with Lightning's words; on the class it is a classmethod."""

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        bound = super().__get__(instance, owner)
        if instance is None:
            return bound
        method = self.__func__

        @functools.wraps(method)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"The classmethod `{type(instance).__name__}.{method.__name__}` cannot be called on an instance. "
                            "Please call it on the class type and make sure the return value is used.")
        return refuse


def load_module(cls: type[TrainingModule], path: str | os.PathLike, map_location: Any, strict: bool | None,
                overrides: dict[str, Any], hparams_file: str | os.PathLike | None = None) -> TrainingModule:
    """``cls`` built from the hyperparameters in the checkpoint at ``path``, with its weights loaded."""
    state = checkpoint_io.read_checkpoint(path, map_location=_available_or_cpu if map_location is None else map_location)
    path = Path(path)
    module = cls(**init_arguments(cls, state, overrides, path, hparams_file))
    module.configure_model()
    module.on_load_checkpoint(state)
    if not state["state_dict"]:
        warn(f"The state dict in {str(path)!r} contains no parameters: {cls.__name__} keeps the weights it was "
             "built with.")
    checkpoint_io.load_weights(module, state, path, strict=module.strict_loading if strict is None else strict)
    device = next((value.device for value in state["state_dict"].values() if isinstance(value, torch.Tensor)), None)
    return module.to(device) if device is not None else module


def load_datamodule(cls: type[DataModule], path: str | os.PathLike, map_location: Any,
                    hparams_file: str | os.PathLike | None, weights_only: bool | None,
                    overrides: dict[str, Any]) -> DataModule:
    """``cls`` built from the hyperparameters the checkpoint at ``path`` kept of the run's DataModule,
    with the ``state_dict`` it kept loaded (its weights are not read)."""
    state = checkpoint_io.read_checkpoint(path, map_location=_available_or_cpu if map_location is None else map_location,
                                          weights=False)
    datamodule = cls(**init_arguments(cls, state, overrides, Path(path), hparams_file))
    restore_datamodule_state(datamodule, state)
    return datamodule


def restore_datamodule_state(datamodule: DataModule, checkpoint: dict[str, Any]) -> None:
    """Load into ``datamodule`` the state a checkpoint kept of it: under its class's ``__qualname__``
    (Lightning's key, which Cadence writes), or under ``"datamodule"`` (Cadence's checkpoints before
    it wrote Lightning's key). Nothing is loaded when neither is there (an empty state is not written)."""
    state = checkpoint.get(type(datamodule).__qualname__, checkpoint.get("datamodule"))
    if state:
        datamodule.load_state_dict(state)


def init_arguments(cls: type, state: dict[str, Any], overrides: dict[str, Any], path: Path,
                   hparams_file: str | os.PathLike | None = None) -> dict[str, Any]:
    """The keyword arguments for ``cls(...)``: the saved hyperparameters (or those of ``hparams_file``),
    then the overrides. Hyperparameters saved from one dict or Namespace argument are passed as it."""
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if hparams_file is not None:
        saved = _read_hparams_file(hparams_file)
    else:  # a module's from Lightning before 1.0 under its keys of then, as Lightning still reads them
        past = _PAST_HPARAMS_KEYS if hasattr(cls, "training_step") else ()
        saved = {name: value for each in (*past, key) for name, value in (state.get(each) or {}).items()}
    parameters = {name: parameter for name, parameter in inspect.signature(cls.__init__).parameters.items()
                  if name != "self" and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    container = state.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    if saved and container in parameters and container != "kwargs":  # save_hyperparameters(config)
        saved = {container: HParams(saved)}

    def usage(names: list[str]) -> str:
        return f"{cls.__name__}.load_from_checkpoint(path, {', '.join(f'{name}=...' for name in names)})"

    if not takes_any:
        unknown = [name for name in overrides if name not in parameters]
        for name in unknown:
            close = difflib.get_close_matches(name, list(parameters), n=1)
            warn(f"{cls.__name__}.load_from_checkpoint(..., {name}=...): {name!r} is not an argument of "
                 f"{cls.__name__}.__init__, so it is left out{f' (did you mean {close[0]!r}?)' if close else ''}. "
                 f"It takes {list(parameters)}.")
        overrides = {name: value for name, value in overrides.items() if name not in unknown}
        left_out = sorted(name for name in saved if name not in parameters)
        if left_out:
            warn(f"Checkpoint {path} saved the hyperparameters {left_out}, which {cls.__name__}.__init__ no "
                 "longer takes; they are left out.")
            saved = {name: value for name, value in saved.items() if name in parameters}
    inexact = [] if hparams_file is not None else state.get(f"{key}_inexact", [])
    described = [name for name in inexact if name in saved and name not in overrides]
    if described:
        raise MisconfigurationException(
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
        raise MisconfigurationException(
            f"{where}, and {cls.__name__}.__init__ needs {missing}. Pass them: {usage(missing)}{fix}.")
    return arguments


_PAST_HPARAMS_KEYS = ("hparams", "module_arguments")  # Lightning's CHECKPOINT_PAST_HPARAMS_KEYS (0.7.6), oldest first


def _read_hparams_file(path: str | os.PathLike) -> dict[str, Any]:
    """``load_from_checkpoint(hparams_file=...)``: the hyperparameters of a logger's ``hparams.yaml``."""
    import yaml  # only here: importing trainer stays cheap

    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise MisconfigurationException(
            f"load_from_checkpoint(hparams_file={str(path)!r}): a .yaml file is read (the hparams.yaml "
            "a logger writes); .csv hyperparameter files are not. Pass the hparams.yaml.")
    with open(path) as file:
        hparams = yaml.safe_load(file)
    if hparams is None:
        return {}
    if not isinstance(hparams, dict):
        raise MisconfigurationException(
            f"load_from_checkpoint(hparams_file={str(path)!r}): the file holds a "
            f"{type(hparams).__name__}, not a mapping of hyperparameter names to values.")
    return hparams


def _available_or_cpu(storage: Any, location: str) -> Any:
    """``map_location=None``: tensors go where they were saved, or to the CPU when that kind of
    device is missing here (a checkpoint from a GPU machine opened on a laptop)."""
    if (location.startswith("cuda") and not torch.cuda.is_available()) or (
            location.startswith("mps") and not torch.backends.mps.is_available()):
        return storage.cpu()
    return None
