"""Callback: code that runs at named points of the Trainer's loop.

Every method is a no-op by default; the loop calls them in the order the callbacks were given,
then the module's hook of the same name. See ``Trainer.fit``'s docstring for where each fires.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class Callback:
    """Code that runs at named points of ``Trainer.fit``. Every method is a no-op by default.

    Observers (``on_*``, ``setup``, ``teardown``) look and return nothing; to change the run they
    set public trainer state (``trainer.should_stop = True``). Seams return something the loop
    uses; each says how it composes with gradient accumulation, clipping and DDP:

    - ``configure_model`` rewraps the model (compile, activation checkpointing) after it moved to
      the device and before the strategy wraps it for DDP.
    - ``forward_context`` returns a context entered around the forward and loss (autocast);
      ``module_init_context`` one around the module's ``configure_model``; ``convert_input``
      changes each batch before it moves (TruePrecision's dtype).
    - ``forward_backward`` replaces the forward and backward of an automatic-optimization step
      (``AutoMicrobatch`` runs it again in microbatches after an out-of-memory error); a callback
      that implements it sets ``owns_forward_backward``.
    - ``backward`` and ``optimizer_step`` replace the plain ``loss.backward()`` and
      ``optimizer.step()``. A callback that implements one sets ``owns_backward`` or
      ``owns_optimizer_step`` to True; two callbacks claiming the same seam is an error. The owner
      of the optimizer step also owns ``unscale_gradients``, which the loop calls before anything
      reads the gradients (AMP's GradScaler: scaled backward, unscale, step, update).

    Example::

        class PrintEpochs(Callback):
            def on_train_epoch_end(self, trainer, module):
                print("finished epoch", trainer.current_epoch)
    """

    #: Set to True by a callback that implements :meth:`backward` (a GradScaler, say).
    owns_backward: bool = False
    #: Set to True by a callback that implements :meth:`optimizer_step`.
    owns_optimizer_step: bool = False
    #: Set to True by a callback that implements :meth:`forward_backward`.
    owns_forward_backward: bool = False
    #: True for callbacks that act on logged metrics (EarlyStopping, ModelCheckpoint): as in Lightning,
    #: their ``on_train_epoch_end`` runs after the module's, so that a metric it logs counts.
    monitors_metrics: bool = False
    #: Set to True by a callback whose model changes may make a later step overwrite this step's
    #: outputs in place (CUDA graph replays: ``Compile(mode="reduce-overhead")``); the loop then
    #: keeps copies of the values it reads later (the losses the non-finite check reads).
    may_replay_graphs: bool = False

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint. Override when two instances of one
        class must keep separate state (two ModelCheckpoints watching different metrics)."""
        return type(self).__qualname__

    # --- observers, in the order they fire -----------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Once per process at the start of ``fit``/``validate``/``test``/``predict``."""

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Before the sanity validation at the start of fit (``num_sanity_val_steps`` batches)."""

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None: ...

    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None:
        """Before ``backward`` of ``loss`` (divided by ``accumulate_grad_batches``; in manual
        optimization, the loss given to ``manual_backward``)."""

    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None:
        """After ``backward``; the gradients are in ``.grad`` (under AMP float16, still scaled)."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> None:
        """After the last backward of an accumulation window, before clipping and the step."""

    def on_before_zero_grad(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step, before its gradients are cleared."""

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        """Host values of the metrics logged since the last log step (loggers write them)."""

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """At the end of a training epoch (after its last validation); ``trainer.callback_metrics``
        holds the epoch's values. A callback with ``monitors_metrics`` runs after the module's hook."""

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """After the epoch's batches (before the module's hook of the same name); the epoch's
        metrics are read after both, so values logged here count."""

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """After validation; ``trainer.callback_metrics`` holds its epoch values."""

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_test_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_test_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_predict_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None: ...

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        """The run failed with ``error``; release what you hold (flush files, close bars)."""

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Once per process at the end of a stage, after success or failure."""

    # --- seams ---------------------------------------------------------------------------
    def module_init_context(self) -> contextlib.AbstractContextManager | None:
        """A context around the module's ``configure_model`` (TruePrecision: the default dtype), or None."""
        return None

    def configure_model(self, model: nn.Module) -> nn.Module:
        return model

    def forward_context(self) -> contextlib.AbstractContextManager | None:
        """A context around forward and loss, or None for none."""
        return None

    def convert_input(self, batch: Any) -> Any:
        """Return ``batch`` changed before the batch transfer hooks and the move to the device
        (TruePrecision: floating tensors to its dtype). Not called unless overridden (no cost per step)."""
        return batch

    def backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None:
        """Replace ``loss.backward()``; only called when ``owns_backward`` is True.

        Called for every micro-batch (the loss is already divided by ``accumulate_grad_batches``)
        and for each ``self.manual_backward``. Finish with ``trainer.strategy.backward(tensor)``,
        not ``tensor.backward()``: under DDP the strategy runs the gradient all-reduce there (and
        skips it inside an accumulation window), so the gradients the step sees are averaged
        over the ranks in whatever scale this seam gave them.
        """
        raise NotImplementedError

    def forward_backward(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, syncs: bool,
                         forward: Any) -> tuple[Any, torch.Tensor]:
        """Replace the forward and backward of one batch of automatic optimization; only called when
        ``owns_forward_backward`` is True. Return ``(outputs, loss)`` as ``training_step`` would:
        the loop records ``loss`` for the non-finite check and hands ``outputs`` to
        ``on_train_batch_end``.

        ``forward(batch, batch_idx)`` runs ``training_step`` under the callbacks' forward contexts
        and returns ``(outputs, loss)``; backward goes through ``trainer.run_backward(loss)``
        (``on_before_backward``, the backward seam, ``on_after_backward``), with the loss divided
        by ``trainer.accumulate_grad_batches`` as the loop does. ``syncs`` is True for the batch
        that ends the accumulation window: the loop runs the others under the strategy's
        ``no_backward_sync``; this one's backward all-reduces (DDP), so a seam that runs several
        backwards for it wraps all but the last in ``trainer.strategy.no_backward_sync``. The
        optimizer step, clipping and zero grad stay the loop's, once per window.
        """
        raise NotImplementedError

    def unscale_gradients(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> None:
        """Bring ``optimizer``'s gradients to their true scale; a no-op unless overridden.

        Called on the owner of the optimizer step only, once per optimizer step: after the last
        backward of the accumulation window (so after DDP's all-reduce) and before
        ``on_before_optimizer_step`` and gradient clipping, so that clipping, and a hook logging
        the gradient norm, see true gradients (as in Lightning). ``TrainingModule.clip_gradients``
        calls it too, in manual optimization. It must be idempotent until the next
        ``optimizer_step``: the loop and the user's clipping may both ask.
        """

    def optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> bool:
        """Replace ``optimizer.step()``; return False if the step was skipped.

        Only called when ``owns_optimizer_step`` is True: once per accumulation window in
        automatic optimization, after ``unscale_gradients``, the hooks and clipping; and for each
        ``opt.step()`` a ``training_step`` makes on ``self.optimizers()`` in manual optimization.
        A skipped step (AMP found inf/NaN gradients) does not step the LR schedulers and is not
        one of ``Trainer(on_nonfinite_loss="skip")``'s skips; ``global_step`` still counts it, as in
        Lightning, so ``max_steps``, checkpoint and log intervals count windows on every rank alike.
        The loop zeroes the gradients afterwards either way.
        """
        raise NotImplementedError

    # --- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts, tensors) to keep in checkpoints."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Before a checkpoint is written: add plain data to ``checkpoint`` (after every callback's
        ``state_dict`` is in it, before the module's ``on_save_checkpoint``)."""

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is restored: after the module's ``on_load_checkpoint``, before the
        weights and every callback's ``load_state_dict``."""

    # --- what the performance report asks ------------------------------------------------
    def performance_facts(self) -> dict[str, Any]:
        """What this callback did to the speed of the fit that just ended, read once by the
        end-of-fit performance report: ``{"autocast": torch.bfloat16}`` (AMP), ``{"compiled": True,
        "compile_seconds": {"training": 41.0, "validation": 6.5}}`` (Compile: one-time work the
        report keeps apart from the steady state). Empty by default."""
        return {}


def defines(callback: Any, name: str) -> bool:
    """Whether ``callback``'s class defines ``name`` other than :class:`Callback`'s default. A
    ``Mock(spec=Callback)`` (Lightning's tests make them) defines none: Cadence's seams, the checkpoint
    state and the report's facts keep their defaults for it, as Lightning's ``is_overridden`` sees a Mock;
    its ``on_*`` hooks are called, as Lightning calls them."""
    return getattr(type(callback), name, None) not in (None, getattr(Callback, name))


class Checkpoint(Callback):
    """The base class of checkpointing callbacks (Lightning's ``callbacks.Checkpoint``): ``ModelCheckpoint``
    is one. Subclass it for a checkpointing callback of your own, and the Trainer treats it as one, as
    Lightning does: it is in ``trainer.checkpoint_callbacks``, runs after the other callbacks (so it saves
    their updated state), and no default ``ModelCheckpoint`` is added beside it.

    Example::

        class EveryEpoch(Checkpoint):
            def on_train_epoch_end(self, trainer, module):
                trainer.save_checkpoint(f"epoch{trainer.current_epoch}.ckpt")
    """
