"""The Trainer: fit / validate / test / predict, and THE loop, readable top to bottom.

``fit`` comes first and its docstring is the loop in pseudocode; the helpers follow in the order
they are called. Everything about *where* the loop runs is the strategy's (``strategies/``);
everything that happens *around* it is a callback's (``callbacks/``). The loop names only
``Strategy`` and ``Callback`` methods.

Performance notes are marked "hot loop": nothing there converts a tensor to a Python value.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import callbacks as callbacks_package
import strategies as strategies_package
from callbacks import Callback
from strategies import Strategy
from strategies.transfer import move_to_device
from trainer import checkpoint as checkpoint_io
from trainer.arguments import check_trainer_arguments, loss_of, require_training_module
from trainer.data import limited_length, loader_length, rebuild_dataloader, set_sampler_epoch
from trainer.metrics import MetricStore
from trainer.module import TrainingModule
from trainer.guards import first_nonfinite, nonfinite_loss_error
from trainer.hooks import evaluation_hooks, single_owner, step_hooks
from trainer.log_dir import choose_log_dir, versions_root
from trainer.optim import SchedulerConfig, parse_optimizers
from trainer.preemption import Preemption, workers_ignore_preemption
from trainer.resume import resumable, resume_iterator
from trainer.seed import (
    preserved_rng, seed_everything, seed_worker_of_rank, seeded_generator, use_deterministic_algorithms,
)
from trainer.state import checkpoint_state, handoff_state, receive_handoff, restore
from trainer.timing import PhaseTimes, measured

STAGES = ("fit", "validate", "test", "predict")


class Trainer:
    """Trains a :class:`TrainingModule` with one fixed loop; where it runs is the ``strategy``.

    Args mean what they mean in PyTorch Lightning; the ones Cadence adds:
        seed: seed Python, NumPy, torch and DataLoader workers (per worker and per rank) first.
        deterministic: also ask PyTorch for deterministic kernels (slower on GPUs).
        on_nonfinite_loss: a NaN or infinite training loss ``"raise"``s an error naming the batch
            and the last good checkpoint (checked at log steps: no per-step sync), or ``"skip"``s
            that optimizer step (one host sync per step; counted in ``num_skipped_steps``), or
            is ``"ignore"``d.
        report: after ``fit``, print (and save in ``log_dir``) where the time went, with
            recommendations (``callbacks.PerformanceReport``).
        profiler: ``"pytorch"`` (or a ``callbacks.Profiler``) traces a few training batches
            with ``torch.profiler``; ``"simple"`` is the performance report.

    SIGTERM and SIGUSR1 during ``fit`` save ``last.ckpt`` at the end of the current step and end
    the process (see ``trainer/preemption.py``); ``fit(ckpt_path="last")`` resumes.

    Example::

        trainer = Trainer(max_epochs=5, strategy="auto")
        trainer.fit(model, train_loader, val_loader)
        trainer.test(model, test_loader)
    """

    def __init__(
        self,
        max_epochs: int | None = None,
        max_steps: int = -1,
        strategy: str | Strategy = "auto",
        devices: int | str = "auto",
        callbacks: list[Callback] | Callback | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        logger: bool | Callback | list[Callback] = True,
        seed: int | None = None,
        deterministic: bool = False,
        on_nonfinite_loss: str = "raise",
        profiler: str | Callback | None = None,
        report: bool = True,
    ) -> None:
        limits = {"train": limit_train_batches, "validate": limit_val_batches,
                  "test": limit_test_batches, "predict": limit_predict_batches}
        check_trainer_arguments(
            max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=accumulate_grad_batches,
            log_every_n_steps=log_every_n_steps, check_val_every_n_epoch=check_val_every_n_epoch,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval, limits=limits, num_sanity_val_steps=num_sanity_val_steps,
            on_nonfinite_loss=on_nonfinite_loss,
        )
        if seed is not None:
            seed_everything(seed)  # validates; seeded again at the start of each stage

        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.strategy = strategies_package.resolve_strategy(strategy, devices)
        self.strategy.validate()
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limits = limits
        self.num_sanity_val_steps = num_sanity_val_steps
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = Path(default_root_dir) if default_root_dir is not None else Path.cwd()
        self.seed = seed
        self.deterministic = deterministic
        self.on_nonfinite_loss = on_nonfinite_loss
        self.callbacks = callbacks_package.default_callbacks(
            callbacks, enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing, logger=logger
        )
        self.callbacks = callbacks_package.observability_callbacks(self.callbacks, profiler=profiler, report=report)

        # Public loop state (Lightning names).
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.sanity_checking = False
        self.stage: str | None = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int = 0
        self.log_dir: Path | None = None
        self.module: TrainingModule | None = None  # the user's module while a stage runs
        self.model: torch.nn.Module | None = None  # what the strategy wrapped (DDP), or the module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.train_dataloader: Any = None  # the training loader as fit runs it (sharded, seeded)
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.metrics = MetricStore(self.strategy.all_reduce, self.strategy.all_gather_object)
        self.batch_idx = -1  # index of the training batch being run, within its epoch; -1 before the first
        self.num_skipped_steps = 0  # optimizer steps skipped for a NaN/inf loss (on_nonfinite_loss="skip")
        self._resume_position: tuple[int, int] | None = None  # (epoch, batches to skip) after a restore
        self._resume_rng: dict | None = None  # this rank's checkpointed RNG states, for the replay
        self._train_sampler = None  # the training loader's ResumableBatchSampler (trainer/resume.py)
        self._in_epoch_end = False
        self._step_hook_handles: list[Any] = []  # manual optimization's global_step counters
        self._train_batches_seen = 0  # training batches run since the first fit (log-step clock)
        self._unchecked_losses: list = []  # (loss, batch_idx, global_step) since the last NaN check
        self._last_checkpoint: tuple[str, int] | None = None  # (path, global step) last written or loaded
        self._preemption = Preemption()
        self.phase_times = PhaseTimes()  # host seconds per phase, for the performance report

    # =========================================================================================
    # The public entry points
    # =========================================================================================
    def fit(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            ckpt_path: str | os.PathLike | None = None) -> None:
        """Train ``model``. What happens, in order:

            strategy.launch (DDP spawns here, or joins a torchrun group)
            seed; setup hooks; module.configure_model; move the model once; callbacks'
            configure_model; strategy wrap (DDP, FSDP); configure_optimizers; restore ckpt_path if given
            on_fit_start
            sanity validation (num_sanity_val_steps batches, nothing logged)
            on_train_start
            each epoch until max_epochs, max_steps or should_stop:
                on_train_epoch_start
                each batch: to device (non_blocking) -> on_train_batch_start
                    -> forward (training_step) under the callbacks' forward contexts
                    -> backward (no all-reduce while accumulating)
                    -> every accumulate_grad_batches-th batch: on_before_optimizer_step, clip,
                       optimizer step, zero grad, step-interval schedulers
                    -> on_train_batch_end -> every log_every_n_steps: on_log, non-finite loss check
                    -> at val_check_interval: on_log (the last log step's values, so logs stay in
                       step order), then validation (on_validation_start ... on_validation_end)
                    -> after SIGTERM/SIGUSR1, once the accumulation window ends: write last.ckpt, stop
                epoch metrics -> on_log; epoch-interval schedulers
                on_train_epoch_end
            on_train_end
            on_fit_end
            teardown (also after an error, which first calls on_exception)
            SystemExit(128 + signal number) if a signal stopped the run

        Callbacks run in the order given, each before the module's hook of the same name.
        ``ckpt_path`` is a checkpoint file, or "last" (``trainer/checkpoint.py``): the run then
        continues exactly where that checkpoint was written, in the same log directory.
        """
        train_dataloaders = self._loader_or_hook(train_dataloaders, model, "train_dataloader", "fit")
        if val_dataloaders is None and type(model).val_dataloader is not TrainingModule.val_dataloader:
            val_dataloaders = model.val_dataloader()
        validates = type(model).validation_step is not TrainingModule.validation_step
        if val_dataloaders is None and validates and self.limits["validate"] != 0:
            warnings.warn(
                f"{type(model).__name__} defines validation_step but fit got no val_dataloaders and the "
                "module has no val_dataloader(); validation will not run. Pass val_dataloaders=... to fit.",
                stacklevel=2,
            )
        self._check_run_length(train_dataloaders)
        self._launch("fit", model, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``validation_step`` over ``dataloaders``; return ``[{metric: value}]`` (epoch means)."""
        dataloaders = self._loader_or_hook(dataloaders, model, "val_dataloader", "validate")
        return self._launch("validate", model, dataloaders, None, ckpt_path)

    def test(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``test_step`` over ``dataloaders``; return ``[{metric: value}]`` (epoch means)."""
        dataloaders = self._loader_or_hook(dataloaders, model, "test_dataloader", "test")
        return self._launch("test", model, dataloaders, None, ckpt_path)

    def predict(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[Any]:
        """Run ``predict_step`` over ``dataloaders``; return the outputs, one per batch, in order.

        Under DDP each rank predicts one contiguous block of the dataset, and the outputs of all
        ranks come back (to the caller of a spawned run, and on every rank under torchrun) end to
        end, on the CPU: the whole dataset, in order, each sample once.
        """
        dataloaders = self._loader_or_hook(dataloaders, model, "predict_dataloader", "predict")
        return self._launch("predict", model, dataloaders, None, ckpt_path)

    @measured("checkpointing")
    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the whole training state to ``path`` atomically (rank zero writes; all ranks wait).

        Call it on every rank, during a stage (from a callback or a module hook). A checkpoint
        written at the end of a batch resumes after that batch; see ``trainer/checkpoint.py``.
        """
        if self.module is None:
            raise RuntimeError(
                "Trainer.save_checkpoint runs during fit/validate/test/predict (from a callback or a "
                "module hook). After fit, save the weights with torch.save(model.state_dict(), path), "
                "or use callbacks.ModelCheckpoint."
            )
        self._check_losses()  # never write weights that a non-finite loss produced
        state = checkpoint_state(self)
        error = None
        if self.strategy.is_global_zero:
            try:
                checkpoint_io.save_atomic(state, path)
            except (OSError, TypeError) as failure:
                error = failure
        # Doubles as the barrier: every rank waits for the write and fails with it, so none is left
        # waiting at the next collective.
        if self.strategy.reduce_any(error is not None):
            raise error or RuntimeError(f"Rank zero could not write the checkpoint {path}; see its error.")
        self._last_checkpoint = (str(path), self.global_step)

    # =========================================================================================
    # Launch and per-process setup
    # =========================================================================================
    def _launch(self, stage: str, module: TrainingModule, loader: Any, val_loader: Any, ckpt_path: Any) -> Any:
        require_training_module(module, stage)
        if ckpt_path is not None:  # before anything starts, so a wrong path costs nothing
            ckpt_path = self._resolve_ckpt_path(ckpt_path, stage)
        if self.log_dir is None:  # a resumed run keeps the version directory its checkpoint is in
            self.log_dir = choose_log_dir(self.loggers, self.default_root_dir, ckpt_path if stage == "fit" else None)
        output, handoff = self.strategy.launch(self._run_stage, stage, module, loader, val_loader, ckpt_path)
        if handoff is not None:  # the work ran in other processes: bring its results here
            receive_handoff(self, module, handoff)
        self._preemption.exit_if_stopped()  # SystemExit(128 + signal) once a signal stopped fit
        return output

    def _run_stage(self, stage: str, module: TrainingModule, loader: Any, val_loader: Any, ckpt_path: Any) -> tuple[Any, Any]:
        """Everything one process does for one stage; returns (output, handoff for the caller)."""
        self.stage = stage
        if stage != "fit":
            self.progress_bar_metrics = {}
        self.strategy.setup_environment()
        self.log_dir = self.strategy.broadcast_object(self.log_dir)  # torchrun ranks each chose one; use rank zero's
        self.module = module
        module._trainer = self
        try:
            if self.seed is not None:
                seed_everything(self.seed)
            if self.deterministic:
                use_deterministic_algorithms()
            if self.strategy.is_global_zero:
                print(self.strategy.describe(), file=sys.stderr)
            for callback in self.callbacks:
                callback.setup(self, module, stage)
            module.setup(stage)
            self._hooks = step_hooks(self.callbacks, module)
            self.model = self._setup_model(module, stage)
            if stage == "fit":
                with self._preemption.handle_signals(self.strategy.world_size):  # SIGTERM/SIGUSR1: save, stop
                    output = self._run_fit(module, loader, val_loader, ckpt_path)
            else:
                if ckpt_path is not None:
                    restore(self, ckpt_path, model_only=True)
                output = self._run_evaluation(stage, loader)
            handoff = handoff_state(self, module) if self.strategy.launches_subprocesses else None
            return output, handoff
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self, module, error)
            raise
        finally:
            for callback in self.callbacks:
                callback.teardown(self, module, stage)
            module.teardown(stage)
            self.strategy.teardown()
            for handle in self._step_hook_handles:
                handle.remove()
            self._step_hook_handles = []
            module._trainer = None
            self.module = self.model = None

    def _setup_model(self, module: TrainingModule, stage: str) -> torch.nn.Module:
        """The one setup order of every strategy (each step sees what the previous one built):

            module.configure_model      the user's late-built layers (under FSDP: on the meta device)
            strategy.setup_module       move once (or keep on meta, to materialize shard by shard)
            callbacks' configure_model  activation checkpointing, then compile, in the order given
            strategy.wrap_module        DDP wraps; FSDP shards the blocks, then the root
            configure_optimizers        so the optimizer holds the parameters it will step (FSDP's shards)

        The checkpoint, if any, is restored after this, by the stage.
        """
        module.configure_model()
        module = self.strategy.setup_module(module)
        for callback in self.callbacks:
            configured = callback.configure_model(module)
            if configured is not module:
                raise RuntimeError(
                    f"{type(callback).__name__}.configure_model returned a new object; modify the "
                    "module in place (module.compile(), wrapping submodules) so its state_dict keeps its keys."
                )
        model = self.strategy.wrap_module(module, stage)
        if stage == "fit":
            self._setup_optimization(module)
        return model

    def _setup_optimization(self, module: TrainingModule) -> None:
        """configure_optimizers, read once; the seams' owners; what clipping walks."""
        self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers())
        self._automatic_optimization = module.automatic_optimization  # read once: the hot loop reads it every step
        if self._automatic_optimization:
            if len(self.optimizers) > 1:
                raise ValueError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers. Several optimizers "
                    "need manual optimization: set self.automatic_optimization = False in __init__ and "
                    "step them in training_step (self.optimizers(), self.manual_backward(loss))."
                )
        else:
            if self.accumulate_grad_batches != 1 or self.gradient_clip_val is not None:
                raise ValueError(
                    "accumulate_grad_batches and gradient_clip_val apply to automatic optimization only; "
                    "with self.automatic_optimization = False, accumulate and clip in training_step."
                )
            if self.on_nonfinite_loss == "skip":
                raise ValueError(
                    "Trainer(on_nonfinite_loss='skip') skips optimizer steps the Trainer takes; with "
                    "self.automatic_optimization = False, check the loss in training_step instead."
                )
            # global_step counts optimizer steps, as in Lightning; the hooks go away at teardown.
            self._step_hook_handles = [optimizer.register_step_post_hook(self._count_manual_step) for optimizer in self.optimizers]
        self._backward_owner = single_owner([c for c in self.callbacks if c.owns_backward], "owns_backward")
        self._step_owner = single_owner([c for c in self.callbacks if c.owns_optimizer_step], "owns_optimizer_step")
        self._clip_parameters = [p for group in self.optimizers[0].param_groups for p in group["params"]]

    def _count_manual_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.global_step += 1

    # =========================================================================================
    # fit: the loop
    # =========================================================================================
    def _run_fit(self, module: TrainingModule, train_loader: Any, val_loader: Any, ckpt_path: Any) -> None:
        train_loader = self._prepare_loader(train_loader, "train", shuffle=True)
        train_loader, self._train_sampler = resumable(train_loader)  # records each epoch's RNG for resuming
        self.train_dataloader = train_loader
        val_loader = self._prepare_loader(val_loader, "validate", shuffle=False) if val_loader is not None else None
        if self.num_val_batches == 0:
            val_loader = None  # limit_val_batches=0: no validation at all, hooks included (as in Lightning)
        self.should_stop, self._resume_position, self._unchecked_losses = False, None, []
        if ckpt_path is not None:
            restore(self, ckpt_path)
        for callback in self.callbacks:
            callback.on_fit_start(self, module)
        module.on_fit_start()
        if val_loader is not None and self._resume_position is None and self.num_sanity_val_steps != 0:
            self._run_sanity_check(val_loader)
        for callback in self.callbacks:
            callback.on_train_start(self, module)
        module.on_train_start()
        self.strategy.check_placement(module)  # once, before the first step
        while not self._finished():
            self._run_train_epoch(train_loader, val_loader)
        for callback in self.callbacks:
            callback.on_train_end(self, module)
        module.on_train_end()
        for callback in self.callbacks:
            callback.on_fit_end(self, module)
        module.on_fit_end()

    def _finished(self) -> bool:
        return (
            self.should_stop
            or (self.max_steps != -1 and self.global_step >= self.max_steps)
            or (self.max_epochs is not None and self.current_epoch >= self.max_epochs)
        )

    def _run_train_epoch(self, train_loader: Any, val_loader: Any) -> None:
        module, strategy, hooks = self.module, self.strategy, self._hooks
        self.model.train()
        self.metrics.start_training()
        for callback in self.callbacks:
            callback.on_train_epoch_start(self, module)
        module.on_train_epoch_start()
        num_batches = self.num_training_batches
        val_every = self._val_every(num_batches) if val_loader is not None else None
        batch_idx = -1
        times, clock = self.phase_times, time.perf_counter  # two host clock reads a batch, no device sync
        times.start_loop(self._train_batches_seen)
        for batch_idx, batch in self._iterate_train(train_loader):
            # hot loop: from here to the end of the step, no tensor becomes a Python value.
            times.data_wait += clock() - times.ready
            self.batch_idx = batch_idx
            batch = strategy.batch_to_device(batch)
            for hook in hooks.batch_start:
                hook(self, module, batch, batch_idx)
            for hook in hooks.module_batch_start:
                hook(batch, batch_idx)
            outputs = self._training_step(module, batch, batch_idx, num_batches)
            self._train_batches_seen += 1  # first: a checkpoint written in on_train_batch_end counts this batch
            for hook in hooks.batch_end:
                hook(self, module, outputs, batch, batch_idx)
            for hook in hooks.module_batch_end:
                hook(outputs, batch, batch_idx)
            if self._train_batches_seen % self.log_every_n_steps == 0:
                self._log_step()
            if val_every is not None and self._validation_due(batch_idx, val_every, num_batches):
                self._run_validation(val_loader)
            times.ready = clock()  # the next batch is asked for now
            if self._preemption.stop_now and self._ends_window(batch_idx, num_batches):  # a plain bool read
                self._save_for_preemption()
                return  # mid-epoch: no epoch end (schedulers, hooks); the resumed run finishes the epoch
            if self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps):
                break
        times.end_loop(self._train_batches_seen)
        if batch_idx == -1 and self._resume_position is None:
            raise RuntimeError(
                "The training DataLoader yielded no batches. Check that the dataset is not empty and "
                "that batch_size <= len(dataset) when drop_last=True."
            )
        self._resume_position = None
        self._end_train_epoch()

    def _iterate_train(self, loader: Any) -> Iterator[tuple[int, Any]]:
        """``enumerate(loader)`` under limit_train_batches, resuming mid-epoch at the index level."""
        set_sampler_epoch(loader, self.current_epoch)
        skip = 0
        if self._resume_position is not None and self._resume_position[0] == self.current_epoch:
            skip = self._resume_position[1]
        limit = self.num_training_batches
        if skip >= limit:  # the checkpoint was written after the epoch's last batch
            return iter(())
        # Resuming mid-epoch redraws the epoch's order from the RNG state it began with and skips
        # the batches already trained as indices; nothing is fetched twice (trainer/resume.py).
        iterator = resume_iterator(loader, self._train_sampler, skip, self._resume_rng) if skip else iter(loader)
        batches = enumerate(iterator, start=skip)  # hot loop: C iterators only, no generator frame
        if limit < (loader_length(loader) or math.inf):
            # islice stops after the last batch without fetching another. Otherwise the loader runs
            # out on its own, as in `for batch in loader`: a shuffling RandomSampler draws from its
            # generator when it runs out, so stopping one next() early changes every later epoch's order.
            return itertools.islice(batches, limit - skip)
        return batches

    def _training_step(self, module: TrainingModule, batch: Any, batch_idx: int, num_batches: int | float) -> Any:
        """Forward and backward for one batch; an optimizer step at the end of each accumulation."""
        if not self._automatic_optimization:
            with self._forward_context():
                outputs = self.strategy.training_step(self.model, batch, batch_idx)
            return outputs
        steps_now = (batch_idx + 1) % self.accumulate_grad_batches == 0 or batch_idx + 1 == num_batches
        if steps_now:
            outputs, loss = self._forward_backward(batch, batch_idx)
        else:  # accumulating: under DDP the gradients are all-reduced once, at the window's last batch
            with self.strategy.no_backward_sync(self.model, enabled=True):
                outputs, loss = self._forward_backward(batch, batch_idx)
        # Checked later (log step, epoch end, checkpoint), so no host sync here.
        self._unchecked_losses.append((loss.detach(), batch_idx, self.global_step))
        if steps_now and (self.on_nonfinite_loss != "skip" or self._window_is_finite()):
            self._optimizer_step(module)
        return outputs

    def _forward_backward(self, batch: Any, batch_idx: int) -> tuple[Any, torch.Tensor]:
        """training_step inside the callbacks' forward contexts (autocast), then backward outside them."""
        if self._hooks.forward_context:
            with self._forward_context():
                outputs = self.strategy.training_step(self.model, batch, batch_idx)
        else:  # hot loop: nothing wraps the forward, and a `with` costs two calls
            outputs = self.strategy.training_step(self.model, batch, batch_idx)
        loss = loss_of(outputs, batch_idx)
        accumulate = self.accumulate_grad_batches
        self.run_backward(loss / accumulate if accumulate > 1 else loss)
        return outputs, loss

    def _forward_context(self) -> contextlib.AbstractContextManager:
        if not self._hooks.forward_context:
            return _NO_CONTEXT
        contexts = [context for hook in self._hooks.forward_context if (context := hook()) is not None]
        if not contexts:
            return _NO_CONTEXT
        if len(contexts) == 1:
            return contexts[0]
        stack = contextlib.ExitStack()
        for context in contexts:
            stack.enter_context(context)
        return stack

    def run_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the backward seam (AMP scaling) or the strategy."""
        if not loss.requires_grad:
            raise RuntimeError(
                f"The loss at batch {self.batch_idx} does not require grad: every parameter is frozen "
                "(requires_grad=False) or the loss was detached. Unfreeze parameters or return the "
                "loss tensor itself, not loss.item() or loss.detach()."
            )
        if self._backward_owner is not None:
            self._backward_owner.backward(self, self.module, loss)
        else:
            self.strategy.backward(loss)

    def _optimizer_step(self, module: TrainingModule) -> None:
        optimizer = self.optimizers[0]
        for hook in self._hooks.before_optimizer_step:
            hook(self, module, optimizer)
        for hook in self._hooks.module_before_optimizer_step:
            hook(optimizer)
        if self.gradient_clip_val is not None:
            if self.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(self._clip_parameters, self.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(self._clip_parameters, self.gradient_clip_val)
        if self._step_owner is not None:
            stepped = self._step_owner.optimizer_step(self, module, optimizer)
        else:
            optimizer.step()
            stepped = True
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if stepped and self.lr_scheduler_configs:
            self._step_schedulers("step")

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step if interval == "step" else self.current_epoch + 1
        for config in self.lr_scheduler_configs:
            if config.interval != interval or count % config.frequency != 0:
                continue
            if config.needs_metric:
                if config.monitor not in self.callback_metrics:
                    raise RuntimeError(
                        f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged; logged "
                        f"metrics are {sorted(self.callback_metrics)}. Log it with self.log or fix 'monitor'."
                    )
                config.scheduler.step(float(self.callback_metrics[config.monitor]))
            else:
                config.scheduler.step()

    @measured("logging")
    def _log_step(self) -> None:
        """Every log_every_n_steps batches: start this step's copy to the host; publish the last."""
        received = self.metrics.receive()  # copied one log step ago: reading it does not wait
        self.metrics.send_step_values(self.global_step)
        if received is not None:
            step, values, specs = received
            self._publish(values, specs, step)
        self._check_losses()
        self._preemption.agree(self.strategy)  # with several processes: stop on every rank, or none

    def _end_train_epoch(self) -> None:
        self._check_losses()
        self._in_epoch_end = True
        received = self.metrics.receive()
        if received is not None:
            self._publish(received[1], received[2], received[0])
        self.metrics.send_step_values(self.global_step)  # the epoch's last step values, read now
        received = self.metrics.receive()
        values, specs = self.metrics.read_epoch_values(self.metrics.train)
        values.update(received[1])
        specs.update(received[2])
        self._publish(values, specs, self.global_step)
        if self._automatic_optimization:  # as in Lightning, manual optimization steps its own
            self._step_schedulers("epoch")
        for callback in self.callbacks:
            callback.on_train_epoch_end(self, self.module)
        self.module.on_train_epoch_end()
        self.current_epoch += 1
        self._in_epoch_end, self.batch_idx = False, -1

    def _publish(self, values: dict[str, float], specs: dict[str, Any], step: int) -> None:
        """Host values reach callback_metrics, the progress bar and the loggers (on_log)."""
        if not values:
            return
        for key, value in values.items():
            self.callback_metrics[key] = torch.tensor(value)
            if specs[key].prog_bar:
                self.progress_bar_metrics[key] = value
        self.logged_metrics.update(values)
        if not self.sanity_checking:
            for callback in self.callbacks:
                callback.on_log(self, self.module, values, step)

    # =========================================================================================
    # Validation, test, predict
    # =========================================================================================
    def _val_every(self, num_batches: int | float) -> int | None:
        if self.check_val_every_n_epoch is not None and (self.current_epoch + 1) % self.check_val_every_n_epoch != 0:
            return None
        if isinstance(self.val_check_interval, int):
            if self.check_val_every_n_epoch is not None and self.val_check_interval > num_batches:
                raise ValueError(
                    f"Trainer(val_check_interval={self.val_check_interval}) is more than the {num_batches} "
                    "training batches of an epoch, so validation would never run. Use a smaller int, or "
                    "check_val_every_n_epoch=None to count batches across epochs."
                )
            return self.val_check_interval
        if num_batches == math.inf:
            raise ValueError(
                "val_check_interval is a fraction of the epoch, but the training loader has no length. "
                "Use an int val_check_interval (every N batches)."
            )
        return max(1, int(num_batches * self.val_check_interval))

    def _validation_due(self, batch_idx: int, val_every: int, num_batches: int | float) -> bool:
        """As in Lightning: an int interval counts batches of the epoch, or of the whole run when
        check_val_every_n_epoch is None; a float interval also validates after the epoch's last batch."""
        if isinstance(self.val_check_interval, float):
            return (batch_idx + 1) % val_every == 0 or batch_idx + 1 == num_batches
        count = self._train_batches_seen if self.check_val_every_n_epoch is None else batch_idx + 1
        return count % val_every == 0

    @measured("validation")
    def _run_sanity_check(self, val_loader: Any) -> None:
        self.sanity_checking = True
        try:
            limit = self.num_val_batches if self.num_sanity_val_steps == -1 else min(self.num_sanity_val_steps, self.num_val_batches)
            with preserved_rng():  # checking costs the training run no random numbers
                self._evaluation_loop("validate", val_loader, limit)
        finally:
            self.sanity_checking = False

    @measured("validation")
    def _run_validation(self, val_loader: Any) -> None:
        received = self.metrics.receive()  # the last log step's values first: the logs stay in step order
        if received is not None:
            self._publish(received[1], received[2], received[0])
        # Validating leaves every RNG as it found it: the weights do not depend on when (or
        # whether) validation runs, and a checkpoint written just before it resumes exactly.
        with preserved_rng():
            self._evaluation_loop("validate", val_loader, self.num_val_batches)
        self.model.train()
        self.metrics.start_training()

    def _run_evaluation(self, stage: str, loader: Any) -> Any:
        loader = self._prepare_loader(loader, stage, shuffle=False)
        limit = self.num_val_batches
        return self._evaluation_loop(stage, loader, limit)

    def _evaluation_loop(self, stage: str, loader: Any, limit: int | float) -> Any:
        """One pass of validation, test or predict, under ``torch.inference_mode``."""
        module = self.module
        hooks = evaluation_hooks(stage, self.callbacks, module)
        self.model.eval()
        self.metrics.start_evaluation()
        for hook in hooks.start:
            hook(self, module)
        hooks.module_start()
        hooks.module_epoch_start()
        predictions = []
        with torch.inference_mode():
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                batch = self.strategy.batch_to_device(batch)
                with self._forward_context():
                    outputs = hooks.step(batch, batch_idx)
                if stage == "predict":
                    predictions.append(outputs)
                for hook in hooks.batch_end:
                    hook(self, module, outputs, batch, batch_idx)
                self.metrics.keep_evaluation_step_values(batch_idx)  # the batch's on_step values, read at the end
        hooks.module_epoch_end()
        for step, step_values, step_specs in self.metrics.read_evaluation_step_values(stage, not self.sanity_checking):
            self._publish(step_values, step_specs, step)
        values, specs = self.metrics.read_epoch_values(self.metrics.evaluation)
        if not self.sanity_checking:
            self._publish(values, specs, self.global_step)
        for hook in hooks.end:
            hook(self, module)
        hooks.module_end()
        if stage != "predict":
            return [values]
        if self.strategy.world_size > 1:  # every rank returns all of them, in the dataset's order
            gathered = self.strategy.all_gather_object(move_to_device(predictions, torch.device("cpu"), non_blocking=False))
            predictions = [prediction for shard in gathered for prediction in shard]
        return predictions

    # =========================================================================================
    # Loaders
    # =========================================================================================
    def _loader_or_hook(self, loader: Any, module: Any, hook: str, stage: str) -> Any:
        require_training_module(module, stage)  # first: fit reads the module's hooks next
        if loader is None:
            loader = getattr(module, hook)()
        if loader is None:
            argument = "train_dataloaders" if stage == "fit" else "dataloaders"
            raise ValueError(f"Trainer.{stage} got no {argument} and the module's {hook}() returned None. Pass a DataLoader.")
        if isinstance(loader, (list, tuple)) and stage != "fit":
            if len(loader) != 1:
                raise ValueError(f"Trainer.{stage} takes one DataLoader; got {len(loader)}.")
            loader = loader[0]
        return loader

    def _check_run_length(self, loader: Any) -> None:
        if self.max_epochs is None and self.max_steps == -1:
            if loader_length(loader) is None:
                raise ValueError(
                    "The training loader has no length (an IterableDataset) and neither max_epochs nor "
                    "max_steps is set, so training would never end. Pass Trainer(max_steps=N) or max_epochs=N."
                )
            warnings.warn("Neither max_epochs nor max_steps is set; training stops after max_epochs=1000.", stacklevel=3)
            self.max_epochs = 1000

    def _prepare_loader(self, loader: Any, stage: str, shuffle: bool) -> Any:
        """The strategy's shard of ``loader``, seeded (generator and workers), and its number of batches."""
        if isinstance(loader, torch.utils.data.DataLoader):
            changes = {}
            if self.seed is not None and loader.generator is None:
                # Its shuffle order and worker seeds then follow the seed alone, not whatever else
                # draws from torch's global RNG (model code, augmentation in the main process).
                changes.update(seeded_generator(loader, self.seed))
            if loader.num_workers > 0:
                init = loader.worker_init_fn
                if init is None and self.seed is not None:  # seeded workers, distinct per rank
                    init = seed_worker_of_rank(self.strategy.global_rank)
                # Workers ignore SIGTERM/SIGINT: the main process saves and stops (trainer/preemption.py).
                changes["worker_init_fn"] = workers_ignore_preemption(init)
            if changes:
                loader = rebuild_dataloader(loader, **changes)
        if loader_length(loader) == 0:
            raise ValueError(f"The {stage} DataLoader is empty (len 0). Check the dataset and batch_size/drop_last.")
        # Prediction shards in blocks, so that the ranks' outputs put end to end keep the dataset's order.
        loader = self.strategy.setup_dataloader(loader, shuffle=shuffle, contiguous=stage == "predict")
        length = loader_length(loader)
        count = limited_length(length, self.limits[stage])
        if count == 0 and stage == "train":
            raise ValueError("limit_train_batches=0 leaves no batch to train on; use a value > 0.")
        if stage == "train":
            self.num_training_batches = math.inf if count is None else count
        else:
            self.num_val_batches = math.inf if count is None else count
        return loader

    # =========================================================================================
    # Guards: non-finite losses and preemption
    # =========================================================================================
    def _check_losses(self) -> None:
        """on_nonfinite_loss="raise": fail on the first NaN/inf loss since the last check (one host sync)."""
        losses, self._unchecked_losses = self._unchecked_losses, []
        if self.on_nonfinite_loss != "raise" or not losses:
            return
        bad = first_nonfinite(losses)
        if self.strategy.reduce_any(bad is not None):  # every rank raises, none waits at a collective
            raise nonfinite_loss_error(bad, self.current_epoch, self._last_checkpoint)

    def _window_is_finite(self) -> bool:
        """on_nonfinite_loss="skip", before an optimizer step: if a loss of this accumulation window
        is NaN/inf, drop its gradients, count it and return False. Deciding now costs a host sync."""
        losses, self._unchecked_losses = self._unchecked_losses, []
        bad = first_nonfinite(losses)
        if not self.strategy.reduce_any(bad is not None):
            return True
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.num_skipped_steps += 1
        if self.num_skipped_steps == 1 and self.is_global_zero:
            where = f"the loss is {bad[0]} at batch {bad[1]}" if bad is not None else "another rank saw a non-finite loss"
            warnings.warn(f"Skipped an optimizer step at epoch {self.current_epoch}, global step {self.global_step}: "
                          f"{where}. Further skips are counted in trainer.num_skipped_steps.", stacklevel=2)
        return False

    def _ends_window(self, batch_idx: int, num_batches: int | float) -> bool:
        """True after the batch that ends an accumulation window (every batch in manual optimization):
        a checkpoint there holds no half-accumulated gradients."""
        if not self._automatic_optimization:
            return True
        return (batch_idx + 1) % self.accumulate_grad_batches == 0 or batch_idx + 1 == num_batches

    def _save_for_preemption(self) -> None:
        """A preemption signal arrived: publish what was logged, write last.ckpt, stop the loop."""
        received = self.metrics.receive()  # the copy sent at the last log step
        if received is not None:
            self._publish(received[1], received[2], received[0])
        self.metrics.send_step_values(self.global_step)  # and what was logged since
        step, values, specs = self.metrics.receive()
        self._publish(values, specs, step)
        if self.checkpoint_callback is not None:
            path = self.checkpoint_callback.write_last(self)
        else:
            path = Path(self.log_dir) / "checkpoints" / "last.ckpt"
            self.save_checkpoint(path)
        self.should_stop = True
        if self.is_global_zero:
            print(f"Cadence: {self._preemption.reason}; stopped after global step {self.global_step} "
                  f"(epoch {self.current_epoch}, batch {self.batch_idx}) and saved {path}. Run the same command "
                  "with fit(..., ckpt_path=\"last\") to resume.", file=sys.stderr, flush=True)

    # =========================================================================================
    # Checkpoint state
    # =========================================================================================
    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike, stage: str) -> Path | None:
        directories = [Path(c.dirpath) for c in self.callbacks
                       if isinstance(c, callbacks_package.ModelCheckpoint) and c.dirpath is not None]
        versions = versions_root(self.loggers, self.default_root_dir)
        return checkpoint_io.resolve_ckpt_path(ckpt_path, stage, directories, versions, self.is_global_zero)

    # =========================================================================================
    # Small helpers
    # =========================================================================================
    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def loggers(self) -> list[Callback]:
        """The loggers among the callbacks (``callbacks.Logger``), in order (Lightning's name)."""
        return [callback for callback in self.callbacks if isinstance(callback, callbacks_package.Logger)]

    @property
    def logger(self) -> Callback | None:
        """The first logger, or None (Lightning's name)."""
        return next(iter(self.loggers), None)

    @property
    def checkpoint_callback(self) -> Callback | None:
        """The first ``ModelCheckpoint`` among the callbacks (Lightning's name), or None."""
        return next((c for c in self.callbacks if isinstance(c, callbacks_package.ModelCheckpoint)), None)


#: One context serves every evaluation batch and manual-optimization step without a forward
#: context: nullcontext keeps no state.
_NO_CONTEXT = contextlib.nullcontext()
