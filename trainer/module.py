"""TrainingModule: the hooks a user overrides, and ``self.log``.

Names and meanings follow PyTorch Lightning's ``LightningModule``, so a Lightning user moves by
changing imports. The module keeps no per-step state of its own: ``self.log`` hands values to the
Trainer's metric store, which keeps them on the device until a log step.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from trainer import export
from trainer.data_hooks import DataHooks
from trainer.hparams import HyperparametersMixin
from trainer.loading import class_only_method, load_module
from trainer.model_hooks import ModelHooks
from trainer.stage_metrics import NOT_ATTACHED, check_metric_attribute
from trainer.optim import (
    clip_optimizer_gradients, freeze_other_optimizers, optimizers_for_module, unfreeze_other_optimizers,
)

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class TrainingModule(HyperparametersMixin, DataHooks, ModelHooks, nn.Module):
    """A model plus the steps that train, validate, test and predict with it.

    Override ``training_step`` and ``configure_optimizers``; everything else is optional.

    Example::

        class Regressor(TrainingModule):
            def __init__(self, lr: float = 0.1):
                super().__init__()
                self.save_hyperparameters()
                self.net = nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.mse_loss(self.net(x), y)
                self.log("train/loss", loss, prog_bar=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
    """

    #: Load checkpoints' weights requiring the same keys (``fit(ckpt_path=...)``, ``load_from_checkpoint``);
    #: False (set in ``__init__``) loads the keys both have, as Lightning's ``strict_loading``.
    strict_loading: bool = True

    def __init__(self) -> None:
        super().__init__()
        # Plain attributes (not Parameters, Buffers or Modules) land in __dict__, so reading them
        # in the hot loop skips nn.Module.__getattr__.
        self._trainer: Trainer | None = None
        self._automatic_optimization = True
        self._example_input_array: Any = None
        self._param_requires_grad_state: dict[nn.Parameter, bool] = {}
        self._init_hparams()  # an empty hparams, which save_hyperparameters (trainer/hparams.py) fills

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer stays attached after a stage (Lightning users read module.trainer after fit),
        # but is no part of the module: copy.deepcopy and torch.save(module) leave it behind.
        state = super().__getstate__()
        state["_trainer"] = None
        return state

    # --- rebuilding from a checkpoint ------------------------------------------------------
    @class_only_method
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, map_location: Any = None,
                             hparams_file: str | os.PathLike | None = None, strict: bool | None = None,
                             weights_only: bool | None = None, **kwargs: Any) -> TrainingModule:
        """A new module built from a checkpoint's saved hyperparameters, with its weights loaded.

        ``cls(**hyperparameters, **kwargs)`` is built (arguments ``__init__`` does not take are left
        out, with a warning), then ``configure_model``, ``on_load_checkpoint(checkpoint)`` and the
        weights, as in Lightning. The file is read with ``torch.load(weights_only=True)``: loading
        never runs code from it.

        Args:
            checkpoint_path: a checkpoint written by Cadence (``Trainer.save_checkpoint``,
                ``ModelCheckpoint``) or Lightning.
            map_location: where the tensors go, as in ``torch.load``. None: where they were saved,
                or the CPU when that device is not available here.
            hparams_file: a ``hparams.yaml`` (a logger's) whose hyperparameters replace the checkpoint's.
            strict: the checkpoint's weights and the module's must have the same keys; False loads
                the keys they share. None: the new module's ``strict_loading``.
            weights_only: Lightning's; Cadence reads every file as with True (plain data only), and
                refuses, saying why, a file that holds code to run.
            kwargs: ``__init__`` arguments that replace the saved ones, or that were not saved (a
                submodule left out with ``save_hyperparameters(ignore=...)``).

        Example::

            model = Classifier.load_from_checkpoint("lightning_logs/version_0/checkpoints/last.ckpt")
            model.eval()
        """
        return load_module(cls, checkpoint_path, map_location, strict, kwargs, hparams_file)

    # --- exporting, gathering (trainer/export.py) ----------------------------------------------
    def to_torchscript(self, file_path: str | os.PathLike | None = None, method: str | None = "script",
                       example_inputs: Any = None, **kwargs: Any) -> Any:
        """This module as a ``torch.jit.ScriptModule`` (``method="trace"``: traced on ``example_inputs``
        or ``example_input_array``), in eval mode, saved at ``file_path`` when given. Deprecated, as
        TorchScript is in PyTorch: prefer ``torch.export.export``."""
        return export.to_torchscript(self, file_path, method, example_inputs, kwargs)

    def to_onnx(self, file_path: Any = None, input_sample: Any = None, **kwargs: Any) -> Any:
        """``torch.onnx.export`` of this module on ``input_sample`` (default ``example_input_array``);
        needs the ``onnx`` package."""
        return export.to_onnx(self, file_path, input_sample, kwargs)

    def to_tensorrt(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: Cadence does not export to TensorRT itself (``torch_tensorrt.compile`` does; see trainer/export.py)."""
        export.refuse_tensorrt(self)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """``data`` (tensors, numbers, or collections of them) from every process, each tensor with a
        new first dimension of the world size (none with one process). Every process must call it."""
        return export.all_gather(self, data, group, sync_grads)

    # --- what the Trainer provides ---------------------------------------------------------
    @property
    def trainer(self) -> Trainer | None:
        """The Trainer that runs (or last ran) this module; None before its first stage."""
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        self._trainer = trainer

    @property
    def device(self) -> torch.device:
        for parameter in self.parameters():
            return parameter.device
        for buffer in self.buffers():
            return buffer.device
        return torch.device("cpu")

    # The Trainer's counters and place, 0 before a Trainer runs the module (as in Lightning).
    current_epoch = property(lambda self: self._trainer.current_epoch if self._trainer is not None else 0)
    global_step = property(lambda self: self._trainer.global_step if self._trainer is not None else 0)
    global_rank = property(lambda self: self._trainer.global_rank if self._trainer is not None else 0)
    local_rank = property(lambda self: self._trainer.local_rank if self._trainer is not None else 0)

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of the module's parameters (``model.double()`` makes it float64)."""
        floating = (tensor.dtype for tensor in self.parameters() if tensor.is_floating_point())
        return next(floating, torch.get_default_dtype())

    def freeze(self) -> TrainingModule:
        """No parameter requires grad, and eval mode (Lightning's ``freeze``, for inference); returns the module."""
        self.requires_grad_(False)
        return self.eval()

    def unfreeze(self) -> TrainingModule:
        """Undo :meth:`freeze`: every parameter requires grad, and train mode; returns the module."""
        self.requires_grad_(True)
        return self.train()

    @property
    def on_gpu(self) -> bool:
        """True when the module's parameters are on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def example_input_array(self) -> Any:
        """An example input of ``forward`` (a tensor, tuple of arguments or dict of keyword arguments), as Lightning's."""
        return self._example_input_array

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self._example_input_array = example

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank zero only, written above the progress bar when one is drawn."""
        trainer = self._trainer
        if trainer is not None and not trainer.is_global_zero:
            return
        bar = trainer.progress_bar_callback if trainer is not None else None
        if bar is not None:
            bar.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (``self.logger.experiment`` is TensorBoard's SummaryWriter), or None."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's loggers, or [] outside a run."""
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def automatic_optimization(self) -> bool:
        """False means ``training_step`` calls ``manual_backward`` and steps the optimizers itself."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    def optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """The optimizers from ``configure_optimizers``: one, or a list when there are several.

        When a callback owns the optimizer step (``AMP("fp16")``'s GradScaler), each comes wrapped
        in ``trainer.optim.OwnedStepOptimizer``, so that ``opt.step()`` goes through the scaler
        (skipping the step on inf/NaN gradients); ``.optimizer`` is the torch optimizer itself.
        """
        optimizers = optimizers_for_module(self._require_trainer("optimizers"))
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The LR schedulers from ``configure_optimizers``: None, one, or a list."""
        schedulers = [config.scheduler for config in self._require_trainer("lr_schedulers").lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the Trainer, so AMP scaling and DDP work in manual mode."""
        self._require_trainer("manual_backward", running=True).run_backward(loss)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip the gradients of ``optimizer``'s parameters: in manual optimization between
        ``self.manual_backward`` and ``opt.step()``; in automatic, from ``configure_gradient_clipping``.
        Under ``AMP("fp16")`` the gradients are unscaled first (once per step): the threshold applies
        to the true gradients.

        Args:
            optimizer: one of ``self.optimizers()``.
            gradient_clip_val: the largest total 2-norm (or value); None: the Trainer's (None: no clipping).
            gradient_clip_algorithm: ``"norm"`` (default) or ``"value"``.
        """
        clip_optimizer_gradients(self._require_trainer("clip_gradients"), optimizer, gradient_clip_val,
                                 gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only ``optimizer``'s parameters require gradients (a GAN's generator step must not
        compute the discriminator's gradients); :meth:`untoggle_optimizer` restores the others.
        Parameters frozen before (``requires_grad=False``) stay frozen in both calls."""
        optimizers = self._require_trainer("toggle_optimizer").optimizers
        self._param_requires_grad_state = freeze_other_optimizers(optimizers, optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Undo :meth:`toggle_optimizer`: the other optimizers' parameters require gradients again
        as they did before it."""
        optimizers = self._require_trainer("untoggle_optimizer").optimizers
        unfreeze_other_optimizers(optimizers, optimizer, self._param_requires_grad_state)
        self._param_requires_grad_state = {}

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """:meth:`toggle_optimizer` for the body of a ``with`` block, then :meth:`untoggle_optimizer`."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _require_trainer(self, name: str, running: bool = False) -> Trainer:
        """The attached Trainer (with ``running``: one in the middle of a stage), or a RuntimeError."""
        if self._trainer is None or (running and self._trainer.module is None):
            raise RuntimeError(
                f"{type(self).__name__}.{name}() needs a running Trainer; call it from inside "
                "training_step (or another hook) during Trainer.fit."
            )
        return self._trainer

    # --- logging ---------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a scalar metric. It stays on the device; the Trainer reads it at log steps.

        The arguments are Lightning's, in Lightning's order. How a metric is logged is fixed by its first call
        in a stage; a call with other on_step/on_epoch (an epoch-end hook's) is kept apart, as Lightning's per hook.

        Args:
            name: the metric's key, e.g. ``"train/loss"``.
            value: a one-element tensor, a Python number, or a metric object with torchmetrics'
                ``update``/``compute``/``reset`` (``compute()`` is logged at the epoch end, then
                ``reset()``; per step, the value of its last ``metric(...)`` call).
            prog_bar: show it in the progress bar.
            logger: send it to the loggers (default True); False: ``trainer.callback_metrics`` and the bar only.
            on_step: log the value of each log step. Default: True in training, False elsewhere.
            on_epoch: log its reduction over the epoch. Default: False in training, True elsewhere.
            reduce_fx: the epoch value's: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` (or ``torch.mean`` ...).
            enable_graph: accepted for Lightning; Cadence hands logged values on as host numbers, so
                no graph outlives the step either way.
            sync_dist: reduce over processes (DDP) when it is read; costs a collective then. A
                metric object syncs itself in ``compute()``, so this does not apply to it.
            sync_dist_group: only None (all processes) is supported.
            add_dataloader_idx: with several evaluation loaders, add ``/dataloader_idx_N`` to the name (False: don't).
            batch_size: weight of this value in the epoch mean (default: the batch's size, inferred as Lightning does).
            metric_attribute: the attribute of this module that holds the metric object (checked).
            rank_zero_only: you call ``self.log`` on rank zero only: the value is never reduced
                over processes (a collective would wait for the others forever).
        """
        trainer = self._trainer
        if trainer is None:  # outside a run (a unit test calling training_step): Lightning's warning, nothing recorded
            return NOT_ATTACHED.log()
        stage = trainer.metrics.current
        if isinstance(value, torch.Tensor):
            if name in stage.step_only and metric_attribute is None and not on_epoch and stage.batch is not None and on_step is not False:  # hot loop: logged before per step only, and so again (not from an epoch-end hook)
                stage.step_values[name] = value  # the latest value replaces the last (trainer/metrics.py)
                return
        elif isinstance(value, numbers.Real):
            # As Lightning: a number (bool, int, NumPy's) is logged as a tensor of the default dtype, at least float32.
            value = float(value) if torch.get_default_dtype() == torch.float64 else float(np.float32(value))
        if metric_attribute is not None or isinstance(value, nn.Module):  # a torchmetrics Metric: as Lightning
            check_metric_attribute(self, name, value, metric_attribute)
        stage.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, sync_dist_group,
                  add_dataloader_idx, batch_size, rank_zero_only)

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log`` for each item; the keyword arguments (``self.log``'s) apply to all."""
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    # --- the steps a user writes -----------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | Mapping[str, Any] | None:
        raise NotImplementedError(
            f"{type(self).__name__} does not define training_step(self, batch, batch_idx). "
            "Define it and return the loss tensor (or a dict with a 'loss' key)."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional; log metrics with ``self.log`` (they are averaged over the epoch)."""

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional; as ``validation_step``, for ``Trainer.test``."""

    def predict_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        """Return the prediction for ``batch``; default: ``self(batch)`` (an override may call
        ``super().predict_step(batch, batch_idx, dataloader_idx)``, as in Lightning)."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define configure_optimizers(). Return an optimizer, "
            "a list of optimizers, (optimizers, schedulers), or "
            '{"optimizer": ..., "lr_scheduler": ...}.'
        )

    # --- lifecycle hooks, each a no-op; see Trainer.fit for the order ------------------------
    def configure_model(self) -> None:
        """Build layers late, once per stage, before the model moves (keep it idempotent). Under
        FSDP, layers built here inside ``torch.device("meta")`` are materialized shard by shard."""

    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Before ``backward`` of ``loss`` (divided by ``accumulate_grad_batches``; in manual
        optimization, the loss given to ``manual_backward``)."""

    def on_after_backward(self) -> None:
        """After ``backward``: the gradients of this batch are in ``.grad`` (summed over the
        accumulation window so far; under DDP, all-reduced at the window's last batch)."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step, before its gradients are cleared (Cadence clears them right
        after the step; Lightning before the next window's backward: the same gradients)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step ``optimizer``; override to change the step (a warm-up, stepping every other window).

        ``optimizer.step(closure=optimizer_closure)`` runs the closure (it returns the loss: the
        forward and backward of this batch have run already), then ``on_before_optimizer_step``,
        gradient clipping and the optimizer's step (through AMP's scaler when there is one). Not
        calling ``optimizer.step`` skips the step: ``global_step`` does not advance.
        """
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients after a step; override to keep or clear them another way."""
        optimizer.zero_grad()

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs (a list, or one): they join the Trainer's at the start of
        each stage; one of the same class as a Trainer callback replaces it, and ModelCheckpoints
        run last, as in Lightning."""
        return []

    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add plain data to ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` added, before the weights are loaded."""


# torch.jit.script compiles properties too; those of the module's Python-side API are not for it.
TrainingModule.__jit_unused_properties__ = export.unscriptable(TrainingModule)
