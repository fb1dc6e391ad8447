"""``save_hyperparameters``: which arguments a module (or DataModule) keeps, as Lightning decides.

The arguments are read from the ``__init__`` that called it and from every ``__init__`` of the
same object that called that one (a subclass passing its arguments up), so a base class that
calls ``self.save_hyperparameters()`` keeps the subclass's arguments too. Or the caller names
them, or passes one dict (or ``argparse.Namespace``) that becomes the hyperparameters.
``HyperparametersMixin`` (Lightning's name) gives both TrainingModule and DataModule the method,
``hparams_initial`` and the checkpoint keys the hyperparameters are kept under.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from callbacks.console import MisconfigurationException, warn
from trainer.utilities import is_picklable


class HParams(dict):
    """The hyperparameters saved by ``save_hyperparameters``; keys read as attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; it has {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class HyperparametersMixin:
    """``save_hyperparameters``, ``hparams`` and ``hparams_initial``, as Lightning's mixin of that name.

    A class using it calls ``self._init_hparams()`` in its ``__init__``.
    """

    #: The checkpoint keys of the hyperparameters, of the name of the argument they came from
    #: (``"kwargs"``: several arguments), and of their type (Lightning's).
    CHECKPOINT_HYPER_PARAMS_KEY = "hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"
    __jit_unused_properties__: list[str] = ["hparams", "hparams_initial"]
    hparams: HParams
    _hparams_name: str | None = None
    _log_hyperparams = True

    def save_hyperparameters(self, *args: Any, ignore: Sequence[str] | str | None = None, frame: Any = None,
                             logger: bool = True) -> None:
        """Keep the arguments of the caller's ``__init__`` in ``self.hparams`` (and checkpoints), as Lightning.

        Args:
            args: keep only these arguments (names; default: all, subclasses' included), or one dict
                or ``argparse.Namespace`` to keep as the hyperparameters.
            ignore: arguments to leave out (a submodule passed in, say); a subclass's ``ignore`` also
                removes them when a base class's call kept them.
            frame: the frame to read the arguments from (default: the caller's).
            logger: also send them to the loggers (``hparams.yaml``, TensorBoard); False keeps them in
                ``hparams`` and checkpoints only.
        """
        if "hparams" not in self.__dict__:  # called before super().__init__(), as Lightning allows
            self.hparams = HParams()
        self._log_hyperparams = logger
        if frame is None:
            frame = inspect.currentframe().f_back
        chosen = chosen_hyperparameters(self, args, ignore, frame)
        if chosen is None:
            return
        self._hparams_name = _argument_name(self, args, frame) if args else ("kwargs" if chosen else None)
        self.hparams.update(chosen)
        for name in _ignored(ignore):
            self.hparams.pop(name, None)
        for name, value in self.hparams.items():
            if isinstance(value, nn.Module):
                warnings.warn(f"Attribute {name!r} is an instance of `nn.Module` and is already saved during "
                              f"checkpointing (in the state dict). Leave it out of the hyperparameters: "
                              f"self.save_hyperparameters(ignore=[{name!r}]).", UserWarning, stacklevel=2)
        self._hparams_initial = copy.deepcopy(self.hparams)

    def _init_hparams(self) -> None:
        """Give the object its empty ``hparams``, in its ``__init__``. A ``save_hyperparameters()`` that ran
        before ``super().__init__()`` keeps what it saved, and, as Lightning's ``__init__`` turns the logging
        flag back off then, the loggers do not get them (``hparams.yaml`` is ``{}``; checkpoints keep them)."""
        if "hparams" in self.__dict__:
            self._log_hyperparams = False
        elif not _class_hparams(type(self)):
            self.hparams = HParams()

    @property
    def _hparams(self) -> HParams:
        """Lightning's store behind ``hparams``: code that sets it directly (``self._hparams = config``,
        as Lightning's own tests do) sets ``hparams``, so checkpoints keep it as Lightning's do."""
        return self.hparams

    @_hparams.setter
    def _hparams(self, value: Mapping[str, Any] | Namespace) -> None:
        self.hparams = HParams(vars(value) if isinstance(value, Namespace) else value)

    @property
    def hparams_initial(self) -> HParams:
        """A copy of the hyperparameters as ``save_hyperparameters`` kept them (later changes to
        ``hparams`` are not in it): what the loggers record."""
        return copy.deepcopy(self.__dict__.get("_hparams_initial", HParams()))


def _class_hparams(cls: type) -> bool:
    """Whether a subclass defines ``hparams`` itself (a dict, a namespace, a property): that one is read, as
    in Lightning, where it overrides the ``hparams`` property (until ``save_hyperparameters`` keeps some)."""
    for klass in cls.__mro__:
        if klass is HyperparametersMixin:
            return False
        if "hparams" in vars(klass):
            return True
    return False


def _ignored(ignore: Sequence[str] | str | None) -> set[str]:
    return {ignore} if isinstance(ignore, str) else {name for name in ignore or () if isinstance(name, str)}


def _argument_name(obj: Any, args: tuple[Any, ...], frame: types.FrameType) -> str | None:
    """The name of the ``__init__`` argument that one object given to ``save_hyperparameters`` came
    from (Lightning's ``hparams_name``; loading passes the hyperparameters back under it)."""
    objects = [arg for arg in args if not isinstance(arg, str)]
    if len(objects) != 1:
        return "kwargs"
    return next((name for name, value in init_arguments(obj, frame).items() if value is objects[0]), None)


def chosen_hyperparameters(obj: Any, args: tuple[Any, ...], ignore: Sequence[str] | str | None,
                           frame: types.FrameType) -> dict[str, Any] | None:
    """The hyperparameters ``obj.save_hyperparameters(*args, ignore=ignore)`` called from ``frame``
    keeps; None when ``args`` is one empty container (Lightning then keeps nothing)."""
    if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
        return None
    values = init_arguments(obj, frame)
    ignored = _ignored(ignore)
    values = {name: value for name, value in values.items() if name not in ignored}
    if not args:
        return values
    objects = [arg for arg in args if not isinstance(arg, str)]
    if len(objects) == 1:
        return as_dict(objects[0], type(obj).__name__)
    unknown = [name for name in args if isinstance(name, str) and name not in values]
    if unknown or objects:
        raise MisconfigurationException(
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
    if isinstance(hparams, (bool, int, float, str)):
        raise MisconfigurationException(
            f"{owner}.save_hyperparameters({hparams!r}): Primitives (<class 'bool'>, <class 'int'>, "
            "<class 'float'>, <class 'str'>) are not allowed as the hyperparameters object. Pass the "
            "argument's name as a string (save_hyperparameters(\"arg1\")), or a dict.")
    raise MisconfigurationException(
        f"{owner}.save_hyperparameters({hparams!r}): one object is kept as the hyperparameters when it "
        f"is a dict or an argparse.Namespace, not a {type(hparams).__name__}. Pass argument names as "
        "strings, or a dict.")


def parse_class_init_keys(cls: type) -> tuple[str, str | None, str | None]:
    """Lightning's ``parse_class_init_keys``: the names ``cls.__init__`` gives ``self``, ``*args`` and
    ``**kwargs`` (None for those it does not take)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())
    var = {kind: next((p.name for p in parameters if p.kind == kind), None)
           for kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    return parameters[0].name, var[inspect.Parameter.VAR_POSITIONAL], var[inspect.Parameter.VAR_KEYWORD]


def collect_init_args(frame: types.FrameType, path_args: list[dict[str, Any]], inside: bool = False,
                      classes: tuple[type, ...] = ()) -> list[dict[str, Any]]:
    """Lightning's ``collect_init_args``: appends to ``path_args`` the arguments of each ``__init__`` running
    at and above ``frame`` in one chain of ``super().__init__`` calls (of an instance of ``classes`` when
    given), the innermost first, ``**kwargs`` merged in; returns ``path_args``. Cadence's own
    ``save_hyperparameters`` reads the frames with :func:`init_arguments`."""
    while isinstance(frame.f_back, types.FrameType):
        local = frame.f_locals
        owner, arguments = _super_init_arguments(frame)
        if "__class__" in local and (not classes or isinstance(owner, classes)):
            path_args.append(arguments)
            inside = True
        elif inside:
            break
        frame = frame.f_back
    return path_args


def _super_init_arguments(frame: types.FrameType) -> tuple[Any, dict[str, Any]]:
    """The object and the arguments of an ``__init__`` frame that calls ``super()``; (None, {}) for another frame."""
    local = frame.f_locals
    if "__class__" not in local or frame.f_code.co_name != "__init__":
        return None, {}
    cls = local["__class__"]
    self_name, args_name, kwargs_name = parse_class_init_keys(cls)
    arguments: dict[str, Any] = {}
    for name in inspect.signature(cls.__init__).parameters:
        if name == kwargs_name:
            arguments.update(local.get(name, {}))
        elif name not in (self_name, args_name, "frame", "frame_args"):
            arguments[name] = local[name]
    return local.get(self_name), arguments


def drop_unpicklable_hyperparameters(module: Any, warns: bool = True) -> None:
    """Lightning's ``clean_namespace`` when a stage starts: each entry of ``module.hparams`` that
    ``pickle`` cannot serialize (a lambda) is removed, with Lightning's warning (``warns``: rank zero)."""
    hparams = module.__dict__.get("hparams")
    if not isinstance(hparams, dict):
        return
    for name in [key for key, value in hparams.items() if not is_picklable(value)]:
        if warns:
            warn(f"Attribute '{name}' removed from hparams because it cannot be pickled. You can suppress this warning "
                 f"by setting `self.save_hyperparameters(ignore=['{name}'])`.")
        del hparams[name]
