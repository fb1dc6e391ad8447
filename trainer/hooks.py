"""Which hooks a stage calls, built once per stage as bound methods (no hook is looked up by name).

Training calls only the per-batch hooks that do something (:func:`step_hooks`); evaluation calls
its stage's hooks (:func:`evaluation_hooks`); each seam a callback may take over (backward, the
optimizer step) has at most one owner (:func:`single_owner`).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

from callbacks import Callback
from trainer.module import TrainingModule


@dataclasses.dataclass
class StepHooks:
    """The hooks called every batch, as bound methods, keeping only those that do something.

    Hot loop: four default callbacks inherit no-op per-batch hooks worth 16 calls a step (about
    5 us); listing the implemented ones once per stage leaves the step only the calls that
    matter. Callbacks first, in the order given, then the module, as everywhere else.
    """

    batch_start: list[Any]
    forward_context: list[Any]
    before_optimizer_step: list[Any]
    batch_end: list[Any]
    module_batch_start: list[Any]
    module_before_optimizer_step: list[Any]
    module_batch_end: list[Any]


def _implemented(hooks: list[Any], no_op: Any) -> list[Any]:
    """``hooks`` without the bound methods that are the base class's no-op ``no_op``."""
    return [hook for hook in hooks if not (isinstance(hook, types.MethodType) and hook.__func__ is no_op)]


def step_hooks(callbacks: list[Callback], module: TrainingModule) -> StepHooks:
    return StepHooks(
        batch_start=_implemented([c.on_train_batch_start for c in callbacks], Callback.on_train_batch_start),
        forward_context=_implemented([c.forward_context for c in callbacks], Callback.forward_context),
        before_optimizer_step=_implemented([c.on_before_optimizer_step for c in callbacks], Callback.on_before_optimizer_step),
        batch_end=_implemented([c.on_train_batch_end for c in callbacks], Callback.on_train_batch_end),
        module_batch_start=_implemented([module.on_train_batch_start], TrainingModule.on_train_batch_start),
        module_before_optimizer_step=_implemented([module.on_before_optimizer_step], TrainingModule.on_before_optimizer_step),
        module_batch_end=_implemented([module.on_train_batch_end], TrainingModule.on_train_batch_end),
    )


@dataclasses.dataclass
class EvaluationHooks:
    """The hooks of one evaluation stage, as bound methods (no hook is looked up by name): the
    callbacks' lists (called with the trainer and the module) and the module's own."""

    step: Any
    start: list[Any]
    batch_end: list[Any]
    end: list[Any]
    module_start: Any
    module_epoch_start: Any
    module_epoch_end: Any
    module_end: Any
    step_takes_dataloader_idx: bool = False  # pass dataloader_idx to the step (several loaders)


def evaluation_hooks(stage: str, callbacks: list[Callback], module: TrainingModule,
                     several: bool = False) -> EvaluationHooks:
    """The hooks of ``stage``; with ``several`` loaders, whether the step takes ``dataloader_idx``
    (as in Lightning, a step of several loaders must take it, and one of one loader must not require it)."""
    if stage == "validate":
        hooks = EvaluationHooks(
            module.validation_step, [c.on_validation_start for c in callbacks],
            [c.on_validation_batch_end for c in callbacks], [c.on_validation_end for c in callbacks],
            module.on_validation_start, module.on_validation_epoch_start, module.on_validation_epoch_end,
            module.on_validation_end,
        )
    elif stage == "test":
        hooks = EvaluationHooks(
            module.test_step, [c.on_test_start for c in callbacks],
            [c.on_test_batch_end for c in callbacks], [c.on_test_end for c in callbacks],
            module.on_test_start, module.on_test_epoch_start, module.on_test_epoch_end, module.on_test_end,
        )
    else:
        hooks = EvaluationHooks(
            module.predict_step, [c.on_predict_start for c in callbacks],
            [c.on_predict_batch_end for c in callbacks], [c.on_predict_end for c in callbacks],
            module.on_predict_start, module.on_predict_epoch_start, module.on_predict_epoch_end, module.on_predict_end,
        )
    hooks.step_takes_dataloader_idx = _takes_dataloader_idx(hooks.step, several) and several
    return hooks


def _takes_dataloader_idx(step: Any, several: bool) -> bool:
    parameters = inspect.signature(step).parameters
    takes = "dataloader_idx" in parameters or any(p.kind == p.VAR_POSITIONAL for p in parameters.values())
    name = f"{type(getattr(step, '__self__', None)).__name__}.{step.__name__}"
    overridden = getattr(step, "__func__", step) is not getattr(TrainingModule, step.__name__, None)
    if several and not takes and overridden:
        raise TypeError(f"{name} runs over several loaders but takes no dataloader_idx. Add it to the signature: "
                        f"def {step.__name__}(self, batch, batch_idx, dataloader_idx=0).")
    required = parameters.get("dataloader_idx")
    if not several and required is not None and required.default is inspect.Parameter.empty:
        raise TypeError(f"{name} requires dataloader_idx, but runs over one loader, which passes none. Give it a "
                        "default: dataloader_idx=0.")
    return takes and overridden


def single_owner(owners: list[Callback], seam: str) -> Callback | None:
    """The one callback among ``owners`` (those that set the ``seam`` flag), or None; two are an error."""
    if len(owners) > 1:
        names = " and ".join(type(owner).__name__ for owner in owners)
        raise ValueError(f"{names} both set {seam}=True; one callback may own that seam. Remove one of them.")
    return owners[0] if owners else None
