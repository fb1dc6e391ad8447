"""Choosing submodules of a model: one vocabulary for every feature that works per block.

Activation checkpointing, regional compilation and FSDP's sharding each act on some submodules
of the model (its transformer blocks, say). They all take the same ``modules=`` argument, read
by :func:`select_submodules`:

- a module class, or a tuple of classes: every submodule that is an instance of one;
- a list (or tuple) of dotted names: those submodules, e.g. ``["encoder.layers.0", "head"]``;
- a predicate ``(name, module) -> bool``: every submodule for which it returns True.

A selection never includes the model itself, and never a submodule inside one already selected
(the outermost match wins), so wrapping each selected block once is always safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from callbacks.console import MisconfigurationException

Selection = type | tuple | Sequence[str] | Callable[[str, nn.Module], bool]

ACCEPTED = ("a module class or a tuple of classes, a list of submodule names (dotted paths), "
            "or a predicate (name, module) -> bool")


def select_submodules(model: nn.Module, modules: Any, owner: str) -> list[tuple[str, nn.Module]]:
    """The submodules of ``model`` that ``modules`` selects, outermost first, in definition order.

    Args:
        model: the model to search (it is never selected itself).
        modules: the selection (see the module docstring).
        owner: who asks, for error messages, e.g. ``"GradientCheckpointing(modules=...)"``.

    Raises:
        ValueError: ``modules`` is none of the accepted forms, names a submodule that does not
            exist, or selects nothing; the message lists the model's top-level children.
    """
    matches = _matcher(model, modules, owner)
    chosen: list[tuple[str, nn.Module]] = []
    for name, submodule in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in chosen):
            continue
        if matches(name, submodule):
            chosen.append((name, submodule))
    if not chosen:
        raise MisconfigurationException(
            f"{owner} selects no submodule of {type(model).__name__}. {describe_children(model)}")
    return chosen


def _matcher(model: nn.Module, modules: Any, owner: str) -> Callable[[str, nn.Module], bool]:
    if isinstance(modules, type) and issubclass(modules, nn.Module):
        return lambda name, submodule: isinstance(submodule, modules)
    if isinstance(modules, tuple) and modules and all(isinstance(m, type) and issubclass(m, nn.Module) for m in modules):
        return lambda name, submodule: isinstance(submodule, modules)
    if isinstance(modules, (list, tuple)) and modules and all(isinstance(m, str) for m in modules):
        names = dict(model.named_modules())
        unknown = [name for name in modules if name not in names or not name]
        if unknown:
            raise MisconfigurationException(
                f"{owner} names {unknown}, which {type(model).__name__} does not have. "
                f"{describe_children(model)}")
        wanted = set(modules)
        return lambda name, submodule: name in wanted
    if callable(modules) and not isinstance(modules, type):
        return lambda name, submodule: bool(modules(name, submodule))
    raise MisconfigurationException(f"{owner} got {modules!r}; use {ACCEPTED}.")


def describe_children(model: nn.Module) -> str:
    """``"Its top-level children are: encoder (Encoder), head (Linear)."``, for error messages."""
    children = [f"{name} ({type(child).__name__})" for name, child in model.named_children()]
    if not children:
        return f"{type(model).__name__} has no submodules."
    return "Its top-level children are: " + ", ".join(children) + "."
