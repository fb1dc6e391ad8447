"""Reading a run's configuration: YAML files merged in order, then dotted overrides.

``cadence fit --config a.yaml --config b.yaml --trainer.max_epochs=5`` reads ``a.yaml``, merges
``b.yaml`` over it (mappings merge key by key, anything else, lists included, is replaced), then
applies the overrides. Every key remembers where its value came from (``b.yaml:12``, or the
command line), so an error about a key can point at the line to fix.

Files are read with ``yaml.safe_load``: nothing in them is executed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callbacks.console import MisconfigurationException


class ConfigError(MisconfigurationException):
    """A problem with the configuration, about ``key`` (``"trainer.callbacks[0].init_args"``)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class Origins:
    """Where each key's value came from: ``{"trainer.max_epochs": "run.yaml:7", ...}``."""

    where: dict[str, str] = field(default_factory=dict)

    def of(self, key: str | None) -> str | None:
        """The origin of ``key``, or of the nearest enclosing key that has one."""
        while key:
            if key in self.where:
                return self.where[key]
            key = _parent(key)
        return None

    def replace(self, key: str, where: str) -> None:
        """``key`` now holds a new value: forget the origins of what it held."""
        for old in [old for old in self.where if old == key or old.startswith((key + ".", key + "["))]:
            del self.where[old]
        self.where[key] = where


def read_config(paths: list[str | os.PathLike], overrides: list[tuple[str, str]] = (),
                sections: tuple[str, ...] = ()) -> tuple[dict[str, Any], Origins]:
    """Merge the YAML files at ``paths`` in order, then apply ``overrides`` (``("trainer.max_epochs",
    "5")`` pairs, values read as YAML). ``sections`` are the top-level keys an override may start with."""
    import yaml  # lazily: importing trainer stays cheap

    config: dict[str, Any] = {}
    origins = Origins()
    for path in paths:
        merge(config, origins, *_read_file(Path(path)))
    for dotted, text in overrides:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"Override --{dotted}={text}: {yaml_problem(error)}") from None
        set_dotted(config, origins, dotted, value, sections)
    return config, origins


def merge(config: dict[str, Any], origins: Origins, other: dict[str, Any], other_origins: Origins, prefix: str = "") -> None:
    """Merge ``other`` into ``config``: mappings key by key, anything else (lists too) replaced.

    A mapping that names a different ``class_path`` replaces the old one whole: the old class's
    ``init_args`` mean nothing to the new class."""
    for name, value in other.items():
        key = f"{prefix}.{name}" if prefix else name
        old = config.get(name)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("class_path", old.get("class_path")) == old.get("class_path"):
            merge(old, origins, value, other_origins, key)
            continue
        config[name] = value
        origins.replace(key, other_origins.where.get(key, "?"))
        origins.where.update({inner: where for inner, where in other_origins.where.items()
                              if inner.startswith((key + ".", key + "["))})


def set_dotted(config: dict[str, Any], origins: Origins, dotted: str, value: Any, sections: tuple[str, ...] = ()) -> None:
    """Set ``trainer.callbacks[0].init_args.patience`` to ``value``, or append ``value`` to a list
    with ``trainer.callbacks+``. Setting a different ``class_path`` drops the old ``init_args``."""
    append = dotted.endswith("+")
    path = _split(dotted[:-1] if append else dotted)
    if path is None or isinstance(path[0], int) or (sections and path[0] not in sections):
        raise ConfigError(f"Override --{dotted}: it must start with one of {', '.join(sections)}, e.g. "
                          "--trainer.max_epochs=5 (list items as --trainer.callbacks[0].init_args.patience=3).")
    where = f"--{dotted} (command line)"
    node: Any = config
    key = ""
    for step, following in zip(path[:-1], path[1:]):
        node = _child(node, step, key, dotted, create=[] if isinstance(following, int) else {})
        key = _join(key, step)
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"Override --{dotted}: {key} is {node!r}, not a mapping.")
    last = path[-1]
    key = _join(key, last)
    if append:
        current = _child(node, last, _parent(key), dotted, create=[])
        if not isinstance(current, list):
            raise ConfigError(f"Override --{dotted}: {key} is {current!r}, not a list to append to.")
        current.append(value)
        origins.where[f"{key}[{len(current) - 1}]"] = where
        return
    if isinstance(last, int):
        _child(node, last, _parent(key), dotted, create=None)  # the item must exist
    elif not isinstance(node, dict):
        raise ConfigError(f"Override --{dotted}: {_parent(key)} is a list; index it, e.g. {_parent(key)}[0].")
    elif last == "class_path" and node.get("class_path") not in (None, value):
        node.pop("init_args", None)
    node[last] = value
    origins.replace(key, where)


def _child(node: Any, step: str | int, key: str, dotted: str, create: Any) -> Any:
    """``node[step]``, made (as ``create``) when missing; an error naming ``dotted`` when it cannot be."""
    where = _join(key, step)
    if isinstance(step, int):
        if not isinstance(node, list) or not -len(node) <= step < len(node):
            raise ConfigError(f"Override --{dotted}: there is no {where} ({key} is {_describe(node)}).")
        return node[step]
    if not isinstance(node, dict):
        raise ConfigError(f"Override --{dotted}: {key} is {_describe(node)}, not a mapping.")
    if node.get(step) is None:
        node[step] = create
    return node[step]


# --- reading one file -------------------------------------------------------------------------
def yaml_position(error: Exception) -> str:
    """``":3:15"``: the line and column where the YAML parser stopped (1-based), when it says."""
    mark = getattr(error, "problem_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def yaml_problem(error: Exception) -> str:
    """A YAML parser's error on one line (its own spans several, with a copy of the text)."""
    problem, context = getattr(error, "problem", None), getattr(error, "context", None)
    if not problem:
        return f"not valid YAML ({' '.join(str(error).split())})."
    mark, end = getattr(error, "context_mark", None), getattr(error, "problem_mark", None)
    started = f" from line {mark.line + 1}" if mark is not None and end is not None and mark.line != end.line else ""
    hint = "; indent with spaces, not tabs" if "\\t" in problem else ""
    return f"not valid YAML: {problem}{f' ({context}{started})' if context else ''}{hint}."


def _read_file(path: Path) -> tuple[dict[str, Any], Origins]:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"Config file {path} does not exist.")
    text = path.read_text()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}{yaml_position(error)}: {yaml_problem(error)}") from None
    if config is None:
        return {}, Origins()
    if not isinstance(config, dict):
        raise ConfigError(f"Config file {path} must be a mapping of sections (model, data, trainer, ...); "
                          f"it holds a {type(config).__name__}.")
    origins = Origins()
    _record(root, "", path, origins)
    return config, origins


def _record(node: Any, key: str, path: Path, origins: Origins) -> None:
    """Note the line of every key under ``node``; a key written twice in one mapping is an error
    (YAML would silently keep the last)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            name = key_node.value
            line = key_node.start_mark.line + 1
            if name in seen:
                raise ConfigError(f"{path}:{line}: {_join(key, name)} is set twice in one mapping (first on "
                                  f"line {seen[name]}); YAML would keep only the last. Remove one.")
            seen[name] = line
            child = _join(key, name)
            origins.where[child] = f"{path}:{line}"
            _record(value_node, child, path, origins)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = f"{key}[{index}]"
            origins.where[child] = f"{path}:{item.start_mark.line + 1}"
            _record(item, child, path, origins)


# --- dotted keys --------------------------------------------------------------------------------
_STEP = re.compile(r"([A-Za-z_][\w\-]*)((?:\[-?\d+\])*)$")


def _split(dotted: str) -> list[str | int] | None:
    """``"trainer.callbacks[0].init_args"`` -> ``["trainer", "callbacks", 0, "init_args"]``; None if malformed."""
    path: list[str | int] = []
    for part in dotted.split("."):
        match = _STEP.match(part)
        if match is None:
            return None
        path.append(match.group(1))
        path += [int(index) for index in re.findall(r"\[(-?\d+)\]", match.group(2))]
    return path


def _join(key: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{key}[{step}]"
    return f"{key}.{step}" if key else str(step)


def _parent(key: str) -> str:
    if key.endswith("]"):
        return key[:key.rindex("[")]
    return key.rpartition(".")[0]


def _describe(node: Any) -> str:
    if isinstance(node, list):
        return f"a list of {len(node)}"
    return f"a {type(node).__name__}"
