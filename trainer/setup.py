"""The one setup order of every strategy, from the user's module to the model the loop runs.

Each step sees what the previous one built::

    module.configure_model      the user's late-built layers (under FSDP: on the meta device)
    strategy.setup_module       move once (or keep on meta, to materialize shard by shard)
    callbacks' configure_model  activation checkpointing, then compile, in the order given
    strategy.wrap_module        DDP wraps; FSDP shards the blocks, then the root
    configure_optimizers        so the optimizer holds the parameters it will step (FSDP's shards)

The checkpoint, if any, is restored after this, by the stage. :func:`setup_optimization` also
decides, once per fit, what the hot loop then reads without asking: who owns backward and the
optimizer step, and manual optimization's step counters.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from trainer.hooks import single_owner
from trainer.optim import optimizers_for_module, parse_optimizers

if TYPE_CHECKING:
    import torch

    from trainer.module import TrainingModule
    from trainer.trainer import Trainer


def setup_model(trainer: Trainer, module: TrainingModule, stage: str) -> torch.nn.Module:
    """Set ``module`` up in the order above; return what the loop runs (the strategy's wrapper, or
    the module itself)."""
    module.configure_model()
    module = trainer.strategy.setup_module(module)
    for callback in trainer.callbacks:
        configured = callback.configure_model(module)
        if configured is not module:
            raise RuntimeError(
                f"{type(callback).__name__}.configure_model returned a new object; modify the "
                "module in place (module.compile(), wrapping submodules) so its state_dict keeps its keys."
            )
    model = trainer.strategy.wrap_module(module, stage)
    if stage == "fit":
        setup_optimization(trainer, module)
    return model


def setup_optimization(trainer: Trainer, module: TrainingModule) -> None:
    """configure_optimizers, read once; the seams' owners."""
    trainer.optimizers, trainer.lr_scheduler_configs = parse_optimizers(module.configure_optimizers())
    trainer._automatic_optimization = module.automatic_optimization  # read once: the hot loop reads it every step
    if trainer._automatic_optimization:
        if len(trainer.optimizers) > 1:
            raise ValueError(
                f"configure_optimizers returned {len(trainer.optimizers)} optimizers. Several optimizers "
                "need manual optimization: set self.automatic_optimization = False in __init__ and "
                "step them in training_step (self.optimizers(), self.manual_backward(loss))."
            )
    else:
        if trainer.accumulate_grad_batches != 1 or trainer.gradient_clip_val is not None:
            raise ValueError(
                "accumulate_grad_batches and gradient_clip_val apply to automatic optimization only; "
                "with self.automatic_optimization = False, accumulate and clip in training_step."
            )
        if trainer.on_nonfinite_loss == "skip":
            raise ValueError(
                "Trainer(on_nonfinite_loss='skip') skips optimizer steps the Trainer takes; with "
                "self.automatic_optimization = False, check the loss in training_step instead."
            )
        # global_step counts optimizer steps, as in Lightning; the hooks go away at teardown.
        trainer._step_hook_handles = [optimizer.register_step_post_hook(trainer._count_manual_step)
                                      for optimizer in trainer.optimizers]
        if trainer._hooks.before_step:  # on_before_optimizer_step when training_step calls opt.step()
            trainer._step_hook_handles += [optimizer.register_step_pre_hook(trainer._before_manual_step)
                                           for optimizer in trainer.optimizers]
    owner = single_owner([c for c in trainer.callbacks if c.owns_backward], "owns_backward")
    # Bound once: the step calls it without asking who owns backward.
    trainer._backward = (functools.partial(owner.backward, trainer, module) if owner is not None
                         else trainer.strategy.backward)
    trainer._step_owner = single_owner([c for c in trainer.callbacks if c.owns_optimizer_step], "owns_optimizer_step")
    trainer._module_optimizers = optimizers_for_module(trainer.optimizers, trainer)  # self.optimizers() in manual mode
