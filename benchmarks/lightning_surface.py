"""Lightning's public surface measured against Cadence's: names, parameters, defaults, members.

Every class and function a PyTorch Lightning user imports from ``lightning.pytorch`` (the Trainer,
LightningModule, LightningDataModule, Callback, ``callbacks``, ``loggers``, ``profilers``, ``tuner``,
``utilities``, ``strategies``) is looked up in ``lightning_surface_map.MAP`` (Lightning name -> the
Cadence name, or a refusal naming the Cadence way) and compared with its Cadence counterpart:

- constructor and function parameters: the same name with the same default is covered; a name
  Cadence does not take is covered only if passing it really raises an error that names it and
  is not Python's bare ``unexpected keyword argument`` (checked by constructing with it);
- public members (methods, properties, attributes, hooks): present with the same parameters, or
  for hooks Cadence does not call, named in the warning a one-batch ``fit`` really emits;
- positional order, where Lightning users may pass arguments by position.

Run from the repository root (needs Lightning: ``pip install -e .[bench]``)::

    python benchmarks/lightning_surface.py              # coverage, then every difference
    python benchmarks/lightning_surface.py --markdown   # the tables for the docs
    python benchmarks/lightning_surface.py --json surface.json

It measures the Cadence of the checkout it belongs to (it puts that checkout first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import inspect
import io
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_surface_report import print_markdown, print_summary, totals  # noqa: I001 (beside this file)
from lightning_surface_map import (  # the map sits next to this file
    CADENCE_MODULE_OF, CONSTRUCT, DELIBERATE, FORWARDS, HOOK_CLASSES, INTERNAL_MEMBERS, KWARGS_OF, MAP, MEMBERS_OF,
    PARAMETERS_ONLY, Refused,
)

EMPTY = inspect.Parameter.empty
#: Python's own messages for a name it does not know: an error that says only this teaches nothing.
PYTHON_DEFAULT_MESSAGE = re.compile(
    r"\w+: (\S+ got an unexpected keyword argument|cannot import name|module \S+ has no attribute) '\w+'"
    r"( from '[\w.]+')?( \(.*\))?(\. Did you mean: '\w+'\?)?")


@dataclass
class Finding:
    """One parameter or member of a Lightning name, and what Cadence does with it."""

    name: str
    kind: str  # "parameter" or "member"
    status: str  # same | deliberate | refused | default | position | missing | accepted | unchecked | signature
    detail: str = ""

    @property
    def covered(self) -> bool:
        return self.status in ("same", "deliberate", "refused")


@dataclass
class Entry:
    """One Lightning class or function against its Cadence counterpart."""

    lightning: str
    cadence: str
    status: str  # present | refused | missing
    detail: str = ""
    findings: list[Finding] = field(default_factory=list)

    def count(self, kind: str) -> tuple[int, int]:
        of_kind = [f for f in self.findings if f.kind == kind]
        return sum(f.covered for f in of_kind), len(of_kind)


# ---------------------------------------------------------------------------------------------
# Looking names up
# ---------------------------------------------------------------------------------------------
def resolve(dotted: str) -> Any:
    """``"callbacks.ModelCheckpoint"`` -> the object; raises ImportError or AttributeError."""
    module_name, _, attribute = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except ImportError:
        # "trainer.TrainingModule.log": a member of a class.
        owner = resolve(module_name)
        return getattr(owner, attribute)


def import_message(module_name: str, name: str) -> str:
    """What ``from <module> import <name>`` says (it is ``getattr`` on the module), or "" when it imports."""
    try:
        getattr(importlib.import_module(module_name), name)
    except Exception as error:  # noqa: BLE001 (any error is what the user would see)
        return f"{type(error).__name__}: {error}"
    return ""


def construct_message(module_name: str, name: str) -> str:
    """What making ``<module>.<name>()`` says (a name that imports and refuses when used), or ""."""
    try:
        getattr(importlib.import_module(module_name), name)()
    except Exception as error:  # noqa: BLE001 (any error is what the user would see)
        return f"{type(error).__name__}: {error}"
    return ""


def is_teaching(message: str, name: str) -> bool:
    """An error that names ``name`` and says more than Python's default message."""
    return name in message and not PYTHON_DEFAULT_MESSAGE.fullmatch(message)


def parameters(function: Any) -> tuple[list[inspect.Parameter], bool]:
    """The named parameters of ``function`` (no self/cls, no *args/**kwargs) and whether it takes **kwargs."""
    signature = inspect.signature(function)
    named = [p for p in signature.parameters.values()
             if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named, any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())


def same_default(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return False  # True == 1, but they are not the same default
    if callable(a) and callable(b):
        return getattr(a, "__name__", None) == getattr(b, "__name__", None)
    if isinstance(a, datetime.timedelta) != isinstance(b, datetime.timedelta):  # the same time in seconds
        a, b = (x.total_seconds() if isinstance(x, datetime.timedelta) else x for x in (a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (a tensor or array default)
        return False


def clip(text: str, length: int = 150) -> str:
    return text if len(text) <= length else text[:length - 3] + "..."


def show(value: Any) -> str:
    if value is EMPTY:
        return "required"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return repr(value)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------
def compare_parameters(lightning: Any, cadence: Any, owner: str, call: Any = None,
                       given: dict[str, Any] | None = None, prefix: str = "") -> list[Finding]:
    """Lightning's named parameters against Cadence's.

    With ``call`` (the Cadence class or function) and ``given`` (the arguments it requires), what
    the signatures cannot tell is tried: a Lightning parameter Cadence does not declare,
    ``call(**given, name=Lightning's default)``, must raise an error naming it; and where Lightning's
    default is None, ``call(**given, name=None)`` must build what ``call(**given)`` builds.
    """
    findings = []
    theirs, _ = parameters(lightning)
    theirs += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
               for name, default in KWARGS_OF.get(owner, {}).items()]
    ours, ours_take_kwargs = parameters(cadence)
    by_name = {p.name: p for p in ours}
    forwarded = FORWARDS.get(owner)
    if forwarded and ours_take_kwargs:
        by_name = {**{p.name: p for p in parameters(resolve(forwarded))[0]}, **by_name}
    for parameter in theirs:
        label = prefix + parameter.name
        reason = DELIBERATE.get(f"{owner}({parameter.name})")
        if parameter.name in by_name:
            findings.append(compare_default(parameter, by_name[parameter.name], label, reason, call, given))
        elif reason:
            findings.append(Finding(label, "parameter", "deliberate", reason))
        elif call is None:
            status = "unchecked" if ours_take_kwargs else "missing"
            detail = "Cadence takes **kwargs here; not tried" if ours_take_kwargs else "not a parameter"
            findings.append(Finding(label, "parameter", status, detail))
        else:
            value = parameter.default if parameter.default is not EMPTY else 1
            findings.append(try_refusal(call, given or {}, parameter.name, value, label))
    findings += compare_positions(theirs, ours, prefix)
    return findings


def compare_default(theirs: inspect.Parameter, ours: inspect.Parameter, label: str, reason: str | None,
                    call: Any, given: dict[str, Any] | None) -> Finding:
    if same_default(theirs.default, ours.default):
        return Finding(label, "parameter", "same")
    if theirs.default is EMPTY:
        return Finding(label, "parameter", "same", f"required in Lightning; Cadence's default is {show(ours.default)}")
    detail = f"Lightning {show(theirs.default)}, Cadence {show(ours.default)}"
    if reason:
        return Finding(label, "parameter", "deliberate", f"{detail}: {reason}")
    if theirs.default is None and ours.default is not EMPTY and call is not None:
        # Lightning's None stands for a default it documents; Cadence writes the value out.
        # The same meaning shows as the same object built with None and without the argument.
        others = {k: v for k, v in (given or {}).items() if k != theirs.name}
        with_none, without = built_state(call, {**others, theirs.name: None}), built_state(call, others)
        if isinstance(with_none, str):
            return Finding(label, "parameter", "default", f"{detail}; passing None fails: {with_none}")
        difference = sorted(k for k in with_none if with_none.get(k) != without.get(k)
                            # the argument kept as given: None where Cadence's default is False reads the same
                            and not (k == theirs.name and ours.default is False))
        if not difference:
            return Finding(label, "parameter", "same", f"{detail}; None builds the same")
        return Finding(label, "parameter", "default", f"{detail}; None builds something else ({', '.join(difference)})")
    return Finding(label, "parameter", "default", detail)


def built_state(call: Any, arguments: dict[str, Any]) -> dict[str, str] | str:
    """What ``call(**arguments)`` builds, as comparable text per public attribute; or its error."""
    try:
        with quiet():
            built = call(**arguments)
    except Exception as error:  # noqa: BLE001 (the error is the result)
        return f"{type(error).__name__}: {error}".splitlines()[0][:160]
    if not hasattr(built, "__dict__"):
        return {"result": repr(built)}
    return {k: summary(v) for k, v in vars(built).items() if not k.startswith("_")}


def summary(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(summary(v) for v in value) + "]"
    if isinstance(value, (int, float, str, bool, type(None))):
        return repr(value)
    if isinstance(value, Path):
        return "a path"  # the working directory at construction, the same either way
    return type(value).__name__


def try_refusal(cadence: Any, construct: dict[str, Any], name: str, value: Any, label: str) -> Finding:
    """Call ``cadence`` with the Lightning argument it does not declare, and read what happens."""
    try:
        with quiet():
            cadence(**{**construct, name: value})
    except Exception as error:  # noqa: BLE001 (the error is the result)
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        if is_teaching(message, name):
            return Finding(label, "parameter", "refused", clip(message))
        return Finding(label, "parameter", "missing", clip(message))
    return Finding(label, "parameter", "accepted", f"{name}={value!r} accepted though not declared: is it used?")


def compare_positions(theirs: list[inspect.Parameter], ours: list[inspect.Parameter], prefix: str) -> list[Finding]:
    """The first place where a positional call would bind a Lightning argument to another Cadence parameter."""
    positional = [p.name for p in theirs if p.kind == p.POSITIONAL_OR_KEYWORD]
    ours_positional = [p.name for p in ours if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
    for index, name in enumerate(positional):
        if index >= len(ours_positional):
            if name in {p.name for p in ours}:
                return [Finding(f"{prefix}#{index}", "parameter", "position",
                                f"Lightning takes {name} at position {index}; Cadence takes it by keyword only")]
            return []
        if ours_positional[index] != name:
            return [Finding(f"{prefix}#{index}", "parameter", "position",
                            f"position {index} is {name} in Lightning, {ours_positional[index]} in Cadence")]
    return []


# ---------------------------------------------------------------------------------------------
# Members
# ---------------------------------------------------------------------------------------------
def public_members(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def instance_attributes(instance: Any) -> set[str]:
    return {n for n in vars(instance) if not n.startswith("_")} if instance is not None else set()


def compare_members(lightning_name: str, lightning: type, cadence: type, lightning_instance: Any,
                    cadence_instance: Any, uncalled_warning: str) -> list[Finding]:
    """Lightning's public members (less its base class's and its internals) against Cadence's."""
    base_name, extra = MEMBERS_OF.get(lightning_name, (None, ()))
    names = public_members(lightning) | instance_attributes(lightning_instance) | set(extra)
    if base_name is not None:
        names -= public_members(resolve(base_name))
    names -= INTERNAL_MEMBERS.get(lightning_name, set())
    ours_instance = instance_attributes(cadence_instance)
    findings = []
    for name in sorted(names):
        reason = DELIBERATE.get(f"{lightning_name}.{name}")
        if name in ours_instance or has_static(cadence, name):
            theirs, ours = inspect.getattr_static(lightning, name, None), inspect.getattr_static(cadence, name, None)
            findings += compare_member_signature(lightning_name, name, theirs, ours, lightning, cadence, reason)
        elif reason:
            findings.append(Finding(name, "member", "deliberate", reason))
        elif lightning_name in HOOK_CLASSES.values() and re.search(rf"\b{name} \(", uncalled_warning):
            findings.append(Finding(name, "member", "refused", "a hook Cadence does not call: fit warns or refuses, naming it"))
        else:
            findings.append(Finding(name, "member", "missing"))
    return findings


def has_static(cls: type, name: str) -> bool:
    try:
        inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    return True


def compare_member_signature(owner: str, name: str, theirs: Any, ours: Any, lightning: type, cadence: type,
                             reason: str | None) -> list[Finding]:
    if callable_member(theirs) != callable_member(ours):
        kinds = ("a method", "an attribute") if callable_member(theirs) else ("an attribute", "a method")
        return [Finding(name, "member", "deliberate" if reason else "signature",
                        f"{kinds[0]} in Lightning, {kinds[1]} in Cadence" + (f": {reason}" if reason else ""))]
    if not callable_member(theirs):
        return [Finding(name, "member", "same")]
    theirs_function, ours_function = getattr(lightning, name), getattr(cadence, name)
    if HOOK.match(name):
        return [compare_hook(name, theirs_function, ours_function, reason)]
    try:
        findings = compare_parameters(theirs_function, ours_function, f"{owner}.{name}", prefix=f"{name}: ")
    except (TypeError, ValueError):
        return [Finding(name, "member", "same", "signature not readable")]
    problems = [f for f in findings if not f.covered]
    if not problems:
        return [Finding(name, "member", "same")]
    detail = "; ".join(f"{f.name.split(': ', 1)[1]} {f.status}" + (f" ({f.detail})" if f.detail else "")
                       for f in problems)
    return [Finding(name, "member", "deliberate" if reason else "signature", detail + (f": {reason}" if reason else ""))]


#: Methods the framework calls and users override: the framework passes their arguments by
#: position, so their number matters, not their names (Lightning's ``pl_module`` is Cadence's ``module``).
HOOK = re.compile(r"^(on_\w+|configure_\w+|setup|teardown|prepare_data|\w+_step|\w+_dataloader|optimizer_zero_grad|"
                  r"backward|state_dict|load_state_dict|transfer_batch_to_device|write_on_\w+|finetune_function|"
                  r"freeze_before_training)$")


def compare_hook(name: str, theirs: Any, ours: Any, reason: str | None) -> Finding:
    def positional(function: Any) -> tuple[int, bool]:
        signature = inspect.signature(function)
        named = [p for p in signature.parameters.values() if p.name not in ("self", "cls")
                 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return len(named), any(p.kind == p.VAR_POSITIONAL for p in signature.parameters.values())

    (their_count, their_varargs), (our_count, our_varargs) = positional(theirs), positional(ours)
    if their_varargs or our_varargs or their_count == our_count:
        return Finding(name, "member", "same")
    detail = f"Lightning passes {their_count} arguments, Cadence's takes {our_count}"
    return Finding(name, "member", "deliberate" if reason else "signature", detail + (f": {reason}" if reason else ""))


def callable_member(member: Any) -> bool:
    return isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member)


# ---------------------------------------------------------------------------------------------
# Running things
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def quiet():
    """Swallow what constructors print (Lightning's banners, Cadence's notices)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def construct(cls: Any, arguments: dict[str, Any]) -> Any:
    try:
        with quiet():
            return cls(**arguments)
    except Exception:  # noqa: BLE001 (members are then compared on the class alone)
        return None


def lightning_functions(dotted: str) -> set[str]:
    cls = resolve(dotted)
    return {n for n in public_members(cls) if inspect.isfunction(inspect.getattr_static(cls, n))}


def uncalled_hook_warnings() -> str:
    """Run a one-batch Cadence fit whose module and callback define every Lightning hook that
    Cadence's base classes lack, and return the warnings it emitted: a hook it names is refused."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import callbacks
    import trainer

    module_hooks = lightning_functions(HOOK_CLASSES["module"]) - public_members(trainer.TrainingModule)
    callback_hooks = lightning_functions(HOOK_CLASSES["callback"]) - public_members(callbacks.Callback)

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    class Module(trainer.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.zeros(2, 2)), batch_size=2)
    refusals: list[str] = []  # hooks refused by an error: named in it, then left out of the next try
    for _ in range(3):
        module_class = type("EveryHookModule", (Module,), dict.fromkeys(module_hooks, no_op))
        callback_class = type("EveryHookCallback", (callbacks.Callback,), dict.fromkeys(callback_hooks, no_op))
        with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("always")
            try:
                run = trainer.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                      enable_model_summary=False, default_root_dir=directory,
                                      callbacks=[callback_class()])
                run.fit(module_class(), loader)
            except Exception as error:  # noqa: BLE001 (an error naming hooks refuses them; any other: report it)
                named = {name for name in module_hooks | callback_hooks if re.search(rf"\b{name} \(", str(error))}
                if not named:
                    return "\n".join([*refusals, f"fit failed: {error}"])
                refusals.append(str(error))
                module_hooks, callback_hooks = module_hooks - named, callback_hooks - named
                continue
        return "\n".join([*refusals, *(str(w.message) for w in caught)])
    return "\n".join(refusals)


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------
def compare_all() -> list[Entry]:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    uncalled = uncalled_hook_warnings()
    entries = []
    with tempfile.TemporaryDirectory() as directory:
        for lightning_name, target in MAP.items():
            entries.append(compare_one(lightning_name, target, Path(directory), uncalled))
    return entries


def compare_one(lightning_name: str, target: str | Refused, directory: Path, uncalled: str) -> Entry:
    lightning = resolve(lightning_name)
    lightning_module, _, short = lightning_name.rpartition(".")
    if isinstance(target, Refused):
        cadence_module = CADENCE_MODULE_OF[lightning_module]
        message = import_message(cadence_module, short) or construct_message(cadence_module, short)
        if message and is_teaching(message, short):
            return Entry(lightning_name, f"refused: {target.way}", "refused", message[:200])
        # A refused class counts once, not by its parameters: they are refused with it.
        return Entry(lightning_name, f"refused: {target.way}", "missing",
                     f"`from {cadence_module} import {short}` gives {message[:120] or 'an object'}, not a message "
                     "naming the Cadence way")
    try:
        cadence = resolve(target)
    except (ImportError, AttributeError):
        return Entry(lightning_name, target, "missing", "not in Cadence", missing_findings(lightning))
    given = {side: {k: (v(directory, side) if callable(v) and not inspect.isbuiltin(v) else v)
                    for k, v in values.items()}
             for side, values in CONSTRUCT.get(lightning_name, {}).items()}
    # What signatures cannot tell is tried by calling: constructors, and functions given in CONSTRUCT.
    call = cadence if inspect.isclass(cadence) or lightning_name in CONSTRUCT else None
    if not inspect.isclass(lightning):
        return Entry(lightning_name, target, "present", "",
                     compare_parameters(lightning, cadence, lightning_name, call, given.get("cadence")))
    findings = compare_parameters(lightning.__init__, cadence.__init__, lightning_name, call, given.get("cadence"))
    if lightning_name in PARAMETERS_ONLY:
        return Entry(lightning_name, target, "present", "", findings)
    findings += compare_members(lightning_name, lightning, cadence, construct(lightning, given.get("lightning", {})),
                                construct(cadence, given.get("cadence", {})), uncalled)
    return Entry(lightning_name, target, "present", "", findings)


def missing_findings(lightning: Any) -> list[Finding]:
    """A missing class leaves each of its constructor's parameters uncovered."""
    function = lightning.__init__ if inspect.isclass(lightning) else lightning
    try:
        named, _ = parameters(function)
    except (TypeError, ValueError):
        return []
    return [Finding(p.name, "parameter", "missing", "the class is missing") for p in named]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the Markdown tables for the docs")
    parser.add_argument("--json", type=Path, help="also write every finding to this JSON file")
    args = parser.parse_args()
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        print("lightning_surface.py compares with PyTorch Lightning, which is not installed: "
              "pip install -e .[bench] (the bench extra), then run it again.")
        return
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    entries = compare_all()
    if args.json:
        args.json.write_text(json.dumps({"totals": totals(entries), "entries": [asdict(e) for e in entries]}, indent=1))
    (print_markdown if args.markdown else print_summary)(entries)


if __name__ == "__main__":
    main()
