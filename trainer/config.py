"""Build a run from a YAML file: what ``cadence fit --config run.yaml`` reads.

The file names the module class, a function (or class) that returns the data loaders, and the
Trainer's arguments; any argument may itself be an object given by ``class_path``::

    model:
      class_path: examples.digits.DigitsClassifier
      init_args: {hidden: 128, lr: 3.0e-3}
    data:                                 # called; returns train_loader or (train_loader, val_loader)
      class_path: examples.digits.digits_loaders
      init_args: {batch_size: 64}
    trainer:                              # Trainer(**these)
      max_epochs: 30
      callbacks:
        - class_path: callbacks.EarlyStopping
          init_args: {monitor: val/acc, mode: max}
    ckpt_path: null                       # optional: a checkpoint to resume from, or "last"

Everything is checked against the signatures before anything is built or trained: an unknown key,
a missing required argument or a value of the wrong type fails with an error that names the key
and what is accepted. Class paths import as ``import`` would, with the current directory on the
path. Nothing in the file is executed: it is read with ``yaml.safe_load``.
"""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import os
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Callable

SECTIONS = ("model", "data", "trainer", "ckpt_path")


@dataclass
class Spec:
    """A class or function from the file, with keyword arguments already checked against it."""

    key: str  # where it is in the file, e.g. "trainer.callbacks[0]"
    target: Callable[..., Any]
    kwargs: dict[str, Any]

    def build(self) -> Any:
        return self.target(**{name: _build(value) for name, value in self.kwargs.items()})


@dataclass
class Run:
    """A checked run: build it with :meth:`fit`."""

    model: Spec
    data: Spec | None
    trainer: Spec
    ckpt_path: str | None

    def fit(self) -> Any:
        """Build the module, the loaders and the Trainer, then ``trainer.fit``; return the Trainer."""
        model = self.model.build()
        train_loader, val_loader = _loaders(self.data) if self.data is not None else (None, None)
        trainer = self.trainer.build()
        trainer.fit(model, train_loader, val_loader, ckpt_path=self.ckpt_path)
        return trainer


def load_config(path: str | os.PathLike, overrides: list[tuple[str, str]] = ()) -> dict[str, Any]:
    """Read the YAML file at ``path`` and apply ``overrides``, ``("trainer.max_epochs", "2")`` pairs
    whose values are read as YAML too."""
    import yaml  # lazily: importing trainer stays cheap

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Config file {path} does not exist.")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"Config file {path} is not valid YAML: {error}") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError(f"Config file {path} must be a mapping with keys {', '.join(SECTIONS)}; it holds a {type(config).__name__}.")
    for dotted, text in overrides:
        _set(config, dotted, yaml.safe_load(text))
    return config


def check_config(config: dict[str, Any]) -> Run:
    """Check every section against the signatures it names; return the run, nothing built yet."""
    from trainer.module import TrainingModule
    from trainer.shorthands import reject_unknown_arguments
    from trainer.trainer import Trainer

    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise ValueError(f"Unknown top-level key(s) {unknown} in the config; the keys are {', '.join(SECTIONS)}.")
    if "model" not in config:
        raise ValueError("The config has no 'model' section; add model: {class_path: package.module.YourModule}.")
    model = _spec("model", config["model"], must_be=TrainingModule)
    data = _spec("data", config["data"]) if config.get("data") is not None else None
    trainer_args = config.get("trainer") or {}
    if not isinstance(trainer_args, dict):
        raise ValueError(f"trainer must be a mapping of Trainer arguments; got {type(trainer_args).__name__}.")
    try:  # Trainer takes **unknown only to name the close match; the file is checked the same way
        reject_unknown_arguments({name: value for name, value in trainer_args.items()
                                  if name not in inspect.signature(Trainer).parameters or name == "unknown"}, Trainer.__init__)
    except TypeError as error:
        raise ValueError(f"trainer: {error}") from None
    trainer = Spec("trainer", Trainer, _checked_kwargs("trainer", Trainer, trainer_args))
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is not None and not isinstance(ckpt_path, str):
        raise ValueError(f"ckpt_path must be a path or 'last'; got {ckpt_path!r}.")
    return Run(model, data, trainer, ckpt_path)


def fit_from_config(path: str | os.PathLike, overrides: list[tuple[str, str]] = ()) -> Any:
    """``cadence fit``: load, check, build and fit; return the Trainer."""
    return check_config(load_config(path, overrides)).fit()


# --- checking -----------------------------------------------------------------------------------
def _spec(key: str, node: Any, must_be: type | None = None) -> Spec:
    if not isinstance(node, dict) or "class_path" not in node:
        raise ValueError(f"{key} must be a mapping with 'class_path' (and optional 'init_args'); got {node!r}.")
    unknown = sorted(set(node) - {"class_path", "init_args"})
    if unknown:
        raise ValueError(f"{key} has unknown key(s) {unknown}; it takes class_path and init_args.")
    init_args = node.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"{key}.init_args must be a mapping of argument names to values; got {init_args!r}.")
    target = _import(f"{key}.class_path", node["class_path"])
    if must_be is not None and not (isinstance(target, type) and issubclass(target, must_be)):
        raise ValueError(f"{key}.class_path names {_name(target)}, which is not a {must_be.__module__}.{must_be.__name__} subclass.")
    return Spec(key, target, _checked_kwargs(f"{key}.init_args", target, init_args))


def _import(key: str, class_path: Any) -> Callable[..., Any]:
    if not isinstance(class_path, str) or "." not in class_path:
        raise ValueError(f"{key} must be a dotted path such as 'package.module.Name'; got {class_path!r}.")
    module_name, _, attribute = class_path.rpartition(".")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the config import
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{key}: cannot import {module_name!r} ({error}). Check the path and the current directory.") from None
    if not hasattr(module, attribute):
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise ValueError(f"{key}: {module_name} has no {attribute!r}; it has {', '.join(public)}.")
    target = getattr(module, attribute)
    if not callable(target):
        raise ValueError(f"{key}: {class_path} is a {type(target).__name__}, not a class or function.")
    return target


def _checked_kwargs(key: str, target: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with nested class_path objects turned into Specs, checked against ``target``."""
    signature = inspect.signature(target)
    parameters = {name: p for name, p in signature.parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    accepted = ", ".join(parameters) or "no arguments"
    unknown = [name for name in arguments if name not in parameters and not takes_any]
    if unknown:
        raise ValueError(f"{key} has unknown key(s) {unknown}; {_name(target)} accepts: {accepted}.")
    missing = [name for name, p in parameters.items() if p.default is p.empty and name not in arguments]
    if missing:
        raise ValueError(f"{key} is missing {missing}, which {_name(target)} requires; it accepts: {accepted}.")
    kwargs = {name: _node(f"{key}.{name}", value) for name, value in arguments.items()}
    signature.bind(**kwargs)  # the same check Python makes at the call
    hints = _type_hints(target)
    for name, value in kwargs.items():
        if name in hints and not _matches(value, hints[name]):
            raise ValueError(_type_error(f"{key}.{name}", value, parameters[name].annotation, target))
    return kwargs


def _node(key: str, value: Any) -> Any:
    """A value from the file; a mapping with class_path becomes a Spec, in lists and dicts too."""
    if isinstance(value, dict) and "class_path" in value:
        return _spec(key, value)
    if isinstance(value, list):
        return [_node(f"{key}[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        return {name: _node(f"{key}.{name}", item) for name, item in value.items()}
    return value


def _type_hints(target: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # an annotation that does not evaluate here: skip type checks, keep name checks
        return {}


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a value from the file fits ``annotation``; what this cannot judge, it accepts."""
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, option) for option in typing.get_args(annotation))
    if isinstance(value, Spec):
        target = value.target
        check = origin or annotation
        return not (isinstance(target, type) and isinstance(check, type)) or issubclass(target, check)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type) and issubclass(annotation, (os.PathLike, PurePath)):
        return isinstance(value, (str, os.PathLike))
    if origin in (list, tuple, set, collections.abc.Sequence):
        arguments = typing.get_args(annotation)
        element = arguments[0] if arguments and origin is not tuple else Any
        return isinstance(value, (list, tuple)) and all(_matches(item, element) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type) and origin is None:
        return isinstance(value, annotation)  # a value read from YAML is plain data: never a Callback, say
    return True


def _type_error(key: str, value: Any, annotation: Any, target: Callable[..., Any]) -> str:
    wanted = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    message = f"{key}: got {_show(value)} ({type(value).__name__}); {_name(target)} takes {wanted}."
    if isinstance(value, str):
        try:
            float(value)
            message += f" YAML read {value!r} as text: write numbers with a dot and a signed exponent, e.g. 1.0e-3."
        except ValueError:
            pass
    return message


def _show(value: Any) -> str:
    if isinstance(value, Spec):
        return f"{_name(value.target)}(...)"
    if isinstance(value, list):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    return repr(value)


def _name(target: Any) -> str:
    return getattr(target, "__qualname__", type(target).__name__)


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if keys[0] not in SECTIONS or not all(keys):
        raise ValueError(f"Override --{dotted}: it must start with one of {', '.join(SECTIONS)}, e.g. --trainer.max_epochs=5.")
    node = config
    for depth, name in enumerate(keys[:-1]):
        child = node.setdefault(name, {})
        if child is None:
            child = node[name] = {}
        if not isinstance(child, dict):
            raise ValueError(f"Override --{dotted}: {'.'.join(keys[:depth + 1])} is {child!r}, not a mapping.")
        node = child
    node[keys[-1]] = value


# --- building -------------------------------------------------------------------------------------
def _build(value: Any) -> Any:
    if isinstance(value, Spec):
        return value.build()
    if isinstance(value, list):
        return [_build(item) for item in value]
    if isinstance(value, dict):
        return {name: _build(item) for name, item in value.items()}
    return value


def _loaders(data: Spec) -> tuple[Any, Any]:
    """Call the data function; it returns the training loader, or (training, validation)."""
    returned = data.build()
    if isinstance(returned, (list, tuple)):
        if len(returned) not in (1, 2):
            raise ValueError(f"data ({_name(data.target)}) returned {len(returned)} items; return train_loader or "
                             "(train_loader, val_loader).")
        return returned[0], (returned[1] if len(returned) == 2 else None)
    return returned, None
