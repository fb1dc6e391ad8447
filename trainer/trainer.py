"""The Trainer: fit / validate / test / predict, and THE loop, readable top to bottom.

``fit`` comes first and its docstring is the loop in pseudocode; the helpers follow in the order
they are called. Everything about *where* the loop runs is the strategy's (``strategies/``);
everything that happens *around* it is a callback's (``callbacks/``). The loop names only
``Strategy`` and ``Callback`` methods.

Performance notes are marked "hot loop": nothing there converts a tensor to a Python value.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks import Callback
from strategies import Strategy
from trainer.arguments import batch_end_outputs, loss_of, loss_without_grad, no_training_batches, none_batch, skipped_batch
from trainer.data_source import STAGE_KIND, DataSource, collect_data
from trainer.datamodule import DataModule
from trainer.guards import LossGuard
from trainer.hooks import evaluation_hooks, step_hooks, warn_eval_modules
from trainer.metrics import MetricStore
from trainer.results import format_results, split_by_dataloader
from trainer.module import TrainingModule
from trainer.optim import SchedulerConfig, ends_accumulation_window, step_schedulers
from trainer.preemption import Preemption, save_for_preemption
from trainer.properties import TrainerProperties
from trainer.searches import SearchSeams
from trainer.seed import preserved_rng
from trainer.setup import StagePlan, plan_evaluation, plan_optimization, setup_model
from trainer.shorthands import defaults_from_env_vars, reject_unknown_arguments, translate, with_lightning_defaults
from trainer.stage import call_exception_hooks, enter_stage, prepare_launch, setup_stage, teardown_stage
from trainer.stage_loaders import (
    NUM_BATCHES, FitLoaders, evaluation_batches, evaluation_loaders, first_evaluation_batches, lightnings_setup_iterator, gather_predictions, limit_reached,
    load_fit_data, one_or_list, reload_due, resumed_fit_loaders, say_fit_stopped, say_min_not_met, say_trained_nothing, shown_counts, train_batches, val_reload_due, validates_in, validation_schedule,
)
from trainer.state import (
    Progress, failed_fit_state, finish_resumed_batch, fitted_module, handoff_state, is_accumulated_log_step, logger_step, read_checkpoint, receive_handoff, restore, training_state, write_checkpoint,
)
from trainer.timing import PhaseTimes, measured

if TYPE_CHECKING:
    from strategies.checkpoint.background import BackgroundWriter

CheckpointPath = str | os.PathLike | None  # a file, "last", "best" (validate, test, predict) or None


class Trainer(TrainerProperties, SearchSeams):
    """Trains a :class:`TrainingModule` with one fixed loop; where it runs is the ``strategy``.

    Args mean what they mean in PyTorch Lightning (docs/module-and-trainer.md has the table). Cadence's own:
    ``seed`` and ``deterministic`` (seed everything, per rank and worker, first; deterministic kernels),
    ``on_nonfinite_loss`` (a NaN/inf training loss ``"raise"``s, checked at log steps, or its step is
    ``"skip"``ped, a host sync per step, or it is ``"ignore"``d) and ``report`` (after ``fit``, where the time
    went, with advice). ``profiler`` is Lightning's (``"simple"``, ``"advanced"``, ``"pytorch"`` or an object).
    Ctrl-C, SIGTERM and SIGUSR1 during ``fit`` save ``last.ckpt`` at the end of the current step and end
    the process (trainer/preemption.py); ``fit(ckpt_path="last")`` resumes.

    Lightning's read-only members (``is_global_zero``, ``loggers``, ``log_dir``, ...) are views in
    ``trainer/properties.py``; the seams the Tuner's searches run through are in ``trainer/searches.py``.

    Example::

        trainer = Trainer(max_epochs=5, strategy="auto")
        trainer.fit(model, train_loader, val_loader)
        trainer.test(model, test_loader)
    """

    @defaults_from_env_vars  # Lightning's PL_TRAINER_<ARGUMENT> environment variables (trainer/shorthands.py)
    def __init__(
        self, max_epochs: int | None = None, max_steps: int = -1,
        strategy: str | Strategy = "auto", devices: int | str | list[int] = "auto", precision: str | int | None = None,
        callbacks: list[Callback] | Callback | None = None, accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None,
        val_check_interval: int | float | None = None, check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
        num_sanity_val_steps: int | None = None, log_every_n_steps: int | None = None, default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool | None = None, enable_checkpointing: bool | None = None, logger: bool | Callback | list[Callback] | None = None,
        seed: int | None = None, deterministic: bool = False, on_nonfinite_loss: str = "raise",
        accelerator: str = "auto", num_nodes: int = 1, fast_dev_run: bool | int = False,
        min_epochs: int | None = None, min_steps: int | None = None, max_time: str | datetime.timedelta | dict[str, int] | None = None,
        overfit_batches: int | float = 0.0, enable_model_summary: bool | None = None, benchmark: bool | None = None, detect_anomaly: bool = False,
        inference_mode: bool = True, use_distributed_sampler: bool = True, sync_batchnorm: bool = False,
        reload_dataloaders_every_n_epochs: int = 0, profiler: Any = None, report: bool = True, barebones: bool = False, **unknown: Any,
    ) -> None:
        arguments = dict(locals())  # exactly this signature's: nothing else is bound yet
        reject_unknown_arguments(arguments.pop("unknown"), Trainer.__init__)  # a close match, or the Cadence way
        # Every argument checked (None as Lightning's default means it), then Lightning's shorthands (accelerator,
        # precision, fast_dev_run, profiler, ...) made a strategy, callbacks and the settings below (trainer/shorthands.py).
        run = translate(**with_lightning_defaults({name: value for name, value in arguments.items() if name != "self"}))
        self.strategy, self.callbacks, self.default_root_dir = run.strategy, run.callbacks, run.default_root_dir
        self.max_epochs, self.max_steps, self.min_epochs, self.min_steps = run.max_epochs, run.max_steps, min_epochs, min_steps
        self.limits, self.overfit_batches, self.fast_dev_run = run.limits, overfit_batches, run.fast_dev_run
        self.val_check_interval, self.check_val_every_n_epoch = run.val_check_interval, run.check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = run.num_sanity_val_steps, run.log_every_n_steps
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.use_distributed_sampler, self.inference_mode, self.accumulate_grad_batches = use_distributed_sampler, inference_mode, accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, run.gradient_clip_algorithm
        self.seed, self.deterministic, self.on_nonfinite_loss, self.barebones = seed, run.deterministic, on_nonfinite_loss, barebones

        # Public loop state (Lightning names); batch_idx: of the running training batch, -1 before the first.
        self.current_epoch, self.global_step, self.batch_idx = 0, 0, -1
        self.should_stop = self.sanity_checking = False
        self.stage: str | None = None
        self.num_training_batches: int | float = math.inf  # then per loader (num_val_batches also for validate):
        self.num_val_batches, self.num_test_batches, self.num_predict_batches = [], [], []
        self.lightning_module: TrainingModule | None = None  # the module of the running or last stage
        self.datamodule: DataModule | None = None  # the DataModule of the latest stage given one
        self._data: DataSource | None = None  # where the running stage's loaders come from
        self._log_dir: Path | None = None  # the running or last stage's (trainer.log_dir: trainer/properties.py)
        self._ckpt_path, self._ckpt_path_set = None, False  # the last stage's checkpoint; set by the user (properties.py)
        self._evaluation_stage: str | None = None  # the evaluation loop running: "validate", "test" or "predict"
        self.module: TrainingModule | None = None  # the user's module while a stage runs
        self.model: torch.nn.Module | None = None  # what the strategy wrapped (DDP), or the module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.train_dataloader: Any = None  # the training loader as fit runs it (sharded, seeded); then, as in
        self.val_dataloaders = self.test_dataloaders = self.predict_dataloaders = None  # Lightning, one or a list
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.metrics = MetricStore(self.strategy.all_reduce, self.strategy.all_gather_object, barebones=barebones)
        self._progress = Progress()  # where fit is, for checkpoints and resuming (trainer/state.py)
        self._plan: StagePlan | None = None  # what setup decided for the running stage (trainer/setup.py)
        self._guard = LossGuard(on_nonfinite_loss)  # the losses since the last check (trainer/guards.py)
        self._end_of_fit: tuple[TrainingModule, dict] | None = None  # (module, training_state) when fit ended or failed
        self._preemption = Preemption()  # Ctrl-C, SIGTERM, SIGUSR1 during fit (trainer/preemption.py)
        self._stage_loaders: list[Any] = []  # the loaders this stage made (trainer/stage_loaders.py)
        self._fit_loaders: FitLoaders | None = None  # fit's (made early if estimated_stepping_batches asks)
        self._evaluation_loaders: tuple[list[Any], list[int | float]] | None = None  # validate/test/predict's, counts
        self._described: str | None = None  # the device report last printed (trainer/stage.py)
        self._said_min_not_met = False  # the min_epochs/min_steps notice was printed in this fit
        self.phase_times = PhaseTimes()  # host seconds per phase, for the performance report

    # --- the public entry points -----------------------------------------------------------
    def fit(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: CheckpointPath = None, weights_only: bool | None = None,
            **unknown: Any) -> None:
        """Train ``model`` on loaders (``val_dataloaders``: one, a list or a dict), a ``DataModule`` (``fit(model, dm)``), or
        the module's ``*_dataloader`` hooks. ``ckpt_path``: a file or "last"; the run continues exactly where it was written, in
        the same log directory. ``weights_only``: Lightning's; checkpoints are read as plain data (one holding objects is refused).
        The loop does, in order, what docs/module-and-trainer.md ("The loop, in order") lists; a hook nobody implements costs nothing."""
        reject_unknown_arguments(unknown, Trainer.fit, "Trainer.fit", weights_only)  # val_dataloader=: did you mean?
        data = collect_data("fit", model, train_dataloaders, val_dataloaders, datamodule, validates=self.limits["validate"] != 0)
        self._launch("fit", model, data, self._stage_ckpt_path("fit", ckpt_path))  # or trainer.ckpt_path = ...

    def validate(self, model: TrainingModule | None = None, dataloaders: Any = None, ckpt_path: CheckpointPath = None,
                 verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
                 **unknown: Any) -> list[dict[str, float]]:
        """Run ``validation_step`` over ``dataloaders`` (one, a list or a dict); return one dict of epoch metrics per loader.
        Without ``model``: the last ``fit``'s module, with the weights of ``ckpt_path`` ("best", "last" or a file; by default
        that fit's best checkpoint, if any). ``verbose`` prints the metrics; ``weights_only``: as for :meth:`fit`."""
        return self._evaluate("validate", model, dataloaders, ckpt_path, datamodule, verbose, unknown, weights_only)

    def test(self, model: TrainingModule | None = None, dataloaders: Any = None, ckpt_path: CheckpointPath = None,
             verbose: bool = True, datamodule: DataModule | None = None, weights_only: bool | None = None,
             **unknown: Any) -> list[dict[str, float]]:
        """Run ``test_step`` over ``dataloaders``; return one dict of epoch metrics per loader (see :meth:`validate`)."""
        return self._evaluate("test", model, dataloaders, ckpt_path, datamodule, verbose, unknown, weights_only)

    def predict(self, model: TrainingModule | None = None, dataloaders: Any = None, datamodule: DataModule | None = None,
                return_predictions: bool | None = None, ckpt_path: CheckpointPath = None, weights_only: bool | None = None,
                **unknown: Any) -> list[Any] | None:
        """Run ``predict_step`` over ``dataloaders``; return the outputs, one per batch, in order (a list of lists for several
        loaders; None with ``return_predictions=False``); under DDP every sample once, in order, on the CPU. See :meth:`validate`."""
        predictions = self._evaluate("predict", model, dataloaders, ckpt_path, datamodule, False, unknown, weights_only)
        return None if return_predictions is False else predictions

    @measured("checkpointing")
    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool | None = None,
                        storage_options: Any = None, *, background: BackgroundWriter | None = None) -> None:
        """Write the whole training state to ``filepath`` atomically in the strategy's layout (one file, or FSDP's
        shards), callbacks' state included, after on_save_checkpoint (callbacks', then module's). ``weights_only``:
        weights and hyperparameters only (``load_from_checkpoint``, ``validate/test(ckpt_path=...)``; fit cannot
        resume from it). During a stage, call it on every rank; one written at the end of a batch resumes after
        it. After ``fit`` returns (a spawned one too) it writes the state fit ended with (the weights as they are
        now): ``fit(model, ckpt_path=filepath)`` with a larger ``max_epochs`` continues exactly. ``background``
        (``ModelCheckpoint(async_save=True)``'s): wait for a snapshot only, and write it in that writer's thread."""
        if self.module is not None:  # a stage runs: never write weights a NaN/inf loss produced
            self._guard.check(self.strategy, self.current_epoch)
        datamodule = self.datamodule if self._data is not None else None  # as Lightning's: also an earlier stage's
        step = write_checkpoint(self, filepath, self._progress, datamodule, self._end_of_fit, bool(weights_only),
                                storage_options, background)
        if not weights_only:  # the last checkpoint a run can resume from, named when a loss turns NaN
            self._guard.last_checkpoint = (str(filepath), step)

    # --- launch and per-process setup ------------------------------------------------------
    def _evaluate(self, stage: str, model: TrainingModule | None, dataloaders: Any, ckpt_path: Any, datamodule: Any,
                  verbose: bool, unknown: dict[str, Any], weights_only: Any) -> Any:
        reject_unknown_arguments(unknown, getattr(Trainer, stage), f"Trainer.{stage}", weights_only)  # a close match named
        ckpt_path = self._stage_ckpt_path(stage, ckpt_path)  # the one given, or set with trainer.ckpt_path = ...
        if model is None:  # the module of the last fit, by default with its best checkpoint
            model, ckpt_path = fitted_module(self, stage, ckpt_path)
        data = collect_data(stage, model, dataloaders, None, datamodule, previous_datamodule=self.datamodule)
        output = self._launch(stage, model, data, ckpt_path)
        if verbose and self.is_global_zero and (table := format_results(output, stage)):
            print(table)
        return output

    def _launch(self, stage: str, module: TrainingModule, data: DataSource, ckpt_path: Any, search: Any = None) -> Any:
        module.trainer, self.lightning_module = self, module  # both answer after the stage too (test(model=None))
        self.callbacks, self._ckpt_path, self.log_dir = prepare_launch(self, stage, module, ckpt_path, self._log_dir, search is None)
        self.datamodule = data.datamodule if data.datamodule is not None else self.datamodule
        with self._preemption.interruptible(stage, self.is_global_zero):  # KeyboardInterrupt: status 130, one line
            output, handoff = self.strategy.launch(self._run_stage, stage, module, data, self._ckpt_path, search)
        if handoff is not None:  # the work ran in other processes: bring its results here
            self.current_epoch, self.global_step, self._preemption.signal_number, end_of_fit = receive_handoff(
                module, self.callbacks, self.metrics, handoff, self.datamodule)  # also weights, callbacks, metrics
            self._end_of_fit = (module, end_of_fit) if end_of_fit is not None else self._end_of_fit
        self._preemption.exit_if_stopped()  # SystemExit(128 + signal) once a signal stopped fit
        return output

    def _run_stage(self, stage: str, module: TrainingModule, data: DataSource, ckpt_path: Any,
                   search: Callable[[Trainer, TrainingModule], Any] | None) -> tuple[Any, Any]:
        """Everything one process does for one stage (or ``search`` in its loop's place); returns (output, handoff)."""
        enter_stage(self, stage, module, data)  # this process's rank, rank zero's log_dir (trainer/stage.py)
        self._data = data
        try:
            self._described = setup_stage(self, stage, module, data, self._described)  # seed, prepare_data, setup hooks
            hooks = step_hooks(self.callbacks, module, data.datamodule)  # with the batch transfer hooks
            self.model = setup_model(module, self.strategy, self.callbacks, stage)  # the one setup order (trainer/setup.py)
            self._plan = plan_evaluation(hooks, self.model, self.strategy)
            if stage == "fit":
                self.optimizers, self.lr_scheduler_configs, self._plan = plan_optimization(
                    self, module, self.model, hooks, self._forward_backward)
            if search is not None:
                if self._fit_loaders is None:  # fit's are made already if configure_optimizers asked for
                    self._make_loaders(stage, data)  # estimated_stepping_batches
                output = search(self, module)
            elif stage == "fit":
                with self._preemption.handle_signals(self.strategy.world_size, self.is_global_zero):  # save, stop
                    output = self._run_fit(module, data, ckpt_path)
            else:
                checkpoint = read_checkpoint(self.strategy, ckpt_path, module, [], self.datamodule)  # weights only
                if ckpt_path is not None:
                    restore(self, ckpt_path, model_only=True, state=checkpoint)
                self._make_loaders(stage, data)
                output = self._evaluation_loop(stage, *self._evaluation_loaders)
            handoff = (handoff_state(self, module, stage, self.datamodule, self._end_of_fit, self._preemption.stopping_signal())
                       if self.strategy.launches_subprocesses else None)
            return output, handoff
        except BaseException as error:
            call_exception_hooks(self, module, data.datamodule, error)  # the callbacks', then the DataModule's
            self._end_of_fit = failed_fit_state(self, stage, module, self._progress) or self._end_of_fit  # save_checkpoint's
            raise
        finally:
            teardown_stage(self, stage, module, data, self._plan, self._stage_loaders)  # the teardown hooks, the workers
            self.module = self.model = self._data = self._fit_loaders = self._evaluation_loaders = self._plan = None
            self._stage_loaders = []

    # --- fit: the loop ---------------------------------------------------------------------
    def _run_fit(self, module: TrainingModule, data: DataSource, ckpt_path: Any) -> None:
        checkpoint = read_checkpoint(self.strategy, ckpt_path, module, self.optimizers, self.datamodule)
        if self._fit_loaders is None and ckpt_path is None and self.num_sanity_val_steps != 0:  # Lightning's order: the
            self._run_sanity_check(make_only=True)  # sanity check's val loaders (its RNG isolated), then the training loader
        if self._fit_loaders is None or self._fit_loaders.sampler is None:  # made already if configure_optimizers asked for
            self._make_loaders("fit", data, ("train",))  # estimated_stepping_batches; the val loaders when validation first runs
        self.should_stop, self._said_min_not_met, self._end_of_fit, self._progress.resumed, self._guard.losses, self._progress.plateau_due = False, False, None, None, [], False
        if ckpt_path is not None:  # the loop continues where the checkpoint was written
            resumed = restore(self, ckpt_path, state=checkpoint, sampler=self._progress.sampler)
            self.current_epoch, self.global_step, self.batch_idx = resumed.epoch, resumed.global_step, resumed.batches_done - 1
            self._progress.resumed, self._progress.batches_seen, self._progress.plateau_due = resumed, resumed.batches_seen, resumed.plateau_pending
            self._fit_loaders = resumed_fit_loaders(self._fit_loaders, self)  # reloads count from here, as Lightning's
            self.callback_metrics.update(resumed.callback_metrics)
            self._guard.last_checkpoint = (str(ckpt_path), self.global_step)
        for callback in self.callbacks:
            callback.on_fit_start(self, module)
        module.on_fit_start()
        if self._fit_loaders.validates and self._progress.resumed is None and self.num_sanity_val_steps != 0:
            self._run_sanity_check()  # on the val loaders as on_fit_start left them (a search there may make new ones)
        if self._finished():  # a second fit to the same limit, a resume from the end, limit_train_batches=0: as Lightning's, no training hooks
            say_trained_nothing(limit_reached(self.max_epochs, self.max_steps, self.current_epoch, self.global_step, self.limits["train"]), self.is_global_zero)
        else:
            lightnings_setup_iterator(self._fit_loaders.train, self.current_epoch, self._progress)  # its draws first, as Lightning's
            if self._fit_loaders.val_pending and validates_in(self.current_epoch, self.check_val_every_n_epoch):
                self._make_loaders("fit", data, ("val",))  # as Lightning's, for on_train_start (the progress bar)
            if self.is_global_zero:  # Lightning's warning: fit keeps the user's train/eval modes
                warn_eval_modules(module)
            self.metrics.start_training()  # self.log records from on_train_start on (Lightning refuses it before)
            for callback in self.callbacks:
                callback.on_train_start(self, module)
            module.on_train_start()
            self.strategy.check_placement(module)  # once, before the first step
            loaded_at = self.current_epoch
            while not self._finished():
                if reload_due(self.reload_dataloaders_every_n_epochs, self.current_epoch, loaded_at, data):
                    self._make_loaders("fit", data, ("train",))  # the val loaders when validation is next due
                    loaded_at = self.current_epoch
                    lightnings_setup_iterator(self._fit_loaders.train, self.current_epoch, self._progress)  # before on_train_epoch_start
                self._run_train_epoch()
            say_fit_stopped(self.max_epochs, self.max_steps, self.current_epoch, self.global_step, self.is_global_zero)
            for callback in self.callbacks:
                callback.on_train_end(self, module)
            module.on_train_end()
        # What save_checkpoint writes after fit returns (optimizer states by reference: nothing copied).
        self._end_of_fit = (module, training_state(self, self._progress))
        for callback in self.callbacks:
            callback.on_fit_end(self, module)
        module.on_fit_end()

    def _make_loaders(self, stage: str, data: DataSource, kinds: tuple[str, ...] = ("train", "val")) -> None:
        """The stage's loaders, prepared (trainer/stage_loaders.py); the Trainer takes their counts."""
        if stage == "fit":
            loaders = self._fit_loaders = load_fit_data(self, data, self._fit_loaders, kinds)
            self.max_epochs, self.train_dataloader, self._progress.sampler = loaders.max_epochs, loaders.shown, loaders.sampler
            self.num_training_batches, self.num_val_batches = loaders.num_training_batches, loaders.num_val_batches
            self.val_dataloaders = one_or_list(loaders.val)
            self._stage_loaders += loaders.made  # their persistent workers end with the stage
        else:
            loaders, counts = self._evaluation_loaders = evaluation_loaders(self, stage, data.loaders(STAGE_KIND[stage]))
            self._stage_loaders += loaders  # their persistent workers end with the stage
            setattr(self, NUM_BATCHES[stage], shown_counts(loaders, counts))  # a CombinedLoader's: each loader's
            setattr(self, f"{STAGE_KIND[stage]}_dataloaders", one_or_list(loaders))

    def _finished(self) -> bool:
        return (self.should_stop and self._may_stop()) or limit_reached(
            self.max_epochs, self.max_steps, self.current_epoch, self.global_step, self.limits["train"]) is not None

    def _may_stop(self) -> bool:
        """should_stop is set: stop, unless min_epochs/min_steps are not met (said once; as in Lightning)."""
        met = (self.min_epochs or 0) <= self.current_epoch and (self.min_steps or 0) <= self.global_step
        if met or self._preemption.stop_now:  # early stopping waits for them; a preemption signal does not
            return True
        self._said_min_not_met = self._said_min_not_met or say_min_not_met(self.min_epochs, self.min_steps, self.is_global_zero)
        return False

    def _run_train_epoch(self) -> None:
        module, strategy, hooks, progress = self.module, self.strategy, self._plan.hooks, self._progress
        train_metrics = self.metrics.train  # it weighs epoch means by the running batch's size
        self.metrics.start_train_epoch()  # as in Lightning, the modules' train/eval modes are the user's
        for callback in self.callbacks:
            callback.on_train_epoch_start(self, module)
        module.on_train_epoch_start()
        train_loader, validates, num_batches = self._fit_loaders.train, self._fit_loaders.validates, self.num_training_batches  # after the hooks: a search there may have made new ones
        schedule = None if not validates else validation_schedule(self.val_check_interval, self.check_val_every_n_epoch, self.current_epoch, num_batches)
        if progress.resumed is not None:  # checkpointed within a batch's end: what the run that wrote it did next
            finish_resumed_batch(progress, validates, self._run_validation, self.lr_scheduler_configs, self.metrics.fresh_metrics)
        batch_idx = -1
        times, clock = self.phase_times, self.phase_times.clock  # two host clock reads a batch, no device sync
        times.start_loop(progress.batches_seen)
        # The strategy moves the batches (on CUDA it copies the next one while this one computes).
        batches = train_batches(train_loader, self.current_epoch, num_batches, progress, hooks.transfer, hooks.fetch)
        for batch_idx, batch in strategy.batches_on_device(batches):
            # hot loop: from here to the end of the step, no tensor becomes a Python value.
            times.data_wait += clock() - times.ready
            self.batch_idx, train_metrics.batch = batch_idx, batch
            if batch is None:  # as in Lightning: no hooks, no step (said once); on_train_batch_end gets outputs None
                outputs = none_batch()
            else:
                for hook in hooks.batch_start:
                    hook(self, module, batch, batch_idx)
                for hook in hooks.module_batch_start:
                    hook(batch, batch_idx)
                outputs = self._training_step(module, batch, batch_idx, progress.epoch_batches)
                if hooks.batch_end or hooks.module_batch_end:  # Lightning's {"loss": detached, ...}: no graph kept alive
                    outputs = batch_end_outputs(outputs, self.accumulate_grad_batches)
            progress.batches_seen += 1  # first: a checkpoint written in on_train_batch_end counts this batch
            progress.validation_pending = schedule is not None and schedule.due(batch_idx, progress.batches_seen)
            for hook in hooks.batch_end:
                hook(self, module, outputs, batch, batch_idx)
            for hook in hooks.module_batch_end:
                hook(outputs, batch, batch_idx)
            if is_accumulated_log_step(self, progress) if self.accumulate_grad_batches > 1 else progress.batches_seen % self.log_every_n_steps == 0:
                self._log_step()
            if progress.validation_pending or (schedule is not None and self.should_stop and self._may_stop()):
                self._run_validation()  # as in Lightning, stopping mid-epoch (should_stop, once min_epochs/min_steps allow) validates first
            if progress.plateau_due:  # a "step" ReduceLROnPlateau, after the hooks and the validation (its metric may be one), as Lightning
                progress.plateau_due = step_schedulers(self.lr_scheduler_configs, "step", batch_idx + 1, self.metrics.fresh_metrics, plateau=True)
            times.ready = clock()  # the next batch is asked for now
            if self._preemption.stop_now and ends_accumulation_window(batch_idx, self.accumulate_grad_batches, progress.epoch_batches):
                times.end_loop(progress.batches_seen)  # the performance report counts this loop's batches
                self._log(self.metrics.flush(self._logger_step()))  # what was logged since the last log step
                save_for_preemption(self, self._preemption.reason)  # last.ckpt, and should_stop
                return  # mid-epoch: no epoch end (schedulers, hooks); the resumed run finishes the epoch
            if (self.should_stop and self._may_stop()) or (self.max_steps != -1 and self.global_step >= self.max_steps):
                break
        else:  # the loader ran out: one without a length validates after its last batch (val_check_interval=1.0)
            if schedule is not None and schedule.at_epoch_end and (batch_idx != -1 or progress.resumed is not None):
                self._run_validation()
        times.end_loop(progress.batches_seen)
        if batch_idx == -1 and progress.resumed is None:
            no_training_batches(self.max_epochs, self.current_epoch)  # a warning; an error if it would never end
        progress.resumed = None
        self._end_train_epoch()

    def _training_step(self, module: TrainingModule, batch: Any, batch_idx: int, num_batches: int | float) -> Any:
        """Forward and backward for one batch; at the end of each accumulation window the optimizer step
        (the module's optimizer_step takes it when overridden), zero grad, the step-interval schedulers."""
        plan = self._plan
        if not plan.automatic_optimization:
            with plan.hooks.forward_context_manager():
                return plan.training_step(batch, batch_idx)
        steps_now = (batch_idx + 1) % self.accumulate_grad_batches == 0 or batch_idx + 1 == num_batches
        if steps_now:  # plan.forward_backward: _forward_backward, or its owner's (AutoMicrobatch)
            outputs, loss = plan.forward_backward(batch, batch_idx, True)
        else:  # accumulating: under DDP the gradients are all-reduced once, at the window's last batch
            with self.strategy.no_backward_sync(self.model, enabled=True):
                outputs, loss = plan.forward_backward(batch, batch_idx, False)
        if loss is None:  # training_step returned None: no backward for this batch (as in Lightning)
            skipped_batch(self.strategy.world_size, batch_idx)
        else:  # checked later (log step, epoch end, checkpoint): no host sync here; a copy where a CUDA
            recorded = loss.detach()  # graph replay may overwrite the loss in place (trainer/guards.py)
            self._guard.losses.append((recorded.clone() if plan.copy_losses else recorded, batch_idx, self.global_step))
        if not steps_now or (self.on_nonfinite_loss == "skip" and not self._guard.window_is_finite(
                self.strategy, self.optimizers, self.is_global_zero, self.current_epoch, self.global_step)):
            return outputs
        optimizer, hooks = self.optimizers[0], plan.hooks
        step = self._optimizer_step if loss is not None else functools.partial(self._optimizer_step, backward_ran=False)
        if hooks.module_optimizer_step is None:
            stepped = step(optimizer)
        else:  # the override calls optimizer.step(closure) (or not: no step, global_step stays)
            stepped = hooks.call_optimizer_step(self.current_epoch, batch_idx, optimizer, step, loss)
        if hooks.around_zero_grad:
            hooks.call_around_zero_grad(self, module, optimizer, self.current_epoch, batch_idx)
        else:
            optimizer.zero_grad(set_to_none=True)
        if stepped and self.lr_scheduler_configs:  # counts the epoch's batches; a ReduceLROnPlateau steps later (Lightning's order)
            self._progress.plateau_due = step_schedulers(self.lr_scheduler_configs, "step", batch_idx + 1, None, plateau=False)
        if batch_idx + 1 == num_batches and self.lr_scheduler_configs:  # Lightning's: before the last batch's hooks
            step_schedulers(self.lr_scheduler_configs, "epoch", self.current_epoch + 1, self.callback_metrics, plateau=False)
        return outputs

    def _forward_backward(self, batch: Any, batch_idx: int, syncs: bool) -> tuple[Any, torch.Tensor | None]:
        """training_step inside the callbacks' forward contexts (autocast), then backward outside them."""
        plan = self._plan
        if plan.hooks.forward_context:
            with plan.hooks.forward_context_manager():
                outputs = plan.training_step(batch, batch_idx)
        else:  # hot loop: nothing wraps the forward, and a `with` costs two calls
            outputs = plan.training_step(batch, batch_idx)
        if outputs is None:  # the batch is skipped: no backward (trainer/arguments.py skipped_batch)
            return None, None
        loss = outputs if type(outputs) is torch.Tensor and outputs.dim() == 0 else loss_of(outputs, batch_idx)
        if loss.requires_grad and not plan.hooks.around_backward and self.accumulate_grad_batches == 1:
            plan.backward(loss)  # hot loop: run_backward's common case (and loss_of's above) without their calls
        else:
            self.run_backward(loss / self.accumulate_grad_batches if self.accumulate_grad_batches > 1 else loss)
        return outputs, loss

    def run_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the backward seam (AMP) or the strategy, between on_before_backward and
        on_after_backward when any module or callback implements them (manual_backward too)."""
        if not loss.requires_grad:
            raise loss_without_grad(self.batch_idx)
        plan = self._plan
        if plan.hooks.around_backward:  # hot loop: one flag when no hook around backward is implemented
            plan.hooks.call_around_backward(self, self.module, loss, plan.backward)
        else:
            plan.backward(loss)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, backward_ran: bool = True) -> bool:
        """unscale (AMP float16), on_before_optimizer_step, clip, step, global_step + 1; False when the owner of the step skipped
        it (AMP found inf gradients: no scheduler step). After a None last training_step (``backward_ran`` False) it takes none."""
        plan = self._plan
        if plan.step_owner is not None and backward_ran:  # true gradients for the hooks and clipping (AMP unscales)
            plan.step_owner.unscale_gradients(self, self.module, optimizer)
        if plan.hooks.before_step:
            plan.hooks.call_before_optimizer_step(self, self.module, optimizer)
        if plan.clip is not None:  # Trainer(gradient_clip_val=...) or the module's configure_gradient_clipping
            plan.clip(optimizer)
        applied = True  # without an owner, after a skipped backward too: it moves no weight that got no gradient
        if plan.step_owner is None:
            optimizer.step()
        elif backward_ran:
            applied = plan.step_owner.optimizer_step(self, self.module, optimizer)
        self.global_step += 1  # counts the steps taken, applied or skipped by AMP (as in Lightning)
        return applied

    @measured("logging")
    def _log_step(self) -> None:
        """Every log_every_n_steps batches: start this step's copy to the host; publish the last."""
        self._log(self.metrics.log_step(self._logger_step()))
        self._guard.check(self.strategy, self.current_epoch)
        self._preemption.agree(self.strategy)  # with several processes: stop on every rank, or none

    def _end_train_epoch(self) -> None:
        self._guard.check(self.strategy, self.current_epoch)
        self._progress.in_epoch_end = True
        step = self._logger_step()
        self._log(self.metrics.end_train_batches(step))  # the epoch's values so far in callback_metrics, for the hooks
        automatic = self._plan.automatic_optimization  # as in Lightning, manual optimization steps its own
        if automatic and math.isinf(self._progress.epoch_batches):  # no last batch was known (an early stop)
            step_schedulers(self.lr_scheduler_configs, "epoch", self.current_epoch + 1, self.callback_metrics, plateau=False)
        for callback in self.callbacks:
            if not callback.monitors_metrics:
                callback.on_train_epoch_end(self, self.module)
        self.module.on_train_epoch_end()
        self.metrics.read_epoch_end(self.metrics.train)  # what the hooks logged, for the monitors
        for callback in self.callbacks:
            if callback.monitors_metrics:
                callback.on_train_epoch_end(self, self.module)
        if automatic and self.is_last_batch:  # ReduceLROnPlateau after the hooks (they may log its metric); not when cut short, as Lightning
            step_schedulers(self.lr_scheduler_configs, "epoch", self.current_epoch + 1, self.callback_metrics, plateau=True)
        self._log(self.metrics.end_train_epoch(step))  # the epoch's record, as Lightning writes it after the hooks
        self.current_epoch += 1
        self._progress.in_epoch_end, self.batch_idx = False, -1

    def _logger_step(self) -> int:
        return logger_step(self, self._progress, self._plan.automatic_optimization) if self.stage == "fit" else self.batches_that_stepped

    def _log(self, published: list[tuple[int, dict[str, float]]]) -> None:
        """The loggers' on_log for the values the metric store published (trainer/metrics.py)."""
        if not self.sanity_checking:
            for step, logged, callback in self.metrics.on_log_calls(published, self.callbacks):
                callback.on_log(self, self.module, logged, step)

    # --- validation, test, predict ---------------------------------------------------------
    @measured("validation")
    def _run_sanity_check(self, make_only: bool = False) -> None:
        self.sanity_checking = True
        try:
            with preserved_rng():  # checking costs the training run no random numbers (val_dataloader() included, as Lightning's)
                if self._fit_loaders is None or self._fit_loaders.val_pending:  # made now: val_dataloader() sees sanity_checking
                    self._make_loaders("fit", self._data, ("val",))
                if make_only or self._fit_loaders.val is None:  # they have no batch
                    return
                for callback in self.callbacks:
                    callback.on_sanity_check_start(self, self.module)
                steps = math.inf if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
                self._evaluation_loop("validate", self._fit_loaders.val, [min(steps, count) for count in self._fit_loaders.val_limits])
                for callback in self.callbacks:  # as Lightning's, within the isolated RNG: what it draws is undone
                    callback.on_sanity_check_end(self, self.module)
            self.metrics.end_sanity_check()  # its values are not the run's (as in Lightning); self.log trains again
        finally:
            self.sanity_checking = False

    @measured("validation")
    def _run_validation(self) -> None:
        self._progress.validation_pending = False  # a checkpoint from here on resumes after it
        if val_reload_due(self.reload_dataloaders_every_n_epochs, self.current_epoch, self._fit_loaders, self._data):
            self._make_loaders("fit", self._data, ("val",))  # as in Lightning: first when validation runs, then every n epochs
        if self._fit_loaders.val is None:  # their loaders have no batch
            return
        self._log(self.metrics.before_validation(self._logger_step()))  # the loggers' pending values first, in step order
        if ends_accumulation_window(self.batch_idx, self.accumulate_grad_batches, self._progress.epoch_batches):
            self.module.on_validation_model_zero_grad()  # default: module.zero_grad(), every gradient freed (Lightning)
        # It draws from the global RNG (the val loader's iter(), the steps' draws) as Lightning's: the same data order after it.
        self._evaluation_loop("validate", self._fit_loaders.val, self._fit_loaders.val_limits)
        self.metrics.start_training()

    def _evaluation_loop(self, stage: str, loaders: list[Any], limits: list[int | float]) -> Any:
        """One pass of validation, test or predict over each loader in turn, hooks included (as in Lightning),
        under ``torch.inference_mode`` (``torch.no_grad`` within fit, as Lightning, or with ``inference_mode=False``); in eval
        mode, after which each submodule gets back its own mode (a frozen one stays in eval mode)."""
        several = len(loaders) > 1  # then steps and batch hooks get dataloader_idx, metrics a suffix
        hooks = evaluation_hooks(stage, self, self.callbacks, self.module, several)  # captures the modes
        self._evaluation_stage = stage
        hooks.model_eval()
        self.metrics.start_evaluation()
        with self.strategy.evaluation_context(self.inference_mode and self.stage != "fit"):  # no_grad under FSDP
            first = first_evaluation_batches(loaders, limits, self._plan.hooks.transfer, self.current_epoch, hooks.fetch)  # before the hooks, as Lightning's
            for hook in hooks.start:
                hook()
            if stage == self.stage:  # validate, test, predict: a search in on_<stage>_start may have made new loaders
                loaders, limits = self._evaluation_loaders
            for hook in hooks.epoch_start:
                hook()
            predictions = self._evaluation_batches(stage, hooks, loaders, limits, several, first)
            self.metrics.read_epoch_end(self.metrics.evaluation)  # this epoch's values, for the hooks reading callback_metrics
            for hook in hooks.epoch_end:
                hook()
            published, values, specs = self.metrics.end_evaluation(stage, self._logger_step(), publish=not self.sanity_checking)
            self._log(published)
            for hook in hooks.end:
                hook()
        hooks.model_train()
        self._evaluation_stage = None
        if stage != "predict":
            return split_by_dataloader(values, len(loaders), specs)
        predictions = gather_predictions(predictions, self.strategy)  # every rank's, in the dataset's order
        return predictions if several else predictions[0]

    def _evaluation_batches(self, stage: str, hooks: Any, loaders: list[Any], limits: list[int | float], several: bool, first: Any) -> list[list[Any]]:
        predictions: list[list[Any]] = []
        for dataloader_idx, (loader, limit) in enumerate(zip(loaders, limits)):
            self.metrics.evaluation.set_loader(dataloader_idx if several else None)  # metric keys get its suffix
            step_index = (dataloader_idx,) if hooks.step_takes_dataloader_idx else ()
            hook_index = (dataloader_idx,) if several else ()
            predictions.append([])
            batches = first[1] if dataloader_idx == 0 and first and first[0] is loader else evaluation_batches(loader, limit, self._plan.hooks.transfer, dataloader_idx, self.current_epoch, hooks.fetch)
            for batch_idx, batch in self.strategy.batches_on_device(batches):
                self.metrics.evaluation.batch = batch  # its size weighs epoch means
                for hook in hooks.batch_start:
                    hook(batch, batch_idx, *hook_index)
                with self._plan.hooks.forward_context_manager():
                    outputs = hooks.step(batch, batch_idx, *step_index)
                if stage == "predict":
                    predictions[-1].append(outputs)
                for hook in hooks.batch_end:
                    hook(outputs, batch, batch_idx, *hook_index)
                self.metrics.keep_evaluation_step_values(batch_idx)  # the batch's on_step values, read at the end
        self.metrics.evaluation.set_loader(None)
        return predictions

