"""``save_hyperparameters``: which arguments a module (or DataModule) keeps, as Lightning decides.

The arguments are read from the ``__init__`` that called it and from every ``__init__`` of the
same object that called that one (a subclass passing its arguments up), so a base class that
calls ``self.save_hyperparameters()`` keeps the subclass's arguments too. Or the caller names
them, or passes one dict (or ``argparse.Namespace``) that becomes the hyperparameters.
"""

from __future__ import annotations

import inspect
import types
from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import Any


def chosen_hyperparameters(obj: Any, args: tuple[Any, ...], ignore: Sequence[str] | str | None,
                           frame: types.FrameType) -> dict[str, Any] | None:
    """The hyperparameters ``obj.save_hyperparameters(*args, ignore=ignore)`` called from ``frame``
    keeps; None when ``args`` is one empty container (Lightning then keeps nothing)."""
    if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
        return None
    values = init_arguments(obj, frame)
    ignored = {ignore} if isinstance(ignore, str) else {name for name in ignore or () if isinstance(name, str)}
    values = {name: value for name, value in values.items() if name not in ignored}
    if not args:
        return values
    objects = [arg for arg in args if not isinstance(arg, str)]
    if len(objects) == 1:
        return as_dict(objects[0], type(obj).__name__)
    unknown = [name for name in args if isinstance(name, str) and name not in values]
    if unknown or objects:
        raise ValueError(
            f"save_hyperparameters{tuple(args)!r}: pass names of {type(obj).__name__}.__init__'s arguments (it takes "
            f"{list(values)}{'; not ' + str(unknown) if unknown else ''}), or one dict or Namespace.")
    return {name: values[name] for name in args}


def init_arguments(obj: Any, frame: types.FrameType) -> dict[str, Any]:
    """The named arguments of the first ``__init__`` of ``obj`` running at or above ``frame`` and of the
    ``__init__`` calls of ``obj`` above it (a subclass's win), with the contents of ``**kwargs``."""
    def is_init_of_obj(candidate: types.FrameType) -> bool:
        return candidate.f_code.co_name == "__init__" and candidate.f_locals.get(_self_name(candidate)) is obj

    while frame is not None and not is_init_of_obj(frame):  # called from a helper method: its __init__ above
        frame = frame.f_back
    chain = []
    while frame is not None and is_init_of_obj(frame):
        chain.append(frame)
        frame = frame.f_back
    values: dict[str, Any] = {}
    for init in chain:  # the caller first, the outermost subclass last
        info = inspect.getargvalues(init)
        values.update({name: info.locals[name] for name in info.args[1:]})
        if info.keywords:
            values.update(info.locals[info.keywords])
    return values


def _self_name(frame: types.FrameType) -> str:
    code = frame.f_code
    return code.co_varnames[0] if code.co_argcount else "self"


def as_dict(hparams: Any, owner: str) -> dict[str, Any]:
    """One object given as the hyperparameters: a mapping or a Namespace (Lightning also takes those)."""
    if isinstance(hparams, Namespace):
        return dict(vars(hparams))
    if isinstance(hparams, Mapping):
        return dict(hparams)
    raise ValueError(f"{owner}.save_hyperparameters({hparams!r}): one object is kept as the hyperparameters when it "
                     f"is a dict or an argparse.Namespace, not a {type(hparams).__name__}. Pass argument names as "
                     "strings, or a dict.")
