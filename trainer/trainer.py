"""The Trainer: fit / validate / test / predict, and THE loop, readable top to bottom.

``fit`` comes first and its docstring is the loop in pseudocode; the helpers follow in the order
they are called. Everything about *where* the loop runs is the strategy's (``strategies/``);
everything that happens *around* it is a callback's (``callbacks/``). The loop names only
``Strategy`` and ``Callback`` methods.

Performance notes are marked "hot loop": nothing there converts a tensor to a Python value.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import callbacks as callbacks_package
from callbacks import Callback
from strategies import Strategy
from strategies.transfer import move_to_device
from trainer import properties
from trainer.arguments import check_trainer_arguments, loss_of
from trainer.data_source import HOOKS, STAGE_KIND, DataSource, collect_data
from trainer.datamodule import DataModule
from trainer.guards import check_losses, window_is_finite
from trainer.hooks import evaluation_hooks, step_hooks
from trainer.metrics import MetricStore, format_results, split_by_dataloader
from trainer.module import TrainingModule
from trainer.optim import SchedulerConfig, clip_gradients, ends_accumulation_window, step_schedulers
from trainer.precision import add_precision_callback
from trainer.preemption import Preemption, save_for_preemption
from trainer.publish import publish, publish_received, publish_train_epoch
from trainer.schedule import may_stop, say_nothing_to_train, validation_due, validation_interval
from trainer.seed import preserved_rng, seed_everything, set_cublas_workspace_config
from trainer.setup import setup_model
from trainer.shorthands import reject_unknown_arguments
from trainer.shorthands import translate as translate_shorthands
from trainer.stage import enter_stage, prepare_launch, setup_stage, teardown_stage
from trainer.stage_loaders import estimated_stepping_batches as estimated_steps
from trainer.stage_loaders import evaluation_loaders, load_fit_data, reload_due, train_batches
from trainer.state import (
    fitted_module, handoff_state, read_checkpoint, receive_handoff, restore, training_state, write_checkpoint,
)
from trainer.timing import PhaseTimes, measured
from trainer.trial import restore_snapshot, seam_owners, take_snapshot

STAGES = ("fit", "validate", "test", "predict")
CheckpointPath = str | os.PathLike | None  # a file, "last", "best" (validate, test, predict) or None


class Trainer:
    """Trains a :class:`TrainingModule` with one fixed loop; where it runs is the ``strategy``.

    Args mean what they mean in PyTorch Lightning; the ones Cadence adds:
        seed: seed Python, NumPy, torch and DataLoader workers (per worker and per rank) first.
        deterministic: also ask PyTorch for deterministic kernels (slower on GPUs).
        on_nonfinite_loss: a NaN or infinite training loss ``"raise"``s an error naming the batch
            and the last good checkpoint (checked at log steps: no per-step sync), or ``"skip"``s
            that optimizer step (one host sync per step; counted in ``num_skipped_steps``), or
            is ``"ignore"``d.
        precision: ``"bf16-mixed"`` or ``"16-mixed"`` adds a ``callbacks.AMP`` (autocast, and a
            GradScaler for float16); under FSDP it sets the strategy's mixed-precision policy.
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
        devices: int | str | list[int] = "auto",
        precision: str | int | None = None,
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
        accelerator: str = "auto",
        num_nodes: int = 1,
        fast_dev_run: bool | int = False,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | datetime.timedelta | dict[str, int] | None = None,
        overfit_batches: int | float = 0.0,
        enable_model_summary: bool = True,
        benchmark: bool | None = None,
        detect_anomaly: bool = False,
        inference_mode: bool = True,
        use_distributed_sampler: bool = True,
        sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        profiler: str | Callback | None = None,
        report: bool = True,
        **unknown: Any,
    ) -> None:
        reject_unknown_arguments(unknown, Trainer.__init__)  # a close match, or the Cadence way (trainer/shorthands.py)
        limits = {"train": limit_train_batches, "validate": limit_val_batches,
                  "test": limit_test_batches, "predict": limit_predict_batches}
        check_trainer_arguments(
            max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=accumulate_grad_batches,
            log_every_n_steps=log_every_n_steps, check_val_every_n_epoch=check_val_every_n_epoch,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval, limits=limits, num_sanity_val_steps=num_sanity_val_steps,
            on_nonfinite_loss=on_nonfinite_loss, min_epochs=min_epochs, min_steps=min_steps,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs,
            flags={"benchmark": benchmark, "detect_anomaly": detect_anomaly, "inference_mode": inference_mode,
                   "use_distributed_sampler": use_distributed_sampler, "sync_batchnorm": sync_batchnorm},
        )
        if seed is not None:
            seed_everything(seed)  # validates; seeded again at the start of each stage
        if deterministic:
            set_cublas_workspace_config()  # before cuBLAS first runs; the rest at the start of each stage

        # Lightning's shorthands become a strategy, callbacks and the plain settings below.
        run = translate_shorthands(
            accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, callbacks=callbacks,
            logger=logger, enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing,
            enable_model_summary=enable_model_summary, fast_dev_run=fast_dev_run, overfit_batches=overfit_batches,
            max_time=max_time, max_epochs=max_epochs, max_steps=max_steps, limits=limits,
            num_sanity_val_steps=num_sanity_val_steps, val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch, benchmark=benchmark, detect_anomaly=detect_anomaly,
            sync_batchnorm=sync_batchnorm,
        )
        self.strategy = run.strategy
        self.strategy.validate()
        self.callbacks = add_precision_callback(precision, self.strategy, run.callbacks)  # "16-mixed" -> AMP
        self.callbacks = callbacks_package.observability_callbacks(self.callbacks, profiler=profiler, report=report)
        self.max_epochs, self.max_steps = run.max_epochs, run.max_steps
        self.min_epochs, self.min_steps = min_epochs, min_steps
        self.fast_dev_run = fast_dev_run
        self.overfit_batches = overfit_batches
        self.val_check_interval = run.val_check_interval
        self.check_val_every_n_epoch = run.check_val_every_n_epoch
        self.limits = run.limits
        self.num_sanity_val_steps = run.num_sanity_val_steps
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.use_distributed_sampler = use_distributed_sampler
        self.inference_mode = inference_mode
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = Path(default_root_dir) if default_root_dir is not None else Path.cwd()
        self.seed = seed
        self.deterministic = deterministic
        self.on_nonfinite_loss = on_nonfinite_loss

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
        self.num_val_batches: list[int | float] = []  # per validation loader (also for Trainer.validate)
        self.num_test_batches: list[int | float] = []
        self.num_predict_batches: list[int | float] = []
        self.lightning_module: TrainingModule | None = None  # the module of the running or last stage
        self.datamodule: DataModule | None = None  # the DataModule of the latest stage given one
        self._data: DataSource | None = None  # where the running stage's loaders come from
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
        self._end_of_fit: tuple[TrainingModule, dict] | None = None  # (module, training_state) when fit ended
        self._preemption = Preemption()
        self._stage_loaders: list[Any] = []  # the loaders this stage made (trainer/stage_loaders.py)
        self._early_fit_data: tuple[Any, Any] | None = None  # fit's loaders, made for estimated_stepping_batches
        self._fit_loaders: tuple[Any, list[Any] | None] | None = None  # (train, val or None: no validation) fit runs
        self._evaluation_loaders: tuple[list[Any], list[int | float]] | None = None  # (loaders, batches) of validate...
        self._described: str | None = None  # the device report last printed (trainer/stage.py)
        self.phase_times = PhaseTimes()  # host seconds per phase, for the performance report

    # =========================================================================================
    # The public entry points
    # =========================================================================================
    def fit(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | os.PathLike | None = None) -> None:
        """Train ``model``. What happens, in order:

            module.configure_callbacks (they join the Trainer's callbacks)
            strategy.launch (DDP spawns here, or joins a torchrun group)
            seed; prepare_data (datamodule, module: local rank zero; the others wait)
            setup hooks (datamodule, callbacks, module); module.configure_model; move the model once;
            callbacks' configure_model; strategy wrap (DDP, FSDP); configure_optimizers
            train_dataloader, val_dataloader (given, or the datamodule's or module's hooks)
            restore ckpt_path if given (on_load_checkpoint: the module's, then the callbacks')
            on_fit_start
            on_sanity_check_start -> sanity validation (num_sanity_val_steps batches, nothing logged)
                -> on_sanity_check_end
            on_train_start
            each epoch until max_epochs, max_steps or should_stop (once min_epochs/min_steps are met):
                every reload_dataloaders_every_n_epochs: the loaders again from their hooks
                on_train_epoch_start
                each batch: to device (CUDA: copied ahead on a side stream) -> on_train_batch_start
                    -> forward (training_step) under the callbacks' forward contexts
                    -> on_before_backward -> backward (no all-reduce while accumulating) -> on_after_backward
                    -> every accumulate_grad_batches-th batch: unscale (AMP float16), on_before_optimizer_step,
                       clip, optimizer step or the scaler's, which may skip it (all three inside the module's
                       optimizer_step when it overrides it), then on_before_zero_grad, zero grad (the module's
                       optimizer_zero_grad), step-interval schedulers (not after a skipped step)
                    -> on_train_batch_end -> every log_every_n_steps: on_log, non-finite loss check
                    -> at val_check_interval: on_log (the last log step's values, so logs stay in step
                       order), then validation (on_validation_start, on_validation_epoch_start,
                       each batch on_validation_batch_start/end, on_validation_epoch_end, on_validation_end)
                    -> after SIGTERM/SIGUSR1, once the accumulation window ends: write last.ckpt, stop
                epoch metrics -> on_log; epoch-interval schedulers
                on_train_epoch_end
            (the state that save_checkpoint writes after fit is taken here)
            on_train_end
            on_fit_end
            teardown: datamodule, callbacks, module (also after an error, which first calls on_exception)
            SystemExit(128 + signal number) if a signal stopped the run

        The data: loaders (``val_dataloaders`` may be a list or dict of them), or a ``DataModule``
        (``datamodule=dm``, or ``fit(model, dm)``), or neither (the module's ``*_dataloader`` hooks).
        Callbacks run in the order given, each before the module's hook of the same name; a hook
        that nobody implements costs nothing per step. A checkpoint gets every callback's
        ``state_dict``, then ``on_save_checkpoint`` (the callbacks', then the module's).
        ``ckpt_path`` is a checkpoint file, or "last" (``trainer/checkpoint.py``): the run then
        continues exactly where that checkpoint was written, in the same log directory.

        Where Cadence differs from Lightning on purpose: the gradients are cleared right after
        the optimizer step (Lightning clears them before the next window's backward: the same
        gradients, but here their memory is free during the next forward), and an
        ``optimizer_step`` override runs after the batch's forward and backward, so its closure
        returns the loss instead of computing it.
        """
        data = collect_data("fit", model, train_dataloaders, val_dataloaders, datamodule,
                            validates=self.limits["validate"] != 0)
        self._launch("fit", model, data, ckpt_path)

    def validate(self, model: TrainingModule | None = None, dataloaders: Any = None, ckpt_path: CheckpointPath = None,
                 datamodule: DataModule | None = None, verbose: bool = True) -> list[dict[str, float]]:
        """Run ``validation_step`` over ``dataloaders`` (one loader, or a list or dict of them);
        return one dict of epoch metrics per loader, ``[{metric: value}]``.

        Without ``model``: the module of the last ``fit``, with the weights of ``ckpt_path``
        (``"best"``, ``"last"`` or a file; when not given, the best checkpoint of that fit, if any).
        ``verbose`` prints the metrics on rank zero.
        """
        return self._evaluate("validate", model, dataloaders, ckpt_path, datamodule, verbose)

    def test(self, model: TrainingModule | None = None, dataloaders: Any = None, ckpt_path: CheckpointPath = None,
             datamodule: DataModule | None = None, verbose: bool = True) -> list[dict[str, float]]:
        """Run ``test_step`` over ``dataloaders``; return one dict of epoch metrics per loader
        (see :meth:`validate` for ``model``, ``ckpt_path`` and ``verbose``)."""
        return self._evaluate("test", model, dataloaders, ckpt_path, datamodule, verbose)

    def predict(self, model: TrainingModule | None = None, dataloaders: Any = None, ckpt_path: CheckpointPath = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None) -> list[Any] | None:
        """Run ``predict_step`` over ``dataloaders``; return the outputs, one per batch, in order (a
        list of such lists for several loaders; None with ``return_predictions=False``).

        Under DDP each rank predicts one contiguous block of the dataset, and the outputs of all
        ranks come back (to the caller of a spawned run, and on every rank under torchrun) end to
        end, on the CPU: the whole dataset, in order, each sample once. See :meth:`validate` for
        ``model`` and ``ckpt_path``.
        """
        predictions = self._evaluate("predict", model, dataloaders, ckpt_path, datamodule, verbose=False)
        return None if return_predictions is False else predictions

    @measured("checkpointing")
    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the whole training state to ``path`` atomically, in the strategy's layout: one file
        that rank zero writes while all ranks wait, or under FSDP a directory of every rank's shards.

        During a stage (from a callback or a module hook), call it on every rank; all ranks wait
        for the write. A checkpoint written at the end of a batch resumes after that batch; see
        ``trainer/checkpoint.py``. After ``fit`` returns (also after a spawned DDP fit), it
        writes the state the fit ended with: the fitted module's weights as they are now, its
        optimizers, schedulers, counters and every rank's RNG states as the last step left them,
        so ``fit(model, ckpt_path=path)`` with a larger ``max_epochs`` continues exactly.
        """
        write_checkpoint(self, path)  # trainer/state.py

    # The seams of the Tuner's searches (trainer/tuner.py, callbacks/lr_finder.py, callbacks/batch_size_finder.py).
    def run_search(self, search: Callable[[Trainer, TrainingModule], Any], model: TrainingModule, method: str = "fit",
                   train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
                   datamodule: DataModule | None = None) -> Any:
        """Set ``model`` up as ``method`` ("fit", "validate", "test" or "predict") does, with its
        loaders; run ``search(trainer, module)`` instead of the loop; tear down; return what
        ``search`` returned (rank zero's, when the strategy starts processes). Only the setup and
        teardown hooks run, and nothing trains unless ``search`` calls :meth:`run_trial`."""
        if method not in STAGES:
            raise ValueError(f"method {method!r} is invalid. Should be one of {STAGES}.")
        data = collect_data(method, model, train_dataloaders if method == "fit" else dataloaders, val_dataloaders,
                            datamodule, previous_datamodule=None if method == "fit" else self.datamodule,
                            validates=self.limits["validate"] != 0)
        trainable = [parameter.requires_grad for parameter in model.parameters()]
        try:
            return self._launch(method, model, data, None, search)
        finally:  # a setup hook (BaseFinetuning) may have frozen some: the model is left as it was given
            for parameter, requires_grad in zip(model.parameters(), trainable):
                parameter.requires_grad_(requires_grad)

    def run_trial(self, num_steps: int, callbacks: list[Callback] = (),
                  schedulers: Callable[[list[torch.optim.Optimizer]], list[Any]] | None = None) -> None:
        """Run the stage's loop a little from a hook, then put everything back, for a search.

        In fit (from ``on_fit_start`` or ``on_train_epoch_start``): train up to ``num_steps``
        optimizer steps, over as many epochs as that takes, without validation, stepping each step
        only the schedulers ``schedulers(optimizers)`` returns (made after the state is kept aside,
        so they may set the learning rates). In validate, test or predict (from ``on_<stage>_start``): run
        ``num_steps`` batches of the first loader. Only ``callbacks`` and the callbacks that own a
        seam (AMP) run; nothing reaches the loggers, a non-finite loss is no error, and
        ``trainer.should_stop`` ends the trial. Afterwards the weights, optimizers, schedulers,
        counters, RNG states, metrics and settings are as they were, also when the trial raised
        (``torch.OutOfMemoryError``), which then propagates. The module's hooks run as in any epoch.
        """
        module = self.module
        if module is None:
            raise RuntimeError("Trainer.run_trial runs the loop of a running stage: call it from a hook "
                               "(on_fit_start, on_train_epoch_start, on_test_start, ...).")
        seams, sampler = seam_owners(self.callbacks), self._train_sampler if self.stage == "fit" else None
        schedulers_before = [config.scheduler for config in self.lr_scheduler_configs]
        snapshot = take_snapshot(module, self.optimizers, schedulers_before, seams, sampler)
        saved = (self.callbacks, self._hooks, self.lr_scheduler_configs, self.metrics, self.phase_times,
                 self._preemption, self._unchecked_losses, self._resume_position, self._fit_loaders,
                 self._evaluation_loaders, self.should_stop, self.on_nonfinite_loss, self.min_epochs, self.min_steps,
                 self.max_epochs, self.max_steps, self.current_epoch, self.global_step, self.batch_idx,
                 self._train_batches_seen, self.callback_metrics, self.logged_metrics, self.progress_bar_metrics)
        self.callbacks = [*seams, *callbacks]
        self.metrics = MetricStore(self.strategy.all_reduce, self.strategy.all_gather_object)
        self.phase_times, self._preemption, self._unchecked_losses, self._resume_position = PhaseTimes(), Preemption(), [], None
        self.should_stop, self.on_nonfinite_loss, self.min_epochs, self.min_steps = False, "ignore", None, None
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
        try:
            if self.stage == "fit":
                self._hooks = step_hooks(self.callbacks, module)
                made = schedulers(self.optimizers) if schedulers is not None else []
                self.lr_scheduler_configs = [SchedulerConfig(scheduler, interval="step") for scheduler in made]
                self.max_epochs, self.max_steps = -1, self.global_step + num_steps
                self._fit_loaders = (self._fit_loaders[0], None)
                while not self._finished():
                    self._run_train_epoch()
            else:
                loaders, counts = self._evaluation_loaders
                self._evaluation_loaders = (loaders[:1], [min(num_steps, counts[0])])
                self._evaluation_loop(self.stage, *self._evaluation_loaders)
        finally:
            (self.callbacks, self._hooks, self.lr_scheduler_configs, self.metrics, self.phase_times,
             self._preemption, self._unchecked_losses, self._resume_position, self._fit_loaders,
             self._evaluation_loaders, self.should_stop, self.on_nonfinite_loss, self.min_epochs, self.min_steps,
             self.max_epochs, self.max_steps, self.current_epoch, self.global_step, self.batch_idx,
             self._train_batches_seen, self.callback_metrics, self.logged_metrics, self.progress_bar_metrics) = saved
            restore_snapshot(snapshot, module, self.optimizers, schedulers_before, seams, sampler)

    def reload_dataloaders(self) -> list[Any]:
        """Make the running stage's loaders again from their hooks (the module's or the DataModule's
        ``train_dataloader()``, ...), as after a search changed the batch size. From
        ``on_fit_start`` or ``on_train_epoch_start``, the coming epoch runs on the new loaders; from
        ``on_test_start`` (or validate's, predict's), the stage does. Returns them: ``[train loader]``
        in fit, else the stage's loaders."""
        data = self._data
        if data is None:
            raise RuntimeError("Trainer.reload_dataloaders() remakes the loaders of a running stage: call it from a "
                               "hook (on_fit_start, on_train_epoch_start, on_test_start, ...).")
        kind = "train" if self.stage == "fit" else STAGE_KIND[self.stage]
        if not data.from_hook(kind):
            raise ValueError(f"Trainer.reload_dataloaders() cannot remake loaders passed as "
                             f"{data.argument_text(kind)}. Return them from {HOOKS[kind]}() of the module or of a "
                             "DataModule.")
        self._make_loaders(self.stage, data)
        return [self._fit_loaders[0]] if self.stage == "fit" else list(self._evaluation_loaders[0])

    # =========================================================================================
    # Launch and per-process setup
    # =========================================================================================
    def _evaluate(self, stage: str, model: TrainingModule | None, dataloaders: Any, ckpt_path: Any, datamodule: Any,
                  verbose: bool) -> Any:
        if model is None:  # the module of the last fit, by default with its best checkpoint
            model, ckpt_path = fitted_module(self, stage, ckpt_path)
        data = collect_data(stage, model, dataloaders, None, datamodule, previous_datamodule=self.datamodule)
        output = self._launch(stage, model, data, ckpt_path)
        if verbose and self.is_global_zero and (table := format_results(output, stage)):
            print(table)
        return output

    def _launch(self, stage: str, module: TrainingModule, data: DataSource, ckpt_path: Any,
                search: Callable[[Trainer, TrainingModule], Any] | None = None) -> Any:
        ckpt_path = prepare_launch(self, stage, module, data, ckpt_path)  # callbacks, ckpt_path, log_dir
        output, handoff = self.strategy.launch(self._run_stage, stage, module, data, ckpt_path, search)
        if handoff is not None:  # the work ran in other processes: bring its results here
            receive_handoff(self, module, handoff, data.datamodule)
        self._preemption.exit_if_stopped()  # SystemExit(128 + signal) once a signal stopped fit
        return output

    def _make_loaders(self, stage: str, data: DataSource) -> None:
        """The stage's loaders, prepared (fit's may exist already: made for estimated_stepping_batches)."""
        if stage == "fit":
            self._fit_loaders, self._early_fit_data = self._early_fit_data or load_fit_data(self, data), None
        else:
            self._evaluation_loaders = evaluation_loaders(self, stage, data.loaders(STAGE_KIND[stage]))

    def _run_stage(self, stage: str, module: TrainingModule, data: DataSource, ckpt_path: Any,
                   search: Callable[[Trainer, TrainingModule], Any] | None = None) -> tuple[Any, Any]:
        """Everything one process does for one stage; returns (output, handoff for the caller)."""
        enter_stage(self, stage, module, data)  # this process's rank, rank zero's log_dir (trainer/stage.py)
        try:
            setup_stage(self, stage, module, data)  # seed, prepare_data, the setup hooks
            self._hooks = step_hooks(self.callbacks, module)
            self.model = setup_model(self, module, stage)  # the one setup order (trainer/setup.py)
            if search is not None:  # run_search: the search in place of the stage's loop
                self._make_loaders(stage, data)
                output = search(self, module)
            elif stage == "fit":
                with self._preemption.handle_signals(self.strategy.world_size):  # SIGTERM/SIGUSR1: save, stop
                    output = self._run_fit(module, data, ckpt_path)
            else:
                checkpoint = read_checkpoint(ckpt_path, data.datamodule)
                if ckpt_path is not None:
                    restore(self, ckpt_path, model_only=True, state=checkpoint)
                self._make_loaders(stage, data)
                output = self._evaluation_loop(stage, *self._evaluation_loaders)
            handoff = handoff_state(self, module, stage, data.datamodule) if self.strategy.launches_subprocesses else None
            return output, handoff
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self, module, error)
            raise
        finally:
            teardown_stage(self, stage, module, data)  # the teardown hooks, the strategy's
            self._fit_loaders = self._evaluation_loaders = None

    # Manual optimization's optimizer hooks (registered by trainer/setup.py): per step, so here.
    def _count_manual_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.global_step += 1

    def _before_manual_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._hooks.call_before_optimizer_step(self, self.module, optimizer)

    # =========================================================================================
    # fit: the loop
    # =========================================================================================
    def _run_fit(self, module: TrainingModule, data: DataSource, ckpt_path: Any) -> None:
        checkpoint = read_checkpoint(ckpt_path, data.datamodule)
        self._make_loaders("fit", data)
        self.should_stop, self._resume_position, self._unchecked_losses = False, None, []
        self._said_min_not_met = False
        self._end_of_fit = None
        if ckpt_path is not None:
            restore(self, ckpt_path, state=checkpoint)
        for callback in self.callbacks:
            callback.on_fit_start(self, module)
        module.on_fit_start()
        val_loaders = self._fit_loaders[1]  # after on_fit_start: a search there may have made new loaders
        if val_loaders is not None and self._resume_position is None and self.num_sanity_val_steps != 0:
            self._run_sanity_check(val_loaders)
        for callback in self.callbacks:
            callback.on_train_start(self, module)
        module.on_train_start()
        self.strategy.check_placement(module)  # once, before the first step
        loaded_at = self.current_epoch
        if self._finished():
            say_nothing_to_train(self)
        while not self._finished():
            if reload_due(self, data, loaded_at):
                self._fit_loaders = load_fit_data(self, data)
                loaded_at = self.current_epoch
            self._run_train_epoch()
        # What save_checkpoint writes after fit returns: this moment's state, as a checkpoint
        # written now would hold it (optimizer states by reference: nothing is copied).
        self._end_of_fit = (module, training_state(self))
        for callback in self.callbacks:
            callback.on_train_end(self, module)
        module.on_train_end()
        for callback in self.callbacks:
            callback.on_fit_end(self, module)
        module.on_fit_end()

    def _finished(self) -> bool:
        return (
            (self.should_stop and may_stop(self))
            or (self.max_steps != -1 and self.global_step >= self.max_steps)
            or (self.max_epochs not in (None, -1) and self.current_epoch >= self.max_epochs)
        )

    def _run_train_epoch(self) -> None:
        module, strategy, hooks = self.module, self.strategy, self._hooks
        self.model.train()
        self.metrics.start_training()
        for callback in self.callbacks:
            callback.on_train_epoch_start(self, module)
        module.on_train_epoch_start()
        train_loader, val_loaders = self._fit_loaders  # after the hooks: a search there may have made new ones
        num_batches = self.num_training_batches
        val_every = None
        if val_loaders is not None:
            val_every = validation_interval(self.val_check_interval, self.check_val_every_n_epoch, self.current_epoch,
                                            num_batches)
        batch_idx = -1
        times, clock = self.phase_times, time.perf_counter  # two host clock reads a batch, no device sync
        times.start_loop(self._train_batches_seen)
        # The strategy moves the batches (on CUDA it copies the next one while this one computes).
        for batch_idx, batch in strategy.batches_on_device(train_batches(self, train_loader)):
            # hot loop: from here to the end of the step, no tensor becomes a Python value.
            times.data_wait += clock() - times.ready
            self.batch_idx = batch_idx
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
            if val_every is not None and validation_due(self.val_check_interval, self.check_val_every_n_epoch, batch_idx,
                                                        val_every, num_batches, self._train_batches_seen):
                self._run_validation(val_loaders)
            times.ready = clock()  # the next batch is asked for now
            if self._preemption.stop_now and ends_accumulation_window(self, batch_idx, num_batches):  # a plain bool read
                save_for_preemption(self)
                return  # mid-epoch: no epoch end (schedulers, hooks); the resumed run finishes the epoch
            if (self.should_stop and may_stop(self)) or (self.max_steps != -1 and self.global_step >= self.max_steps):
                break
        times.end_loop(self._train_batches_seen)
        if batch_idx == -1 and self._resume_position is None:
            raise RuntimeError(
                "The training DataLoader yielded no batches. Check that the dataset is not empty and "
                "that batch_size <= len(dataset) when drop_last=True."
            )
        self._resume_position = None
        self._end_train_epoch()

    def _training_step(self, module: TrainingModule, batch: Any, batch_idx: int, num_batches: int | float) -> Any:
        """Forward and backward for one batch; at the end of each accumulation window the optimizer
        step (the module's optimizer_step takes it when overridden), zero grad and the
        step-interval schedulers."""
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
        # Checked later (log step, epoch end, checkpoint), so no host sync here. A copy, because a
        # CUDA graph replay overwrites the loss in place at the next step (trainer/guards.py).
        self._unchecked_losses.append((loss.detach().clone(), batch_idx, self.global_step))
        if not steps_now or (self.on_nonfinite_loss == "skip" and not window_is_finite(self)):
            return outputs
        optimizer, hooks = self.optimizers[0], self._hooks
        if hooks.module_optimizer_step is None:
            stepped = self._optimizer_step(optimizer)
        else:  # the override calls optimizer.step(closure) (or not: no step, global_step stays)
            stepped = hooks.call_optimizer_step(self.current_epoch, batch_idx, optimizer, self._optimizer_step, loss)
        if hooks.around_zero_grad:
            hooks.call_around_zero_grad(self, module, optimizer, self.current_epoch, batch_idx)
        else:
            optimizer.zero_grad(set_to_none=True)
        if stepped and self.lr_scheduler_configs:
            step_schedulers(self.lr_scheduler_configs, "step", self.global_step, self.callback_metrics)
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
        """``loss.backward()`` through the backward seam (AMP scaling) or the strategy, between
        on_before_backward and on_after_backward when any module or callback implements them."""
        if not loss.requires_grad:
            raise RuntimeError(
                f"The loss at batch {self.batch_idx} does not require grad: every parameter is frozen "
                "(requires_grad=False) or the loss was detached. Unfreeze parameters or return the "
                "loss tensor itself, not loss.item() or loss.detach()."
            )
        if self._hooks.around_backward:  # hot loop: one flag when no hook around backward is implemented
            self._hooks.call_around_backward(self, self.module, loss, self._backward)
        else:
            self._backward(loss)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """unscale (AMP float16), on_before_optimizer_step, clip, step, global_step + 1; False when
        the owner of the step skipped it (AMP found inf gradients): the schedulers then do not step."""
        if self._step_owner is not None:  # true gradients for the hooks and clipping (AMP unscales)
            self._step_owner.unscale_gradients(self, self.module, optimizer)
        if self._hooks.before_step:
            self._hooks.call_before_optimizer_step(self, self.module, optimizer)
        if self.gradient_clip_val is not None:
            # Read at each step: a group added during fit (BaseFinetuning's unfrozen layers) is clipped too.
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            clip_gradients(parameters, self.gradient_clip_val, self.gradient_clip_algorithm)
        if self._step_owner is not None:
            applied = self._step_owner.optimizer_step(self, self.module, optimizer)
        else:
            optimizer.step()
            applied = True
        self.global_step += 1  # counts the steps taken, applied or skipped by AMP (as in Lightning)
        return applied

    @measured("logging")
    def _log_step(self) -> None:
        """Every log_every_n_steps batches: start this step's copy to the host; publish the last."""
        received = self.metrics.receive()  # copied one log step ago: reading it does not wait
        self.metrics.send_step_values(self.global_step)
        if received is not None:
            step, values, specs = received
            publish(self, values, specs, step)
        check_losses(self)
        self._preemption.agree(self.strategy)  # with several processes: stop on every rank, or none

    def _end_train_epoch(self) -> None:
        check_losses(self)
        self._in_epoch_end = True
        publish_train_epoch(self)  # the last log step's values, this step's (read now), the epoch's
        if self._automatic_optimization:  # as in Lightning, manual optimization steps its own
            step_schedulers(self.lr_scheduler_configs, "epoch", self.current_epoch + 1, self.callback_metrics)
        for callback in self.callbacks:
            callback.on_train_epoch_end(self, self.module)
        self.module.on_train_epoch_end()
        self.current_epoch += 1
        self._in_epoch_end, self.batch_idx = False, -1

    # =========================================================================================
    # Validation, test, predict
    # =========================================================================================
    @measured("validation")
    def _run_sanity_check(self, val_loaders: list[Any]) -> None:
        self.sanity_checking = True
        try:
            for callback in self.callbacks:
                callback.on_sanity_check_start(self, self.module)
            steps = math.inf if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
            with preserved_rng():  # checking costs the training run no random numbers
                self._evaluation_loop("validate", val_loaders, [min(steps, count) for count in self.num_val_batches])
            for callback in self.callbacks:
                callback.on_sanity_check_end(self, self.module)
        finally:
            self.sanity_checking = False

    @measured("validation")
    def _run_validation(self, val_loaders: list[Any]) -> None:
        publish_received(self)  # the last log step's values first: the logs stay in step order
        # Validating leaves every RNG as it found it: the weights do not depend on when (or
        # whether) validation runs, and a checkpoint written just before it resumes exactly.
        with preserved_rng():
            self._evaluation_loop("validate", val_loaders, self.num_val_batches)
        self.model.train()
        self.metrics.start_training()

    def _evaluation_loop(self, stage: str, loaders: list[Any], limits: list[int | float]) -> Any:
        """One pass of validation, test or predict over each loader in turn, under
        ``torch.inference_mode`` (``torch.no_grad`` with ``Trainer(inference_mode=False)``)."""
        module = self.module
        several = len(loaders) > 1  # then steps and batch hooks get dataloader_idx, metrics a suffix
        hooks = evaluation_hooks(stage, self.callbacks, module, several)
        self.model.eval()
        self.metrics.start_evaluation()
        for hook in hooks.start:
            hook(self, module)
        hooks.module_start()
        if stage == self.stage:  # validate, test, predict: a search in on_<stage>_start may have made new loaders
            loaders, limits = self._evaluation_loaders
        for hook in hooks.epoch_start:
            hook(self, module)
        hooks.module_epoch_start()
        predictions: list[list[Any]] = []
        with self.strategy.evaluation_context(self.inference_mode):  # no_grad under FSDP
            for dataloader_idx, (loader, limit) in enumerate(zip(loaders, limits)):
                self.metrics.evaluation.dataloader_suffix = f"/dataloader_idx_{dataloader_idx}" if several else ""
                step_index = (dataloader_idx,) if hooks.step_takes_dataloader_idx else ()
                hook_index = (dataloader_idx,) if several else ()
                predictions.append([])
                batches = enumerate(loader) if limit == math.inf else itertools.islice(enumerate(loader), int(limit))
                for batch_idx, batch in self.strategy.batches_on_device(batches):
                    for hook in hooks.batch_start:
                        hook(self, module, batch, batch_idx, *hook_index)
                    for hook in hooks.module_batch_start:
                        hook(batch, batch_idx, *hook_index)
                    with self._forward_context():
                        outputs = hooks.step(batch, batch_idx, *step_index)
                    if stage == "predict":
                        predictions[-1].append(outputs)
                    for hook in hooks.batch_end:
                        hook(self, module, outputs, batch, batch_idx, *hook_index)
                    for hook in hooks.module_batch_end:
                        hook(outputs, batch, batch_idx, *hook_index)
                    self.metrics.keep_evaluation_step_values(batch_idx)  # the batch's on_step values, read at the end
        self.metrics.evaluation.dataloader_suffix = ""
        for hook in hooks.epoch_end:
            hook(self, module)
        hooks.module_epoch_end()
        for step, step_values, step_specs in self.metrics.read_evaluation_step_values(stage, not self.sanity_checking):
            publish(self, step_values, step_specs, step)
        values, specs = self.metrics.read_epoch_values(self.metrics.evaluation)
        if not self.sanity_checking:
            publish(self, values, specs, self.global_step)
        for hook in hooks.end:
            hook(self, module)
        hooks.module_end()
        if stage != "predict":
            return split_by_dataloader(values, len(loaders))
        if self.strategy.world_size > 1:  # every rank returns all of them, in the dataset's order
            for index, shard in enumerate(predictions):
                gathered = self.strategy.all_gather_object(move_to_device(shard, torch.device("cpu"), non_blocking=False))
                predictions[index] = [prediction for rank in gathered for prediction in rank]
        return predictions if several else predictions[0]

    # =========================================================================================
    # Lightning's read-only names, looked up in the strategy and the callbacks (trainer/properties.py)
    # =========================================================================================
    is_global_zero = property(properties.is_global_zero)
    global_rank = property(properties.global_rank)
    world_size = property(properties.world_size)
    progress_bar_callback = property(properties.progress_bar_callback)
    loggers = property(properties.loggers)
    logger = property(properties.logger)
    checkpoint_callback = property(properties.checkpoint_callback)
    estimated_stepping_batches = property(estimated_steps)  # trainer/stage_loaders.py


#: One context serves every evaluation batch and manual-optimization step without a forward
#: context: nullcontext keeps no state.
_NO_CONTEXT = contextlib.nullcontext()
