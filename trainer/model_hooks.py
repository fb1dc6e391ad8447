"""The hooks around the model's mode, gradient clipping and the LR schedulers' steps (Lightning's
``ModelHooks`` of those names): each default does what the Trainer does when it is not overridden.

The Trainer calls an override in Lightning's place: ``on_<stage>_model_eval`` instead of putting
the model in eval mode before ``on_<stage>_start``; ``on_<stage>_model_train`` instead of giving
each submodule its mode back after ``on_<stage>_end``; ``on_validation_model_zero_grad`` before a
validation inside fit that does not cut an accumulation window; ``configure_gradient_clipping``
at every optimizer step of automatic optimization (after ``on_before_optimizer_step``), with the
Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``; ``lr_scheduler_step`` for each
scheduler step, instead of ``scheduler.step()``. A hook nobody overrides costs nothing per step.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelHooks:
    """Defaults of the hooks above; ``self.trainer`` is the running Trainer."""

    trainer: Any

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside fit (not mid-window): clear the gradients (they are cleared
        after each step already; an override may keep them or free other memory)."""
        self.zero_grad(set_to_none=True)  # type: ignore[attr-defined]

    def on_validation_model_eval(self) -> None:
        """Before validation: put the model in eval mode. Override to keep some layers training
        (dropout for Monte Carlo estimates); the modes of before come back afterwards."""
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        """After validation, when overridden, instead of giving each submodule its mode back."""
        self.trainer.model.train()

    def on_test_model_eval(self) -> None:
        """Before test: put the model in eval mode (as ``on_validation_model_eval``)."""
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        """After test, when overridden, instead of giving each submodule its mode back."""
        self.trainer.model.train()

    def on_predict_model_eval(self) -> None:
        """Before predict: put the model in eval mode (as ``on_validation_model_eval``)."""
        self.trainer.model.eval()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)``: the loss of the step (divided by ``accumulate_grad_batches``;
        scaled under float16 AMP) or of ``manual_backward``. Override to change the call
        (``retain_graph=True``); DDP's all-reduce and AMP's scaling stay around it."""
        loss.backward(*args, **kwargs)

    def configure_sharded_model(self) -> None:
        """Deprecated (Lightning 2.1 renamed it ``configure_model``): an override is called at setup,
        before ``configure_model``, with a warning."""

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients before ``optimizer`` steps (automatic optimization): by default with
        the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``, which are the arguments.
        Override to clip another way, e.g. ``self.clip_gradients(optimizer, gradient_clip_val=...)``
        on a schedule (then leave ``Trainer(gradient_clip_val=...)`` unset)."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[attr-defined]

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Step ``scheduler`` when its interval and frequency say so: ``scheduler.step()``, or
        ``scheduler.step(metric)`` for one that watches a metric (ReduceLROnPlateau). Override for a
        scheduler of another API (``scheduler.step(epoch=self.current_epoch)``, timm's)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)
