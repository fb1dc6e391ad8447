"""The one setup order of every strategy, from the user's module to the model the loop runs, and
what setup decides for the loop (:class:`StagePlan`).

Each step sees what the previous one built::

    module.configure_model      the user's late-built layers (under FSDP: on the meta device)
    strategy.setup_module       move once (or keep on meta, to materialize shard by shard)
    callbacks' configure_model  activation checkpointing, then compile, in the order given
    strategy.wrap_module        DDP wraps; FSDP shards the blocks, then the root
    configure_optimizers        so the optimizer holds the parameters it will step (FSDP's shards)

The checkpoint, if any, is restored after this, by the stage. :func:`plan_optimization` also
decides, once per fit, what the hot loop then reads without asking: who owns backward and the
optimizer step, what clipping walks, and manual optimization's step counters. The Trainer holds
the result as one :class:`StagePlan`; nothing here sets anything on the Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from trainer.arguments import loss_of, manual_step_output
from trainer.hooks import StepHooks
from trainer.datamodule import overrides
from trainer.optim import parse_optimizers, single_owner, step_owner, trainer_clipping
from trainer.scheduler_config import SchedulerConfig, check_scheduler_api
from trainer.stage_metrics import refused_in

import torch

from callbacks.base import defines
from strategies import Strategy
from strategies.transfer import optimizer_states_to

if TYPE_CHECKING:
    from callbacks import Callback
    from trainer.module import TrainingModule


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What setup decided for one stage: read by the loop at every step, decided once.

    Args:
        hooks: the hooks each batch calls (only those a callback or the module implements).
        training_step: ``training_step(batch, batch_idx)`` of the module through the strategy
            (DDP's forward), bound once.
        backward: ``loss.backward()`` through the callback that owns backward (AMP's scaler) or
            the strategy (DDP), bound once.
        automatic_optimization: the module's ``automatic_optimization``, read once per fit.
        step_owner: the callback that owns the optimizer step (AMP float16), or None.
        clip: clips the gradients of the optimizer it is given before it steps (automatic
            optimization): the module's ``configure_gradient_clipping`` override with the Trainer's
            settings, or ``Trainer(gradient_clip_val=...)``'s clipping (``optim.trainer_clipping``),
            or None.
        step_hook_handles: manual optimization's optimizer hooks (``global_step``,
            ``on_before_optimizer_step``), removed at teardown.
        copy_losses: the non-finite guard keeps a copy of each step's loss, because a CUDA graph
            replay may overwrite it in place (the strategy's or a callback's ``may_replay_graphs``;
            ``trainer/guards.py``).
        forward_backward: ``forward_backward(batch, batch_idx, syncs)`` of an automatic-optimization
            step, returning ``(outputs, loss)``: the Trainer's, or the callback's that owns the seam
            (``owns_forward_backward``: AutoMicrobatch), bound once.
    """

    hooks: StepHooks
    training_step: Callable[[Any, int], Any]
    backward: Callable[[torch.Tensor], None]
    automatic_optimization: bool = True
    step_owner: Callback | None = None
    clip: Callable[[torch.optim.Optimizer], None] | None = None
    step_hook_handles: list[Any] = dataclasses.field(default_factory=list)
    copy_losses: bool = True
    forward_backward: Callable[[Any, int, bool], tuple[Any, torch.Tensor]] | None = None


def setup_model(module: TrainingModule, strategy: Strategy, callbacks: list[Callback], stage: str) -> torch.nn.Module:
    """Set ``module`` up in the order above, up to the strategy's wrap; return what the loop runs
    (the strategy's wrapper, or the module itself). The module's ``configure_model`` runs under the
    callbacks' ``module_init_context`` (TruePrecision's default dtype: its layers are made in it)."""
    with contextlib.ExitStack() as contexts:
        for callback in callbacks:
            if defines(callback, "module_init_context") and (context := callback.module_init_context()) is not None:
                contexts.enter_context(context)
        if overrides(module, "configure_sharded_model"):  # Lightning's deprecated name (a warning said)
            module.configure_sharded_model()
        module.configure_model()
    module = strategy.setup_module(module)
    for callback in callbacks:
        if not defines(callback, "configure_model"):
            continue
        configured = callback.configure_model(module)
        if configured is not module:
            raise RuntimeError(
                f"{type(callback).__name__}.configure_model returned a new object; modify the "
                "module in place (module.compile(), wrapping submodules) so its state_dict keeps its keys."
            )
    return strategy.wrap_module(module, stage)


def plan_evaluation(hooks: StepHooks, model: torch.nn.Module, strategy: Strategy) -> StagePlan:
    """The plan of validate, test and predict: their forward contexts; no optimizer."""
    return StagePlan(hooks, functools.partial(strategy.training_step, model), strategy.backward)


def plan_optimization(trainer: Any, module: TrainingModule, model: torch.nn.Module, hooks: StepHooks,
                      forward_backward: Callable[[Any, int, bool], tuple[Any, torch.Tensor]],
                      ) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig], StagePlan]:
    """``configure_optimizers``, read once; the seams' owners; what clipping walks.

    Returns the optimizers and scheduler configs (``trainer.optimizers``,
    ``trainer.lr_scheduler_configs``) and the fit's plan, from the running ``trainer``'s public
    settings (its strategy, callbacks, accumulation, clipping, ``on_nonfinite_loss``); the callback
    that owns backward is called with ``trainer``. ``model`` is what the strategy wrapped;
    ``forward_backward`` is the Trainer's, which the owner of that seam replaces. In manual
    optimization, each optimizer's step hooks count ``trainer.global_step`` (optimizer steps, as in
    Lightning) and call ``on_before_optimizer_step``; they are removed at teardown.
    """
    strategy, callbacks = trainer.strategy, trainer.callbacks
    strategy._trainer = trainer  # trainer.strategy.lr_scheduler_configs, as Lightning's, are this fit's
    optimizers, scheduler_configs = parse_optimizers(module.configure_optimizers(), not module.automatic_optimization)
    # An optimizer that outlived a stage (kept by the module) had its states moved to the CPU at that
    # stage's teardown: back beside its parameters, which the strategy has placed by now.
    optimizer_states_to(optimizers, None)
    automatic = module.automatic_optimization  # read once: the hot loop reads it every step
    _check_optimizer_count(module.training_step, len(optimizers), automatic)
    handles: list[Any] = []
    clip = None
    if automatic:
        _refuse_closure_steps(optimizers)
        steps_them = overrides(module, "lr_scheduler_step")
        check_scheduler_api(scheduler_configs, steps_them)
        for config in scheduler_configs if steps_them else ():
            config.step_with = refused_in(module, "lr_scheduler_step")  # no self.log there, as in Lightning
        if overrides(module, "configure_gradient_clipping"):  # called at every step, as in Lightning
            clip = functools.partial(module.configure_gradient_clipping, gradient_clip_val=trainer.gradient_clip_val,
                                     gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        elif trainer.gradient_clip_val:  # 0 clips nothing, as in Lightning
            clip = trainer_clipping(optimizers[0], trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
    else:
        if trainer.gradient_clip_val:  # Lightning's checks, in its order and words
            raise MisconfigurationException(_manual_refusal("clipping", "gradient_clip_val", trainer.gradient_clip_val))
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                _manual_refusal("accumulation", "accumulate_grad_batches", trainer.accumulate_grad_batches))
        if trainer.on_nonfinite_loss == "skip":
            raise MisconfigurationException(
                "Trainer(on_nonfinite_loss='skip') skips optimizer steps the Trainer takes; with "
                "self.automatic_optimization = False, check the loss in training_step instead."
            )
        handles = _manual_step_hooks(trainer, module, hooks, optimizers)
    owner = single_owner([c for c in callbacks if c.owns_backward is True], "owns_backward")
    # Bound once: the step calls them without asking who owns them. Where the strategy's seam is the
    # base class's (one device), the step calls the module and the loss itself: one call fewer each.
    if type(strategy).training_step is Strategy.training_step:
        training_step = model.training_step
    else:
        training_step = functools.partial(strategy.training_step, model)
    if not automatic:  # what the step returns is checked, as Lightning's manual loop does (its loss is no backward's)
        training_step = functools.partial(manual_step_output, training_step)
    if owner is not None:
        backward = functools.partial(owner.backward, trainer, module)
    elif overrides(module, "backward"):  # Lightning's hook, in place of loss.backward() (DDP's all-reduce still runs)
        backward = functools.partial(strategy.backward, backward=module.backward)
    else:
        backward = torch.Tensor.backward if type(strategy).backward is Strategy.backward else strategy.backward
    splitter = single_owner([c for c in callbacks if c.owns_forward_backward is True], "owns_forward_backward")
    if splitter is not None:  # it runs training_step through `forward` as often as it splits the batch
        forward = functools.partial(training_forward, hooks, training_step)
        forward_backward = functools.partial(splitter.forward_backward, trainer, module, forward=forward)
    plan = StagePlan(
        hooks, training_step, backward, automatic_optimization=automatic, step_owner=step_owner(callbacks),
        clip=clip,
        step_hook_handles=handles,
        copy_losses=strategy.may_replay_graphs or any(callback.may_replay_graphs for callback in callbacks),
        forward_backward=forward_backward,
    )
    return optimizers, scheduler_configs, plan


def _manual_step_hooks(trainer: Any, module: TrainingModule, hooks: StepHooks,
                       optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """Manual optimization's hooks on each optimizer: ``global_step`` counts its steps, and
    ``on_before_optimizer_step`` runs before them (when a callback or the module implements it)."""
    def count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trainer.global_step += 1

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        hooks.call_before_optimizer_step(trainer, module, optimizer)

    handles = [optimizer.register_step_post_hook(count_step) for optimizer in optimizers]
    if hooks.before_step:  # on_before_optimizer_step when training_step calls opt.step()
        handles += [optimizer.register_step_pre_hook(before_step) for optimizer in optimizers]
    return handles


def _refuse_closure_steps(optimizers: list[torch.optim.Optimizer]) -> None:
    """An optimizer whose ``step`` needs a closure that re-runs the step (LBFGS) under automatic
    optimization: Cadence's step runs forward and backward once, then ``optimizer.step()``."""
    for optimizer in optimizers:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise MisconfigurationException(
                f"{type(optimizer).__name__}.step(closure) re-evaluates the loss, which Cadence's automatic "
                "optimization does not do (it runs training_step and backward once per step). Use manual "
                "optimization: `self.automatic_optimization = False`, then in training_step `opt = "
                "self.optimizers()` and `opt.step(closure)` with a closure that calls `opt.zero_grad()`, computes "
                "the loss, calls `self.manual_backward(loss)` and returns it.")


def replaced_optimizers(trainer: Any, plan: Any, optimizers: Any) -> tuple[Any, list[torch.optim.Optimizer]]:
    """``(plan, optimizers)`` for ``trainer.strategy.optimizers = [...]`` during a fit (Lightning's setter;
    mathLab/PINA's SwitchOptimizer sets it in ``on_train_epoch_start``): the optimizers checked, and ``plan``
    with what it had bound to the old ones (the Trainer's gradient clipping, manual optimization's step hooks)
    bound to them, so the loop steps them from the next batch on. The loop's reads are unchanged."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"trainer.strategy.optimizers takes torch optimizers: item {index} is a "
                            f"{type(optimizer).__name__}.")
    module = trainer.lightning_module
    automatic = plan.automatic_optimization
    _check_optimizer_count(module.training_step, len(optimizers), automatic)
    if automatic:
        _refuse_closure_steps(optimizers)
        if plan.clip is not None and not overrides(module, "configure_gradient_clipping"):
            plan = dataclasses.replace(plan, clip=trainer_clipping(optimizers[0], trainer.gradient_clip_val,
                                                                   trainer.gradient_clip_algorithm))
    else:
        for handle in plan.step_hook_handles:
            handle.remove()
        plan = dataclasses.replace(plan, step_hook_handles=_manual_step_hooks(trainer, module, plan.hooks, optimizers))
    return plan, optimizers


def training_forward(hooks: StepHooks, training_step: Callable[[Any, int], Any], batch: Any,
                     batch_idx: int) -> tuple[Any, torch.Tensor]:
    """``training_step`` under the callbacks' forward contexts: ``(outputs, loss)``, for the owner of
    ``forward_backward`` (the Trainer's own step does the same inline, one call fewer)."""
    with hooks.forward_context_manager():
        outputs = training_step(batch, batch_idx)
    return outputs, loss_of(outputs, batch_idx)


class MultipleOptimizersError(RuntimeError, MisconfigurationException):
    """Several optimizers under automatic optimization, or Lightning 1.x's ``optimizer_idx``: a
    RuntimeError as Lightning's, and a ValueError as Cadence's refusal was."""


def _check_optimizer_count(training_step: Callable, count: int, automatic: bool) -> None:
    """Lightning 2's checks, in its order and words first: a ``training_step`` that still takes
    Lightning 1.x's ``optimizer_idx`` (it would be called without it), then several optimizers
    under automatic optimization."""
    head = "Training with multiple optimizers is only supported with manual optimization."
    how = ("set `self.automatic_optimization = False` in `__init__`, then access your optimizers in `training_step` "
           "with `opt1, opt2, ... = self.optimizers()` and step each one (`self.manual_backward(loss)`, `opt1.step()`, "
           "`opt1.zero_grad()`)")
    if "optimizer_idx" in inspect.signature(training_step).parameters:
        raise MultipleOptimizersError(
            f"{head} Remove the `optimizer_idx` argument from `training_step`, {how}. (Lightning 1.x called "
            "training_step once per optimizer with its index; Lightning 2 and Cadence do not.)")
    if automatic and count > 1:
        raise MultipleOptimizersError(
            f"{head} configure_optimizers returned {count} optimizers: {how}.")


def _manual_refusal(what: str, name: str, value: Any) -> str:
    return (f"Automatic gradient {what} is not supported for manual optimization. Remove `Trainer({name}={value})` or "
            "switch to automatic optimization: accumulate_grad_batches and gradient_clip_val apply to automatic "
            "optimization only; with self.automatic_optimization = False, accumulate and clip in training_step.")
