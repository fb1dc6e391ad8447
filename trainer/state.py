"""What a checkpoint holds and how a run continues from it; what a spawned run hands back.

``training_state`` gathers a Trainer's training state (optimizers, counters, every rank's RNG)
and ``checkpoint_state`` adds the module's weights, as tensors and plain data (the files, their
format and checks, and the one read path live in ``strategies/checkpoint/``); ``read_checkpoint``
reads one through the strategy, and ``restore`` puts it back and returns where the loop continues
(:class:`Resumed`, which the Trainer takes as its loop state), so that the loop continues exactly
where the checkpoint was written. The training state at the end of ``fit`` is
kept, so that ``save_checkpoint`` after fit writes it (``end_of_fit_checkpoint``).
``handoff_state`` and ``receive_handoff`` carry rank zero's results (that state included) back to
the caller after a DDP spawn.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data.distributed import DistributedSampler

from strategies import checkpoint as checkpoint_io
from trainer.datamodule import overrides
from trainer.loading import restore_datamodule_state
from trainer.optim import ends_accumulation_window, step_schedulers
from trainer.resume import failed_before_batch_end, loader_states
from trainer.seed import capture_rng_state, restore_rng_state
from trainer.stage_metrics import refusing
from callbacks.base import defines
from callbacks.console import info, MisconfigurationException, warn

if TYPE_CHECKING:
    from strategies import Strategy
    from strategies.checkpoint.background import BackgroundWriter
    from trainer.datamodule import DataModule
    from trainer.metrics import MetricStore
    from trainer.module import TrainingModule
    from trainer.resume import ResumableBatchSampler
    from trainer.trainer import Trainer


@dataclasses.dataclass
class Progress:
    """Where fit is beyond Lightning's counters (``current_epoch``, ``global_step``,
    ``batch_idx``): what a checkpoint holds to continue exactly, and what a resumed run skips. The
    Trainer holds one; :func:`training_state` reads it."""

    batches_seen: int = 0  # training batches run since the first fit: the log-step clock
    in_epoch_end: bool = False  # the epoch-end hooks run: the epoch is done
    validation_pending: bool = False  # the running batch's validation is due and has not started
    plateau_due: bool = False  # a "step" ReduceLROnPlateau steps after this batch's hooks and validation (Lightning's)
    sampler: ResumableBatchSampler | None = None  # the training loader's; it records each epoch's RNG
    resumed: Resumed | None = None  # where a restored run continues, until its first epoch ends
    iterated: Any = None  # the training loader an epoch last iterated: one made since is new (stage_loaders.train_batches)
    premade: Any = None  # (loader, iterator): the one Lightning makes before on_train_start, for epoch 0 (stage_loaders)
    made_early: Any = None  # the training loader whose first iterator estimated_stepping_batches made (stage_loaders)
    # The running epoch's number of batches: its limit, or over a loader without a length, its count once
    # the batch before the last is running (stage_loaders.train_batches reads such a loader one batch ahead).
    epoch_batches: int | float = math.inf


def logger_step(trainer: Trainer, progress: Progress, automatic_optimization: bool) -> int:
    """The step fit hands the loggers, Lightning's (its ``_batches_that_stepped``): the batches that
    ended an accumulation window before the running batch's window (every batch under manual
    optimization). Without accumulation: ``global_step - 1`` after the step, so that the metrics of the
    50th step are written at step 49, as Lightning writes them."""
    if not automatic_optimization:
        return progress.batches_seen - 1
    stepped = ends_accumulation_window(trainer.batch_idx, trainer.accumulate_grad_batches, progress.epoch_batches)
    return trainer.global_step - 1 if stepped else trainer.global_step


def is_accumulated_log_step(trainer: Trainer, progress: Progress) -> bool:
    """Under gradient accumulation (automatic optimization: manual refuses it), whether the batch that
    just ran ends a log step, as Lightning's ``should_update_logs``: every ``log_every_n_steps``
    optimizer steps, at the end of a window, never inside one. (Without accumulation the loop checks
    ``batches_seen`` itself, at no cost.)"""
    if not ends_accumulation_window(trainer.batch_idx, trainer.accumulate_grad_batches, progress.epoch_batches):
        return False
    return (logger_step(trainer, progress, True) + 1) % trainer.log_every_n_steps == 0


def training_state(trainer: Trainer, progress: Progress) -> dict[str, Any]:
    """What a checkpoint holds besides the module's weights and hyperparameters: optimizers,
    schedulers, loop counters, every rank's RNG states, callback states, from the running
    ``trainer``'s public state and its ``progress``. Gathers the RNG states of every rank: call it
    on every rank."""
    # Written while a batch's failure is handled (on_exception): the batch is trained again on resume, as in Lightning.
    batch_idx = trainer.batch_idx - failed_before_batch_end(sys.exc_info()[1])
    epoch, batches_done = loop_position(trainer.current_epoch, batch_idx, progress.in_epoch_end)
    sampler = progress.sampler
    window_ended = ends_accumulation_window(batch_idx, trainer.accumulate_grad_batches, progress.epoch_batches)
    if trainer.stage == "fit" and batches_done and not window_ended and trainer.is_global_zero:
        warn(
            f"save_checkpoint after batch {batch_idx}, inside an accumulation window of "
            f"{trainer.accumulate_grad_batches} batches: the gradients accumulated so far are not saved, so a run "
            "resumed from it is not exact. Save after a window's last batch: ModelCheckpoint saves there, unless a "
            "validation inside a window triggers it (make val_check_interval a multiple of accumulate_grad_batches).")
    # Each rank's RNG states: ranks may draw differently (dropout, per-rank augmentation). "now"
    # includes the training loader's own generators, whose state the next epoch's order comes from.
    rng = trainer.strategy.all_gather_object({
        "now": {**capture_rng_state(), "generators": sampler.generator_states() if sampler is not None else []},
        "epoch_start": sampler.epoch_start_rng if sampler is not None else None,
        "loaders": loader_states(progress.iterated, trainer.strategy.device.type == "cuda" and getattr(
            trainer.strategy, "prefetch", None) is not False) if sampler is None else None,  # stateful iterables' own
    })
    return {
        "optimizer_states": [trainer.strategy.optimizer_state_dict(trainer.module, optimizer)
                             for optimizer in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        # Cadence's counters, and Lightning's loop progress for Lightning's own fit(ckpt_path=...)
        "loops": {"epoch": epoch, "batches_done": batches_done, "global_step": trainer.global_step,
                  "train_batches_seen": progress.batches_seen, "world_size": trainer.world_size,
                  "validation_pending": progress.validation_pending, "plateau_pending": progress.plateau_due,
                  **checkpoint_io.lightning_loops(epoch, batches_done, trainer.global_step, progress.batches_seen)},
        "rng": rng,
        # As Lightning's: the callbacks that have a state (a checkpoint read by Lightning names no others).
        "callbacks": {callback.state_key: state for callback in trainer.callbacks
                      if defines(callback, "state_dict") and (state := callback.state_dict())},
        "callback_metrics": dict(trainer.callback_metrics),
    }


def checkpoint_state(trainer: Trainer, module: TrainingModule, training: dict[str, Any],
                     datamodule: DataModule | None = None) -> dict[str, Any]:
    """The whole checkpoint: ``module``'s weights and hyperparameters with ``training`` (from
    :func:`training_state`) and the running stage's ``datamodule``'s state, after the callbacks'
    and the module's ``on_save_checkpoint``."""
    state = {
        "format": checkpoint_io.FORMAT_VERSION,
        # Lightning's top-level keys (strategies/checkpoint/lightning.py): tools that read its checkpoints read ours
        **checkpoint_io.lightning_keys(trainer.current_epoch, trainer.global_step, module.hparams,
                                       getattr(module, "_hparams_name", "kwargs")),
        "state_dict": trainer.strategy.module_state_dict(module),  # under FSDP: this rank's shards
        **training,
        **({"hyper_parameters": checkpoint_io.plain_hyperparameters(module.hparams),  # none kept: no key, as Lightning's
            "hyper_parameters_inexact": checkpoint_io.inexact_hyperparameters(module.hparams)} if module.hparams else {}),
        **_datamodule_state(datamodule),
        **({} if training else {"weights_only": True}),
        "versions": {"torch": str(torch.__version__), "python": platform.python_version(), "cadence": _version()},
    }
    if training:  # a weights-only checkpoint keeps no callback state
        for callback in trainer.callbacks:
            refusing(module, "on_save_checkpoint", callback.on_save_checkpoint, trainer, module, state)
    refusing(module, "on_save_checkpoint", module.on_save_checkpoint, state)  # no self.log there, as in Lightning
    return state


def read_checkpoint(strategy: Strategy, ckpt_path: Path | None, module: TrainingModule,
                    optimizers: list[torch.optim.Optimizer], datamodule: DataModule | None) -> dict[str, Any] | None:
    """The checkpoint at ``ckpt_path`` (None: none), read once, in the strategy's layout, for
    :func:`restore` (``optimizers``: [] to read the weights only). A datamodule's state is restored
    now, before its loader hooks run (as in Lightning). Every rank calls it (a collective under FSDP)."""
    if ckpt_path is None:
        return None
    checkpoint = strategy.load_checkpoint(ckpt_path, module, optimizers)
    if datamodule is not None:
        restore_datamodule_state(datamodule, checkpoint)
    return checkpoint


def fitted_module(trainer: Trainer, stage: str, ckpt_path: Any) -> tuple[TrainingModule, Any]:
    """``validate/test/predict(model=None)``: the last module run, and the checkpoint to load into
    it: ``ckpt_path``, or (as in Lightning, with a warning) the ModelCheckpoint's best one."""
    if trainer.lightning_module is None:
        raise TypeError(f"Trainer.{stage}() got no model, and this Trainer has run none yet (`trainer.{stage}()` "
                        f"requires a `LightningModule`, a TrainingModule). Pass the module: trainer.{stage}(model, ...).")
    best = next((c.best_model_path for c in trainer.checkpoint_callbacks if hasattr(c, "best_model_path")), "")
    if ckpt_path is None and best:
        if trainer.is_global_zero:
            warn(f"`.{stage}(ckpt_path=None)` was called without a model. The best model of the previous `fit` call "
                 f"will be used. You can pass `.{stage}(ckpt_path='best')` to use the best model or "
                 f"`.{stage}(ckpt_path='last')` to use the last model. If you pass a value, this warning will be "
                 f"silenced. (Trainer.{stage}() got no model and no ckpt_path, so it loads the best checkpoint of the "
                 f"last fit: {best}.)")
        ckpt_path = "best"
    return trainer.lightning_module, ckpt_path


def _datamodule_state(datamodule: DataModule | None) -> dict[str, Any]:
    if datamodule is None:
        return {}
    state = datamodule.state_dict()
    # As Lightning: its state under the class's qualified name, its hyperparameters, each only when there are any
    return {**({type(datamodule).__qualname__: state} if state else {}),
            **({"datamodule_hyper_parameters": checkpoint_io.plain_hyperparameters(datamodule.hparams),
                "datamodule_hyper_parameters_inexact": checkpoint_io.inexact_hyperparameters(datamodule.hparams),
                "datamodule_hparams_name": getattr(datamodule, "_hparams_name", "kwargs")} if datamodule.hparams else {})}


class NoTrainingStateError(RuntimeError, AttributeError):
    """``save_checkpoint`` with nothing to save: Lightning raises AttributeError when no model is attached."""


def end_of_fit_checkpoint(trainer: Trainer, end_of_fit: tuple[TrainingModule, dict[str, Any]] | None,
                          weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint ``save_checkpoint`` writes when no stage runs: the fitted module's weights as
    they are now (and the last stage's DataModule's state and hyperparameters, as Lightning), with the
    training state its last fit ended with (``end_of_fit``: the module and
    its :func:`training_state`, or None when no fit has ended)."""
    if end_of_fit is None:
        attached = "" if trainer.model is not None else (  # Lightning's words (an AttributeError there)
            "Saving a checkpoint is only possible if a model is attached to the Trainer. ")
        raise NoTrainingStateError(
            f"{attached}Trainer.save_checkpoint has no training state to write: no fit has finished on this Trainer, or "
            "it ran in spawned FSDP workers, whose optimizer state stays sharded there. Call it after fit "
            "returns, or during a stage (from a callback or a module hook; ModelCheckpoint does); for the "
            "weights alone, torch.save(model.state_dict(), path)."
        )
    module, training = end_of_fit
    return checkpoint_state(trainer, module, {} if weights_only else training, trainer.datamodule)


def failed_fit_state(trainer: Trainer, stage: str, module: TrainingModule,
                     progress: Progress) -> tuple[TrainingModule, dict[str, Any]] | None:
    """What ``save_checkpoint`` writes after a fit that raised: the state it failed in (a failed batch is
    trained again on resume), as Lightning saves the state it has. None when there is none (another stage,
    a failure before the optimizers were made) or with several processes (gathering the RNG states is a
    collective the processes that did not fail would not join)."""
    if stage != "fit" or trainer.world_size > 1 or trainer.module is None or not trainer.optimizers:
        return None
    try:
        with warnings.catch_warnings():  # the accumulation-window warning is for a save_checkpoint the user calls
            warnings.simplefilter("ignore")
            return module, training_state(trainer, progress)
    except Exception:  # the fit's own error is what the user must see
        return None


def write_checkpoint(trainer: Trainer, path: str | os.PathLike, progress: Progress,
                     datamodule: DataModule | None, end_of_fit: tuple[TrainingModule, dict[str, Any]] | None,
                     weights_only: bool = False, storage_options: Any = None,
                     background: BackgroundWriter | None = None) -> int:
    """``Trainer.save_checkpoint``: during a stage, the running state (:func:`training_state` at
    ``progress``, with the stage's ``datamodule``) in the strategy's layout (every rank takes part);
    when no stage runs, the state the last fit ended with (``end_of_fit``; rank zero writes).
    ``weights_only``: the weights and hyperparameters, without the training state (as in Lightning,
    the callbacks' ``on_save_checkpoint`` is not called; the module's is). ``background``: during a
    stage, write a snapshot in that writer's thread (the strategy's ``save_checkpoint``). Returns its
    global step."""
    if storage_options is not None:
        raise MisconfigurationException(
            "Trainer.save_checkpoint(storage_options=...): Cadence writes local files only; leave it "
            "None and copy the file where it should go.")
    if trainer.module is None:  # no stage runs: the state the last fit ended with
        state = end_of_fit_checkpoint(trainer, end_of_fit, weights_only)
        if trainer.strategy.is_global_zero:  # the processes of a run have left their group: no barrier
            checkpoint_io.save_atomic(state, path)
        return end_of_fit[1]["loops"]["global_step"]
    state = checkpoint_state(trainer, trainer.module, {} if weights_only else training_state(trainer, progress), datamodule)
    trainer.strategy.save_checkpoint(state, path, background)  # every rank returns, or raises, together
    return trainer.global_step


def loop_position(epoch: int, batch_idx: int, in_epoch_end: bool) -> tuple[int, int]:
    """Where a resumed run continues: (epoch, batches of it already trained). During the
    epoch-end hooks (``in_epoch_end``) the epoch is done; otherwise batch ``batch_idx`` is (-1: none yet)."""
    if in_epoch_end:
        return epoch + 1, 0
    return epoch, batch_idx + 1


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a restored run continues: the Trainer takes these as its loop state."""

    epoch: int
    global_step: int
    batches_done: int  # of epoch ``epoch``
    batches_seen: int  # training batches run since the first fit (the log-step clock)
    rng: dict[str, Any]  # this rank's checkpointed RNG states, for a mid-epoch replay (trainer/resume.py)
    callback_metrics: dict[str, Any]
    # Written at a batch's end before that batch's validation (which draws random numbers, as in
    # Lightning): the resumed run validates first, as the run that wrote it did next.
    validation_pending: bool = False
    processes: int = 1  # that wrote it: another number than this run's re-deals the epoch's rest (trainer/resume.py)
    plateau_pending: bool = False  # written before the "step" ReduceLROnPlateau due at its batch stepped

    def after_validation(self) -> Resumed:
        """Where the loop continues once the pending validation has run: the RNG as it left it."""
        now = {**capture_rng_state(), "generators": self.rng["now"].get("generators", [])}
        return dataclasses.replace(self, validation_pending=False, rng={**self.rng, "now": now})


def finish_resumed_batch(progress: Progress, validates: bool, run_validation: Any, schedulers: list[Any],
                         metrics: Any) -> None:
    """Resumed from a checkpoint written within a batch's end (``on_train_batch_end``, its validation): what
    the run that wrote it did next. The batch's validation when it was written before it (from the
    checkpoint's RNG, whatever the hooks since drew), then a "step" ReduceLROnPlateau due at that batch
    (Lightning steps it after the validation, and its own resume skips it; Cadence's resume is exact)."""
    resumed = progress.resumed
    if resumed.validation_pending and validates:
        restore_rng_state(resumed.rng["now"])
        run_validation()
        progress.resumed = resumed.after_validation()
    if progress.plateau_due:
        progress.plateau_due = step_schedulers(schedulers, "step", resumed.batches_done, metrics, plateau=True)


def restore(trainer: Trainer, path: Path, state: dict[str, Any], model_only: bool = False,
            sampler: ResumableBatchSampler | None = None) -> Resumed | None:
    """Load ``state``, the checkpoint :func:`read_checkpoint` read from ``path``, in Lightning's order:
    the module's ``on_load_checkpoint``, its weights, the callbacks' ``on_load_checkpoint`` and their
    states (for validate, test and predict too, as Lightning), then, unless ``model_only``, the
    optimizers, schedulers, RNG states and ``sampler``'s generators (the next epoch's order); returns
    where the loop continues (None with ``model_only``). Under FSDP each rank read its own part of the
    shards (resharded when the checkpoint was written by another number of processes). A datamodule's
    state was restored when it was read."""
    strategy, module = trainer.strategy, trainer.module
    if not model_only:
        checkpoint_io.check_resumable(state, path)
    refusing(module, "on_load_checkpoint", module.on_load_checkpoint, state)  # no self.log there, as in Lightning
    checkpoint_io.check_weights(module, state, path)
    strategy.load_module_state_dict(module, state["state_dict"])
    for callback in trainer.callbacks:
        refusing(module, "on_load_checkpoint", callback.on_load_checkpoint, trainer, module, state)
    _restore_callbacks(trainer, state.get("callbacks") or {}, path)  # none in a weights-only checkpoint
    if model_only:
        if trainer.is_global_zero:  # Lightning's line
            info(f"Loaded model weights from the checkpoint at {path}")  # through logging when configured, as Lightning's
        return None
    checkpoint_io.load_optimizers(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs], state, path,
                                  functools.partial(strategy.load_optimizer_state_dict, module))
    rng = state["rng"]  # one entry per rank; None from a checkpoint Lightning wrote
    processes = trainer.world_size if rng is None else len(rng)
    dealt = sampler is not None and isinstance(sampler.sampler, DistributedSampler)  # the epoch's rest re-dealt
    if rng is None:
        rng = [_rng_from_here(sampler)]
        if trainer.is_global_zero:
            warn(f"Checkpoint {path} holds no RNG states (Lightning does not save them): the weights, optimizers, "
                 "schedulers, callbacks and the epoch and step are restored, but the data order and random draws "
                 "will not continue exactly as in the run that wrote it.")
    elif processes != trainer.world_size and trainer.is_global_zero:
        rest = ("the samples of the epoch no process trained yet are dealt out among this run's processes, but random "
                "draws will differ" if dealt else "random draws and the rest of the epoch's data order will differ")
        warn(f"Checkpoint {path} was written by {len(rng)} processes and resumes on {trainer.world_size}: "
             f"the weights and optimizer states load whole; {rest}.")
    rank_rng = rng[trainer.global_rank] if trainer.global_rank < len(rng) else rng[0]
    restore_rng_state(rank_rng["now"])  # and again after a mid-epoch replay (trainer/resume.py)
    if sampler is not None:  # the loader's own generators: the next epoch's order
        sampler.set_generator_states(rank_rng["now"].get("generators", []))
    loops = state["loops"]
    if trainer.is_global_zero:  # one line: which checkpoint, and where the loop continues
        within = f", after batch {loops['batches_done'] - 1} of the epoch" if loops["batches_done"] else ""
        if loops["batches_done"] and processes != trainer.world_size:  # say what changed (trainer/resume.py)
            within += (f" on each of {processes} processes; its untrained samples dealt out among {trainer.world_size}"
                       if dealt else f" on each of {processes} processes; the rest of the epoch in a new order")
        print(f"Cadence: resuming from {path} at epoch {loops['epoch']}, global step {loops['global_step']}{within}.",
              file=sys.stderr, flush=True)
    return Resumed(loops["epoch"], loops["global_step"], loops["batches_done"], loops["train_batches_seen"], rank_rng,
                   state.get("callback_metrics", {}), loops.get("validation_pending", False), processes,
                   loops.get("plateau_pending", False))


def _rng_from_here(sampler: ResumableBatchSampler | None) -> dict[str, Any]:
    """RNG states for a checkpoint that has none: this process's, so that restoring them changes
    nothing, and a mid-epoch resume draws the epoch's order from them and skips the batches done."""
    now = {**capture_rng_state(), "generators": sampler.generator_states() if sampler is not None else []}
    return {"now": now, "epoch_start": now}


def _restore_callbacks(trainer: Trainer, states: dict[str, Any], path: Path) -> None:
    for callback in trainer.callbacks:
        if callback.state_key in states:
            callback.load_state_dict(states[callback.state_key])
    unused = sorted(key for key, value in states.items() if value and key not in {c.state_key for c in trainer.callbacks})
    if unused and trainer.is_global_zero:
        warn(f"Checkpoint {path} holds the state of callbacks this Trainer does not have, which is not restored. "
             f"Please add the following callbacks: {unused} (the same monitor, mode and trigger) to continue them.")


def handoff_state(trainer: Trainer, module: TrainingModule, stage: str, datamodule: DataModule | None,
                  end_of_fit: tuple[TrainingModule, dict[str, Any]] | None, preempted_by: int | None) -> dict[str, Any]:
    """What a spawned rank zero sends back so the caller's objects reflect the run. After fit, that
    includes the training state the loop ended with (of ``end_of_fit``: optimizers, schedulers,
    every rank's RNG), so that ``trainer.save_checkpoint`` in the caller writes a checkpoint that
    continues exactly; it costs a copy of the optimizer state through the result file. Not where
    rank zero holds only its shard of that state (FSDP). ``preempted_by``: the signal that stopped fit."""
    return {
        "datamodule": datamodule.state_dict() if datamodule is not None else None,
        "state_dict": {k: v.detach().cpu() for k, v in trainer.strategy.module_state_dict(module, full=True).items()},
        "current_epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        # 0-d CPU tensors, keeping their dtype (float64 in "64-true", as in one process)
        "callback_metrics": {k: v.detach().cpu() if isinstance(v, torch.Tensor) else float(v)
                             for k, v in trainer.callback_metrics.items()},
        "callbacks": {callback.state_key: callback.state_dict() for callback in trainer.callbacks if defines(callback, "state_dict")},
        "preempted_by": preempted_by,
        "end_of_fit": (end_of_fit[1] if stage == "fit" and end_of_fit is not None
                       and trainer.strategy.whole_state_on_rank_zero else None),
    }


def receive_handoff(module: TrainingModule, callbacks: list[Any], metrics: MetricStore, handoff: dict[str, Any],
                    datamodule: DataModule | None = None) -> tuple[int, int, int | None, dict[str, Any] | None]:
    """In the caller, after a spawned run: load rank zero's results into ``module``, ``callbacks``,
    the metric store's ``callback_metrics`` and ``datamodule``; return what the Trainer takes itself:
    ``(current_epoch, global_step, preempted_by, end_of_fit)``."""
    # Layers that configure_model builds (late, in the workers) are built here too; built on the
    # meta device (for FSDP), they take the trained tensors as they are (assign).
    if overrides(module, "configure_sharded_model"):  # Lightning's deprecated name
        module.configure_sharded_model()
    module.configure_model()
    on_meta = any(tensor.is_meta for tensor in itertools.chain(module.parameters(), module.buffers()))
    if not on_meta:  # the workers converted it (TruePrecision: "64-true", "bf16-true"): the same dtypes here
        _take_dtypes(module, handoff["state_dict"])
    module.load_state_dict(handoff["state_dict"], assign=on_meta)
    if datamodule is not None and handoff.get("datamodule") is not None:
        datamodule.load_state_dict(handoff["datamodule"])
    for callback in callbacks:
        if callback.state_key in handoff["callbacks"]:
            callback.load_state_dict(handoff["callbacks"][callback.state_key])
    metrics.callback_metrics = {key: torch.as_tensor(value) for key, value in handoff["callback_metrics"].items()}
    return handoff["current_epoch"], handoff["global_step"], handoff["preempted_by"], handoff["end_of_fit"]


def _take_dtypes(module: TrainingModule, state_dict: dict[str, Any]) -> None:
    """Convert ``module``'s floating parameters and buffers, in place, to the dtype of their tensor in
    ``state_dict`` where it differs, so that the weights a spawned run trained arrive without rounding."""
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        given = state_dict.get(name)
        if (isinstance(given, torch.Tensor) and tensor.is_floating_point() and given.is_floating_point()
                and given.dtype != tensor.dtype):
            tensor.data = tensor.data.to(given.dtype)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("torchcadence")
    except Exception:  # not installed (running from a checkout)
        return "unknown"
