"""Which hooks a stage calls, built once per stage as bound methods (no hook is looked up by name).

Training calls only the per-batch hooks that do something (:func:`step_hooks`); evaluation calls
its stage's hooks (:func:`evaluation_hooks`). A Lightning hook that Cadence never
calls, defined on a module or a callback, gets one warning (:func:`warn_uncalled_hooks`); those
whose code Lightning 2 would run or refuse are refused (:func:`refuse_module_hooks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from callbacks import Callback, PassThroughProfiler, profiler_of
from trainer.batch_transfer import batch_transfer
from trainer.module import TrainingModule
from trainer.optim import StepOptimizer
from callbacks.base import defines
from callbacks.console import PossibleUserWarning, warn


#: One context serves every forward without a forward context: nullcontext keeps no state.
_NO_CONTEXT = contextlib.nullcontext()


@dataclasses.dataclass
class StepHooks:
    """The hooks called every batch, as bound methods, keeping only those that do something.

    Hot loop: four default callbacks inherit no-op per-batch hooks worth 16 calls a step (about
    5 us); listing the implemented ones once per stage leaves the step only the calls that
    matter. Callbacks first, in the order given, then the module, as everywhere else. The hooks
    around backward and zero_grad are behind one flag each (``around_backward``,
    ``around_zero_grad``), so a run that implements none pays one attribute test, not a loop.
    """

    batch_start: list[Any]
    forward_context: list[Any]
    before_optimizer_step: list[Any]
    batch_end: list[Any]
    before_backward: list[Any]
    after_backward: list[Any]
    before_zero_grad: list[Any]
    module_batch_start: list[Any]
    module_before_optimizer_step: list[Any]
    module_batch_end: list[Any]
    module_before_backward: list[Any]
    module_after_backward: list[Any]
    module_before_zero_grad: list[Any]
    module_optimizer_step: Any  # the module's optimizer_step override, or None
    module_optimizer_zero_grad: Any  # the module's optimizer_zero_grad override, or None
    transfer: Any = None  # the batch transfer hooks (trainer/batch_transfer.py), or None: none is defined
    fetch: Any = None  # a profiler's timing of each batch fetch (timed_fetches), or None: none runs
    # Plain attributes, read every step: whether any hook around backward / zero_grad / the step runs.
    around_backward: bool = dataclasses.field(init=False)
    around_zero_grad: bool = dataclasses.field(init=False)
    before_step: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.around_backward = bool(self.before_backward or self.after_backward or self.module_before_backward
                                    or self.module_after_backward)
        self.around_zero_grad = bool(self.before_zero_grad or self.module_before_zero_grad
                                     or self.module_optimizer_zero_grad)
        self.before_step = bool(self.before_optimizer_step or self.module_before_optimizer_step)

    def forward_context_manager(self) -> contextlib.AbstractContextManager:
        """The callbacks' forward contexts (autocast) as one context to enter around a forward."""
        if not self.forward_context:
            return _NO_CONTEXT
        contexts = [context for hook in self.forward_context if (context := hook()) is not None]
        if not contexts:
            return _NO_CONTEXT
        if len(contexts) == 1:
            return contexts[0]
        stack = contextlib.ExitStack()
        for context in contexts:
            stack.enter_context(context)
        return stack

    # The loop calls these only when the flag above says a hook is implemented.
    def call_around_backward(self, trainer: Any, module: TrainingModule, loss: Any, backward: Any) -> None:
        """on_before_backward, ``backward(loss)``, on_after_backward: callbacks first, then the module."""
        for hook in self.before_backward:
            hook(trainer, module, loss)
        for hook in self.module_before_backward:
            hook(loss)
        backward(loss)
        for hook in self.after_backward:
            hook(trainer, module)
        for hook in self.module_after_backward:
            hook()

    def call_before_optimizer_step(self, trainer: Any, module: TrainingModule, optimizer: Any) -> None:
        for hook in self.before_optimizer_step:
            hook(trainer, module, optimizer)
        for hook in self.module_before_optimizer_step:
            hook(optimizer)

    def call_optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, step: Any, loss: Any) -> bool:
        """The module's optimizer_step override, given ``optimizer`` behind a :class:`StepOptimizer`
        whose ``step(closure)`` is the Trainer's ``step``; True if a step changed the weights."""
        handle = StepOptimizer(optimizer, step)
        self.module_optimizer_step(epoch, batch_idx, handle, lambda: loss)
        return handle.applied

    def call_around_zero_grad(self, trainer: Any, module: TrainingModule, optimizer: Any, epoch: int,
                              batch_idx: int) -> None:
        """on_before_zero_grad, then the module's optimizer_zero_grad override or ``zero_grad``."""
        for hook in self.before_zero_grad:
            hook(trainer, module, optimizer)
        for hook in self.module_before_zero_grad:
            hook(optimizer)
        if self.module_optimizer_zero_grad is not None:
            self.module_optimizer_zero_grad(epoch, batch_idx, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)


def _implemented(hooks: list[Any], no_op: Any) -> list[Any]:
    """``hooks`` without the bound methods that are the base class's no-op ``no_op``."""
    return [hook for hook in hooks if not (isinstance(hook, types.MethodType) and hook.__func__ is no_op)]


def _override(method: Any, base: Any) -> Any:
    """The bound ``method`` when the module's class overrides TrainingModule's ``base``, else None."""
    return method if _implemented([method], base) else None


def step_hooks(callbacks: list[Callback], module: TrainingModule, datamodule: Any = None) -> StepHooks:
    return StepHooks(
        transfer=batch_transfer(module, datamodule, [c.convert_input for c in callbacks if defines(c, "convert_input")]),
        fetch=fetch_timing(callbacks, "[_TrainingEpochLoop].train_dataloader_next"),
        batch_start=_implemented([c.on_train_batch_start for c in callbacks], Callback.on_train_batch_start),
        forward_context=[c.forward_context for c in callbacks if defines(c, "forward_context")],
        before_optimizer_step=_implemented([c.on_before_optimizer_step for c in callbacks], Callback.on_before_optimizer_step),
        batch_end=_implemented([c.on_train_batch_end for c in callbacks], Callback.on_train_batch_end),
        before_backward=_implemented([c.on_before_backward for c in callbacks], Callback.on_before_backward),
        after_backward=_implemented([c.on_after_backward for c in callbacks], Callback.on_after_backward),
        before_zero_grad=_implemented([c.on_before_zero_grad for c in callbacks], Callback.on_before_zero_grad),
        module_batch_start=_implemented([module.on_train_batch_start], TrainingModule.on_train_batch_start),
        module_before_optimizer_step=_implemented([module.on_before_optimizer_step], TrainingModule.on_before_optimizer_step),
        module_batch_end=_implemented([module.on_train_batch_end], TrainingModule.on_train_batch_end),
        module_before_backward=_implemented([module.on_before_backward], TrainingModule.on_before_backward),
        module_after_backward=_implemented([module.on_after_backward], TrainingModule.on_after_backward),
        module_before_zero_grad=_implemented([module.on_before_zero_grad], TrainingModule.on_before_zero_grad),
        module_optimizer_step=_override(module.optimizer_step, TrainingModule.optimizer_step),
        module_optimizer_zero_grad=_override(module.optimizer_zero_grad, TrainingModule.optimizer_zero_grad),
    )


@dataclasses.dataclass
class EvaluationHooks:
    """The hooks of one evaluation stage, each list in the order they run: the callbacks' (bound to
    the trainer and the module) then the module's own, as bound methods (no hook is looked up by
    name). The per-batch lists keep only implemented hooks."""

    step: Any
    start: list[Any]
    epoch_start: list[Any]
    batch_start: list[Any]
    batch_end: list[Any]
    epoch_end: list[Any]
    end: list[Any]
    step_takes_dataloader_idx: bool = False  # pass dataloader_idx to the step (several loaders)
    model_eval: Any = None  # before the start hooks: eval mode (or the module's on_<stage>_model_eval)
    model_train: Any = None  # after the end hooks: each submodule's mode back (or on_<stage>_model_train)
    fetch: Any = None  # a profiler's timing of each batch fetch (timed_fetches), or None: none runs


def evaluation_hooks(stage: str, trainer: Any, callbacks: list[Callback], module: TrainingModule,
                     several: bool = False) -> EvaluationHooks:
    """The hooks of ``stage``, the callbacks' called with ``trainer`` and ``module``; with ``several``
    loaders, whether the step takes ``dataloader_idx`` (as in Lightning, a step of several loaders
    must take it, and one of one loader must not require it)."""
    if stage == "validate":
        step, hooks = module.validation_step, _evaluation_hooks(
            trainer, module, module.validation_step,
            [(c.on_validation_start, c.on_validation_epoch_start, c.on_validation_batch_start,
              c.on_validation_batch_end, c.on_validation_epoch_end, c.on_validation_end) for c in callbacks],
            (module.on_validation_start, module.on_validation_epoch_start, module.on_validation_batch_start,
             module.on_validation_batch_end, module.on_validation_epoch_end, module.on_validation_end),
            (Callback.on_validation_batch_start, Callback.on_validation_batch_end,
             TrainingModule.on_validation_batch_start, TrainingModule.on_validation_batch_end),
        )
    elif stage == "test":
        step, hooks = module.test_step, _evaluation_hooks(
            trainer, module, module.test_step,
            [(c.on_test_start, c.on_test_epoch_start, c.on_test_batch_start, c.on_test_batch_end,
              c.on_test_epoch_end, c.on_test_end) for c in callbacks],
            (module.on_test_start, module.on_test_epoch_start, module.on_test_batch_start, module.on_test_batch_end,
             module.on_test_epoch_end, module.on_test_end),
            (Callback.on_test_batch_start, Callback.on_test_batch_end, TrainingModule.on_test_batch_start,
             TrainingModule.on_test_batch_end),
        )
    else:
        step, hooks = module.predict_step, _evaluation_hooks(
            trainer, module, module.predict_step,
            [(c.on_predict_start, c.on_predict_epoch_start, c.on_predict_batch_start, c.on_predict_batch_end,
              c.on_predict_epoch_end, c.on_predict_end) for c in callbacks],
            (module.on_predict_start, module.on_predict_epoch_start, module.on_predict_batch_start,
             module.on_predict_batch_end, module.on_predict_epoch_end, module.on_predict_end),
            (Callback.on_predict_batch_start, Callback.on_predict_batch_end, TrainingModule.on_predict_batch_start,
             TrainingModule.on_predict_batch_end),
        )
    hooks.step_takes_dataloader_idx = _takes_dataloader_idx(step, _STEP_NAME[stage], several) and several
    hooks.model_eval, hooks.model_train = _mode_hooks(stage, trainer, module)
    hooks.fetch = fetch_timing(callbacks, _FETCH_ACTION[stage])
    kind = {"validate": "val"}.get(stage, stage)  # as in Lightning, the module's batch hooks are checked too
    for name in {"validate": ("on_validation_batch_start", "on_validation_batch_end")}.get(
            stage, (f"on_{stage}_batch_start", f"on_{stage}_batch_end")):
        if getattr(type(module), name) is not getattr(TrainingModule, name):
            _check_dataloader_idx(getattr(module, name), kind, several)
    return hooks


_LOADER_KIND = {"validation_step": "val", "test_step": "test", "predict_step": "predict"}
#: Lightning's profiler action for each loop's batch fetch (its _DataFetcher's).
_FETCH_ACTION = {"validate": "[_EvaluationLoop].val_next", "test": "[_EvaluationLoop].test_next",
                 "predict": "[_PredictionLoop].predict_next"}


def timed_fetches(profiler: Any, action: str, iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator`` with each ``next`` timed by ``profiler`` as ``action`` (the last, which ends it, too), as
    Lightning's data fetcher times them."""
    while True:
        profiler.start(action)
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            profiler.stop(action)
        yield item


def fetch_timing(callbacks: list[Callback], action: str) -> Any:
    """How a running profiler times each batch fetch, under Lightning's ``action`` name; None without one (no
    per-batch cost)."""
    profiler = profiler_of(callbacks)
    return None if isinstance(profiler, PassThroughProfiler) else functools.partial(timed_fetches, profiler, action)
_STEP_NAME = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


def _mode_hooks(stage: str, trainer: Any, module: TrainingModule) -> tuple[Any, Any]:
    """What puts ``trainer.model`` in eval mode before ``stage`` and gives it its modes back after,
    as Lightning: the module's ``on_<stage>_model_eval`` / ``_model_train`` where overridden (their
    defaults do the same); the modes are captured now."""
    from trainer.datamodule import overrides

    model, name = trainer.model, {"validate": "validation"}.get(stage, stage)
    modes = train_modes(model)
    model_eval = getattr(module, f"on_{name}_model_eval") if overrides(module, f"on_{name}_model_eval") else model.eval
    if stage != "predict" and overrides(module, f"on_{name}_model_train"):
        return model_eval, getattr(module, f"on_{name}_model_train")
    return model_eval, functools.partial(restore_train_modes, model, modes)


class DataloaderIdxError(RuntimeError, TypeError):
    """A step or batch hook's ``dataloader_idx`` does not fit the number of loaders (a RuntimeError as in
    Lightning; a TypeError as it is about a signature)."""


def _check_dataloader_idx(hook: Any, kind: str, several: bool) -> bool:
    """Whether ``hook`` (a step or batch hook the module overrides) takes ``dataloader_idx`` (by that name,
    or ``*args``); raise when several loaders pass it and it does not, or one loader does not and it
    requires it."""
    parameters = signature(hook).parameters
    takes = "dataloader_idx" in parameters or any(p.kind == p.VAR_POSITIONAL for p in parameters.values())
    name = f"{type(getattr(hook, '__self__', None)).__name__}.{getattr(hook, '__name__', f'{kind} step')}"
    if several and not takes:
        raise DataloaderIdxError(
            f"{name} runs over several loaders but takes no dataloader_idx (Lightning: you provided multiple "
            f"`{kind}_dataloader`, but no `dataloader_idx` argument in `{name}()`). Add it to the signature: "
            f"def {hook.__name__}(self, ..., dataloader_idx=0).")
    required = parameters.get("dataloader_idx")
    if not several and required is not None and required.default is inspect.Parameter.empty:
        raise DataloaderIdxError(
            f"{name} requires dataloader_idx, but runs over one loader, which passes none (Lightning: you provided "
            f"only a single `{kind}_dataloader`, but have included `dataloader_idx` in `{name}()`). Give it a "
            "default: dataloader_idx=0.")
    return takes


def _takes_dataloader_idx(step: Any, name: str, several: bool) -> bool:
    original = inspect.unwrap(step)  # a profiler's timed step wraps the method (another wrapper may have no __name__)
    overridden = getattr(original, "__func__", original) is not getattr(TrainingModule, name, None)
    if not overridden:  # the default predict_step takes it
        return False
    return _check_dataloader_idx(step, _LOADER_KIND.get(name, "val"), several)


def _evaluation_hooks(trainer: Any, module: TrainingModule, step: Any, of_callbacks: list[tuple], of_module: tuple,
                      no_ops: tuple) -> EvaluationHooks:
    """Each hook tuple is (start, epoch_start, batch_start, batch_end, epoch_end, end); the per-batch
    hooks keep only those that are not the base classes' no-ops ``no_ops``."""
    columns = [list(column) for column in zip(*of_callbacks)] or [[] for _ in range(6)]  # one list per hook
    callback_batch_start, callback_batch_end, module_batch_start, module_batch_end = no_ops
    callback_no_ops = (None, None, callback_batch_start, callback_batch_end, None, None)
    module_no_ops = (None, None, module_batch_start, module_batch_end, None, None)
    merged = []
    for hooks, module_hook, callback_no_op, module_no_op in zip(columns, of_module, callback_no_ops, module_no_ops):
        if callback_no_op is not None:
            hooks, module_hooks = _implemented(hooks, callback_no_op), _implemented([module_hook], module_no_op)
        else:
            module_hooks = [module_hook]
        merged.append([functools.partial(hook, trainer, module) for hook in hooks] + module_hooks)
    return EvaluationHooks(step_without_batch_idx(step), *merged)


def signature(step: Any) -> inspect.Signature:
    """``step``'s signature as the user wrote it. A method re-bound around the original (FSDP's
    forward-method registration wraps the bound method) is unwrapped first; ``inspect.signature``
    would otherwise drop the first parameter of the original twice."""
    return inspect.signature(inspect.unwrap(step))


def takes_batch_idx(step: Any) -> bool:
    """False when ``step`` takes the batch alone (``def training_step(self, batch)``, as Lightning allows)."""
    try:
        parameters = list(signature(step).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: call it as it is
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) != 1 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def step_without_batch_idx(step: Any) -> Any:
    """``step`` itself, or a function of ``(batch, batch_idx)`` that calls it with the batch alone."""
    if takes_batch_idx(step):
        return step

    def step_of_batch(batch: Any, batch_idx: int) -> Any:
        return step(batch)

    return step_of_batch


def train_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Each submodule's ``training`` flag, for :func:`restore_train_modes` after evaluation (Lightning's
    ``_ModuleMode``): a submodule the user froze in eval mode stays in eval mode when training resumes."""
    return [(submodule, submodule.training) for submodule in model.modules()]


def restore_train_modes(model: torch.nn.Module, modes: list[tuple[torch.nn.Module, bool]]) -> None:
    for submodule, training in modes:
        submodule.training = training


def warn_eval_modules(module: TrainingModule) -> None:
    """Lightning's warning when training starts with submodules in eval mode (fit keeps the user's modes)."""
    names = [name or type(module).__name__ for name, submodule in module.named_modules() if not submodule.training]
    if names:
        warn(f"Found {len(names)} module(s) in eval mode at the start of training ({', '.join(names[:5])}"
             f"{', ...' if len(names) > 5 else ''}). This may lead to unexpected behavior during training: "
             "dropout and batch norm act as in evaluation. If this is intentional, you can ignore this warning; "
             "otherwise call model.train() before fit.", PossibleUserWarning)


# =============================================================================================
# Lightning hooks that Cadence does not call
# =============================================================================================
_REMOVED = "removed in Lightning 2.0"

#: LightningModule hooks whose code a module must not keep: Lightning 2 raises for them.
REFUSED_MODULE_HOOKS = {
    "training_epoch_end": f"{_REMOVED}: use on_train_epoch_end and keep the outputs you need as attributes",
    "validation_epoch_end": f"{_REMOVED}: use on_validation_epoch_end and keep the outputs you need as attributes",
    "test_epoch_end": f"{_REMOVED}: use on_test_epoch_end and keep the outputs you need as attributes",
}
#: The stages that refuse each, as Lightning's: a module keeping an unused test_epoch_end (lightning-bolts' SAC)
#: fits, and ``test`` refuses it.
REFUSING_STAGES = {"training_epoch_end": ("fit",), "validation_epoch_end": ("fit", "validate"), "test_epoch_end": ("test",)}
#: LightningModule hooks (core/hooks.py and core/module.py) that Lightning 2 no longer calls either,
#: with what to do instead: named in a warning when a module defines them.
MODULE_HOOKS = {
    "training_step_end": f"{_REMOVED}: finish the step in training_step",
    "validation_step_end": f"{_REMOVED}: finish the step in validation_step",
    "test_step_end": f"{_REMOVED}: finish the step in test_step",
    "on_epoch_start": f"{_REMOVED}: use on_train_epoch_start", "on_epoch_end": f"{_REMOVED}: use on_train_epoch_end",
    "on_pretrain_routine_start": f"{_REMOVED}: use on_fit_start", "on_pretrain_routine_end": f"{_REMOVED}: use on_fit_start",
}
#: Lightning Callback hooks (callbacks/callback.py), the same way.
CALLBACK_HOOKS = {
    "on_init_start": _REMOVED, "on_init_end": _REMOVED,
    "on_configure_sharded_model": f"{_REMOVED}: use setup",
    "on_before_accelerator_backend_setup": f"{_REMOVED}: use setup",
    "on_batch_start": f"{_REMOVED}: use on_train_batch_start", "on_batch_end": f"{_REMOVED}: use on_train_batch_end",
    "on_epoch_start": f"{_REMOVED}: use on_train_epoch_start", "on_epoch_end": f"{_REMOVED}: use on_train_epoch_end",
    "on_pretrain_routine_start": f"{_REMOVED}: use on_fit_start", "on_pretrain_routine_end": f"{_REMOVED}: use on_fit_start",
    "on_keyboard_interrupt": f"{_REMOVED}: use on_exception",
}
_warned: weakref.WeakSet[type] = weakref.WeakSet()  # classes warned about in this process
_warned_removed: weakref.WeakSet[type] = weakref.WeakSet()  # classes keeping a removed epoch-end hook, warned about


def refuse_module_hooks(module: TrainingModule, warns: bool, stage: str = "fit") -> None:
    """Raise when ``module`` defines a hook of :data:`REFUSED_MODULE_HOOKS` that ``stage`` refuses (Lightning's
    :data:`REFUSING_STAGES`), and with ``warns`` (rank zero) name once those it keeps for another stage; say
    once that ``configure_sharded_model`` is deprecated (setup calls it, as Lightning)."""
    cls = type(module)
    defined = [name for name in REFUSED_MODULE_HOOKS if callable(getattr(cls, name, None))
               and getattr(cls, name) is not getattr(TrainingModule, name, None)]
    refused = [name for name in defined if stage in REFUSING_STAGES[name]]
    if refused:
        what = "; ".join(f"{name} ({REFUSED_MODULE_HOOKS[name]})" for name in refused)
        raise NotImplementedError(f"{cls.__name__} defines {', '.join(refused)}, which Cadence does not call: {what}.")
    if defined and warns and cls not in _warned_removed:
        _warned_removed.add(cls)
        what = "; ".join(f"{name} ({REFUSED_MODULE_HOOKS[name]}; {' and '.join(REFUSING_STAGES[name])} refuses it)"
                         for name in defined)
        warn(f"{cls.__name__} defines {', '.join(defined)}, which Cadence never calls: {what}.")
    if cls.configure_sharded_model is not TrainingModule.configure_sharded_model:
        if cls.configure_model is not TrainingModule.configure_model:
            raise RuntimeError(f"Both {cls.__name__}.configure_model and {cls.__name__}.configure_sharded_model are "
                               "defined; configure_sharded_model is the deprecated name: keep configure_model only.")
        if warns and cls not in _warned:
            warn(f"{cls.__name__}.configure_sharded_model is deprecated (Lightning 2.1 renamed it configure_model): "
                 "rename it. It is called where configure_model is.", FutureWarning)


def warn_uncalled_hooks(objects: list[Any]) -> None:
    """One warning per class (per process) naming the Lightning hooks it defines that Cadence never calls."""
    for obj in objects:
        cls = type(obj)
        if cls in _warned:
            continue
        base, known = (TrainingModule, MODULE_HOOKS) if isinstance(obj, TrainingModule) else (Callback, CALLBACK_HOOKS)
        uncalled = [name for name in known if not hasattr(base, name) and callable(getattr(cls, name, None))]
        _warned.add(cls)
        if uncalled:
            what = "; ".join(f"{name} ({known[name]})" for name in uncalled)
            warn(f"{cls.__name__} defines Lightning hooks that Cadence never calls, so their code does not "
                 f"run: {what}.")
