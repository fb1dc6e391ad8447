"""One object of a run's configuration: a ``class_path`` with ``init_args``, checked and built.

:func:`make_spec` imports the class or function a ``class_path`` names and checks ``init_args``
against its signature (names, required arguments, types; nested ``class_path`` objects too) before
anything is built; every error is a :class:`ConfigError` naming the key. :meth:`Spec.build` makes
the object, turning a value it refuses into a one-line :class:`BuildError`, and
:meth:`Spec.resolved` writes it back as plain data with every default filled in.
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import os
import pkgutil
import sys
import sysconfig
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Callable

from callbacks.console import MisconfigurationException
from callbacks.refused import Refused
from trainer.cli.config_files import ConfigError

#: Where a class_path without a dot is looked up, in this order.
SHORT_NAME_MODULES = ("callbacks", "strategies", "torch.optim", "torch.optim.lr_scheduler")
#: Where code that is not the user's lives: Cadence's packages (beside trainer/, which holds this
#: file as trainer/cli/specs.py), the standard library, installed packages.
_NOT_YOURS = tuple({*(str(Path(__file__).resolve().parents[2] / name) + os.sep for name in ("trainer", "strategies", "callbacks")),
                    *(str(Path(path).resolve()) + os.sep for key, path in sysconfig.get_paths().items()
                      if key in ("stdlib", "platstdlib", "purelib", "platlib"))})


@dataclass
class Spec:
    """A class or function from the file, with keyword arguments already checked against it.

    ``positional`` leading parameters are not in the file: the caller passes them to :meth:`build`
    (an optimizer's parameters, a scheduler's optimizer).
    """

    key: str  # where it is in the file, e.g. "trainer.callbacks[0]"
    class_path: str  # spelled out: "callbacks.EarlyStopping", not "EarlyStopping"
    target: Callable[..., Any]
    kwargs: dict[str, Any]
    positional: int = 0

    def build(self, *arguments: Any) -> Any:
        return self.target(*arguments, **{name: _build(value) for name, value in self.kwargs.items()})

    def resolved(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": {...}}`` with every default that YAML can hold."""
        init_args = {}
        for parameter in _named_parameters(self.target)[self.positional:]:
            if parameter.name in self.kwargs:
                init_args[parameter.name] = plain(self.kwargs[parameter.name])
            elif plain(parameter.default) is not _NOT_PLAIN:
                init_args[parameter.name] = plain(parameter.default)
        init_args.update({name: plain(value) for name, value in self.kwargs.items() if name not in init_args})
        return {"class_path": self.class_path, "init_args": init_args}


class BuildError(MisconfigurationException):
    """An object of the run refused the values it was given (its own one-line message)."""


# =============================================================================================
# Checking, before anything is built
# =============================================================================================
def make_spec(key: str, node: Any, must_be: type | None = None, positional: int = 0,
              extra: Callable[[Any], set[str]] | None = None) -> Spec:
    """The ``{class_path, init_args}`` mapping at ``key``, imported and checked.

    Args:
        key: where it is in the configuration, for error messages.
        node: the mapping from the file.
        must_be: a class the target must subclass (the model: a TrainingModule).
        positional: leading parameters the caller passes when building (not in ``init_args``).
        extra: names a class accepts in ``init_args`` besides its parameters (a scheduler's ``monitor``).
    """
    if not isinstance(node, dict) or "class_path" not in node:
        raise ConfigError(f"{key} must be a mapping with 'class_path' (and optional 'init_args'); got {node!r}.", key)
    unknown = [name for name in node if name not in ("class_path", "init_args")]
    if unknown:
        raise ConfigError(f"{key} has unknown key {unknown[0]!r}{did_you_mean(unknown[0], ('class_path', 'init_args'))}; "
                          "it takes class_path and init_args.", f"{key}.{unknown[0]}")
    init_args = node.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ConfigError(f"{key}.init_args must be a mapping of argument names to values; got {init_args!r}.",
                          f"{key}.init_args")
    class_path, target = _import(f"{key}.class_path", node["class_path"])
    if must_be is not None and not (isinstance(target, type) and issubclass(target, must_be)):
        raise ConfigError(f"{key}.class_path names {name_of(target)}, which is not a {must_be.__module__}."
                          f"{must_be.__name__} subclass.", f"{key}.class_path")
    allowed = extra(target) if extra is not None and isinstance(target, type) else set()
    extras = {name: init_args[name] for name in allowed if name in init_args}
    arguments = {name: value for name, value in init_args.items() if name not in allowed}
    kwargs = checked_kwargs(f"{key}.init_args", target, arguments, positional)
    return Spec(key, class_path, target, {**kwargs, **extras}, positional)


def _import(key: str, class_path: Any) -> tuple[str, Callable[..., Any]]:
    """(the spelled-out class path, the class or function it names)."""
    if not isinstance(class_path, str) or not class_path or class_path.startswith(".") or class_path.endswith("."):
        raise ConfigError(f"{key} must be a dotted path such as 'package.module.Name'; got {class_path!r}.", key)
    if "." not in class_path:
        return _import_short_name(key, class_path)
    module_name, _, attribute = class_path.rpartition(".")
    if module_name.partition(".")[0] in ("lightning", "pytorch_lightning"):
        raise ConfigError(f"{key}: {class_path} is PyTorch Lightning's; {_cadence_equivalent(attribute)}", key)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the config import
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{key}: cannot import {module_name!r} ({error}).{_module_hint(module_name)} Check the path "
                          "and the current directory.", key) from None
    if not hasattr(module, attribute):
        public = public_names(module)
        close = difflib.get_close_matches(attribute, public, n=3, cutoff=0.6)
        others = [name for name in public if name not in close]
        listing = f"did you mean {' or '.join(close)}? It also has: " if close else "it has: "
        raise ConfigError(f"{key}: {module_name} has no {attribute!r}; {listing}{', '.join(others) or 'nothing else'}.", key)
    target = getattr(module, attribute)
    if not callable(target):
        raise ConfigError(f"{key}: {class_path} is a {type(target).__name__}, not a class or function.", key)
    return class_path, target


def _import_short_name(key: str, name: str) -> tuple[str, Callable[..., Any]]:
    for module_name in SHORT_NAME_MODULES:
        module = importlib.import_module(module_name)
        if name in public_names(module):
            return f"{module_name}.{name}", getattr(module, name)
    everything = [candidate for module_name in SHORT_NAME_MODULES for candidate in public_names(importlib.import_module(module_name))]
    raise ConfigError(f"{key}: {name!r} is not a class of {', '.join(SHORT_NAME_MODULES)}"
                      f"{did_you_mean(name, everything)}; give a dotted path such as 'package.module.{name}'.", key)


def _cadence_equivalent(name: str) -> str:
    for module_name in (*SHORT_NAME_MODULES[:2], "trainer"):
        module = importlib.import_module(module_name)
        found = getattr(module, name, None)
        if isinstance(found, type) and issubclass(found, Refused):  # importable, refused when made
            return f"Cadence does not have it; instead: {found.way}."
        if name in public_names(module):
            return f"Cadence's is {module_name}.{name} (class_path: {module_name}.{name})."
    if name == "ReduceLROnPlateau":
        return "use torch.optim.lr_scheduler.ReduceLROnPlateau, with monitor: in its init_args."
    return "Cadence has no class of that name; use a Cadence or PyTorch class, or your own."


def public_names(module: types.ModuleType) -> list[str]:
    """The classes and functions a module offers: its ``__all__``, or what it defines (or its
    package defines) under a name without a leading underscore. Not what it imported
    (``Any``, ``Path``) and not its submodules."""
    names = getattr(module, "__all__", None)
    if names is None:
        package = module.__name__.partition(".")[0]
        names = [name for name, value in vars(module).items()
                 if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
                 and (getattr(value, "__module__", "") or "").partition(".")[0] == package]
    return sorted(name for name in names if callable(getattr(module, name, None)))


def _module_hint(module_name: str) -> str:
    parent, _, child = module_name.rpartition(".")
    try:
        package = importlib.import_module(parent) if parent else None
    except ImportError:
        return ""
    if package is None or not hasattr(package, "__path__"):
        return ""
    submodules = [info.name for info in pkgutil.iter_modules(package.__path__)]
    close = difflib.get_close_matches(child, submodules, n=1, cutoff=0.6)
    return f" Did you mean {parent}.{close[0]}?" if close else ""


def checked_kwargs(key: str, target: Callable[..., Any], arguments: dict[str, Any], positional: int = 0) -> dict[str, Any]:
    """``arguments`` with nested class_path objects turned into Specs, checked against ``target``."""
    everything = inspect.signature(target).parameters.values()
    named = _named_parameters(target)
    given_by_caller = {p.name for p in named[:positional]}
    parameters = {p.name: p for p in named if p.name not in given_by_caller}
    # Trainer's **unknown only exists to name the close match of a wrong argument: not "takes any".
    takes_any = any(p.kind == p.VAR_KEYWORD and p.name != "unknown" for p in everything)
    accepted = ", ".join(parameters) or "no arguments"
    unknown = [name for name in arguments if name not in parameters and not takes_any]
    if unknown:
        raise ConfigError(f"{key} has unknown key {unknown[0]!r}{did_you_mean(unknown[0], parameters)}; "
                          f"{name_of(target)} accepts: {accepted}.", f"{key}.{unknown[0]}")
    missing = [name for name, p in parameters.items() if p.default is p.empty and name not in arguments]
    if missing:
        raise ConfigError(f"{key} is missing {missing}, which {name_of(target)} requires; it accepts: {accepted}.", key)
    kwargs = {name: _node(f"{key}.{name}", value) for name, value in arguments.items()}
    hints = _type_hints(target)
    for name, value in kwargs.items():
        if name in hints and name in parameters and not _matches(value, hints[name]):
            raise ConfigError(_type_error(f"{key}.{name}", value, parameters[name].annotation, target), f"{key}.{name}")
    return kwargs


def _named_parameters(target: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(target).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _node(key: str, value: Any) -> Any:
    """A value from the file; a mapping with class_path becomes a Spec, in lists and dicts too."""
    if isinstance(value, dict) and "class_path" in value:
        return make_spec(key, value)
    if isinstance(value, list):
        return [_node(f"{key}[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        return {name: _node(f"{key}.{name}", item) for name, item in value.items()}
    return value


def did_you_mean(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(str(name), [str(choice) for choice in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    message = f"{key}: got {_show(value)} ({type(value).__name__}); {name_of(target)} takes {wanted}."
    if isinstance(value, str):
        try:
            float(value)
            message += f" YAML read {value!r} as text: write numbers with a dot and a signed exponent, e.g. 1.0e-3."
        except ValueError:
            pass
    return message


def _show(value: Any) -> str:
    if isinstance(value, Spec):
        return f"{name_of(value.target)}(...)"
    if isinstance(value, list):
        return "[" + ", ".join(_show(item) for item in value) + "]"
    return repr(value)


def name_of(target: Any) -> str:
    return getattr(target, "__qualname__", type(target).__name__)


# =============================================================================================
# Building, and back to plain data
# =============================================================================================
def _build(value: Any) -> Any:
    if isinstance(value, Spec):
        return building(value, value.build)
    if isinstance(value, list):
        return [_build(item) for item in value]
    if isinstance(value, dict):
        return {name: _build(item) for name, item in value.items()}
    return value


def building(spec: Spec, build: Callable[[], Any]) -> Any:
    """``build()``; a ValueError, TypeError or RuntimeError it raises (a value the object refused)
    becomes a one-line :class:`BuildError` naming the key and, when your code raised it or called the
    library that did, the line in your code."""
    try:
        return build()
    except BuildError:
        raise
    except (ValueError, TypeError, RuntimeError) as error:
        yours = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(_NOT_YOURS)]
        where = f" (at {_shown_path(yours[-1].filename)}:{yours[-1].lineno}, in {yours[-1].name})" if yours else ""
        raise BuildError(f"{spec.key} ({name_of(spec.target)}): {error}{where}") from error


def _shown_path(filename: str) -> str:
    """``filename`` relative to the working directory when it is under it."""
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


_NOT_PLAIN = object()  # what plain() returns for a value YAML cannot hold (a default left out of the file)


def plain(value: Any) -> Any:
    """``value`` as YAML-safe data (Specs resolved, tuples as lists, paths as text), or _NOT_PLAIN."""
    if isinstance(value, Spec):
        return value.resolved()
    if value is None:
        return None
    for kind in (bool, int, float, str):  # exact types: YAML's safe dumper refuses subclasses (numpy.float64)
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [plain(item) for item in value]
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    if isinstance(value, dict):
        items = {key: plain(item) for key, item in value.items()}
        if any(not isinstance(key, str) or item is _NOT_PLAIN for key, item in items.items()):
            return _NOT_PLAIN
        return items
    return _NOT_PLAIN


