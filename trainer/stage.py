"""What happens around a stage (fit, validate, test, predict), before and after its loop runs.

``Trainer._launch`` calls :func:`prepare_launch` in the calling process, before the strategy
starts any (the module's callbacks join, ``ckpt_path`` is resolved so that a wrong one costs
nothing, and is "last" in a fit that torchrun restarted (:func:`elastic_restart`), the log
directory is chosen: returned for the Trainer to take); then each process of
the stage runs
``Trainer._run_stage``, which calls :func:`enter_stage` (this process's rank and log directory),
:func:`setup_stage` (seeding, ``prepare_data``, the ``setup`` hooks) and, whatever happened,
:func:`teardown_stage`. The loop itself stays in ``trainer/trainer.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import callbacks as callbacks_package
from callbacks.console import warn
from strategies import checkpoint as checkpoint_io
from trainer.data_source import prepare_data
from trainer.hparams import drop_unpicklable_hyperparameters
from trainer.hooks import refuse_module_hooks, step_without_batch_idx, takes_batch_idx, warn_uncalled_hooks
from trainer.log_dir import choose_log_dir, versions_root, without_file_logger
from trainer.seed import reset_seed, seed_generators, use_deterministic_algorithms
from trainer.states import TrainerFn
from trainer.stage_loaders import end_workers
from trainer.stage_metrics import refusing
from trainer.utilities import rank_zero_only, set_rank

if TYPE_CHECKING:
    from callbacks import Callback
    from trainer.data_source import DataSource
    from trainer.module import TrainingModule
    from trainer.setup import StagePlan
    from trainer.trainer import Trainer


def prepare_launch(trainer: Trainer, stage: str, module: TrainingModule, ckpt_path: Any,
                   log_dir: Path | None, resumes: bool = True) -> tuple[list[Callback], Any, Path]:
    """In the calling process, before the strategy launches: the Trainer's callbacks with the
    module's, the checkpoint path (resolved: ``"last"``, ``"best"`` or a file) and the log
    directory (``log_dir``, the last stage's, or a new one), returned in that order. ``resumes``:
    a ``fit`` given no ``ckpt_path`` may pick one itself (torchrun's restart, an OnExceptionCheckpoint's
    file); not a search (the Tuner's), which runs no loop from a checkpoint."""
    trainer.metrics.refuse_for(stage)  # configure_callbacks refuses self.log (with predict's words in predict)
    callbacks = callbacks_package.with_module_callbacks(trainer.callbacks, refusing(module, "configure_callbacks", module.configure_callbacks),
                                                        type(module).__name__)
    refuse_module_hooks(module, warns=rank_zero_only.rank == 0, stage=stage)
    drop_unpicklable_hyperparameters(module, warns=rank_zero_only.rank == 0)
    if rank_zero_only.rank == 0:
        warn_uncalled_hooks([module, *callbacks])
    loggers = [c for c in callbacks if isinstance(c, callbacks_package.Logger)]
    restart = elastic_restart() if stage == "fit" and ckpt_path is None and resumes else 0
    if restart:  # torchrun restarted the group after a failure: continue from the newest checkpoint by itself
        ckpt_path = "last"
    on_exception = [Path(c.ckpt_path) for c in callbacks if isinstance(c, callbacks_package.OnExceptionCheckpoint)]
    if stage == "fit" and ckpt_path is None and on_exception and resumes:  # as Lightning: a failed run's file, if any
        ckpt_path = failed_run_checkpoint(on_exception, trainer.is_global_zero)
    if ckpt_path is not None:  # before anything starts, so a wrong path costs nothing
        checkpoints = [c for c in callbacks if isinstance(c, callbacks_package.ModelCheckpoint)]
        directories = [Path(c.dirpath) for c in checkpoints if c.dirpath is not None]
        if not directories and not any(isinstance(c, callbacks_package.AsyncLogger) for c in loggers):
            directories = [without_file_logger(loggers, trainer.default_root_dir) / "checkpoints"]  # no versions
        # "best" is the fitted ModelCheckpoint's, as in Lightning: configure_callbacks' new one replaces it only now.
        ranked = [c for c in trainer.callbacks if isinstance(c, callbacks_package.ModelCheckpoint)] or checkpoints
        best = ranked[0].best_model_path if ranked else None
        versions = versions_root(loggers, trainer.default_root_dir)
        ckpt_path = checkpoint_io.resolve_ckpt_path(ckpt_path, stage, directories, versions,
                                                    trainer.is_global_zero and not restart, best=best,
                                                    also_last=on_exception)
    if restart and rank_zero_only.rank == 0:
        found = f"resumes from {ckpt_path}" if ckpt_path is not None else "starts over: no last.ckpt was written yet"
        print(f"Cadence: torchrun restarted the job (restart {restart} of at most "
              f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}) and fit got no ckpt_path, so it {found}.",
              file=sys.stderr, flush=True)
    if log_dir is None:  # a resumed run keeps the version directory its checkpoint is in
        log_dir = choose_log_dir(loggers, trainer.default_root_dir, ckpt_path if stage == "fit" else None)
    return callbacks, ckpt_path, log_dir


def failed_run_checkpoint(paths: list[Path], say: bool) -> Path | None:
    """``fit`` without ``ckpt_path`` beside an ``OnExceptionCheckpoint``: as in Lightning, the run continues
    from the newest of its files that exists (a run that failed left it; one that ended well removed it),
    saying so when ``say``; None when there is none."""
    found = [path for path in paths if checkpoint_io.is_checkpoint(path)]
    if not found:
        return None
    newest = max(found, key=os.path.getmtime)
    if say:
        warn(f"fit got no ckpt_path, and the OnExceptionCheckpoint's {newest} is there (a run failed): as in "
             "Lightning, fit resumes from it. Delete the file to start over, or pass ckpt_path=... to choose.")
    return newest


def elastic_restart() -> int:
    """How many times torchrun's agent restarted this job's processes (``--max-restarts``): 0 on the
    first attempt and outside torchrun. A restarted ``fit`` without ``ckpt_path`` resumes from "last"."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def enter_stage(trainer: Trainer, stage: str, module: TrainingModule, data: DataSource) -> None:
    """In each process of the stage, first: its rank and environment, rank zero's log directory,
    the running module (the Trainer holds ``data`` itself)."""
    trainer.stage = stage
    trainer.strategy.setup_environment()
    set_rank(trainer.global_rank)  # rank_zero_only's (and lightning_utilities')
    trainer.log_dir = trainer.strategy.broadcast_object(trainer.log_dir)  # torchrun ranks each chose one; use rank zero's
    trainer.module = module
    module.trainer = trainer
    for callback in trainer.callbacks:  # as Lightning's: self.log in a callback logs through the running module
        callback.log, callback.log_dict = module.log, module.log_dict
    if trainer.datamodule is not None:
        trainer.datamodule.trainer = trainer
    trainer.metrics.start_stage(stage, has_loggers=bool(trainer.loggers))  # validate, test, predict: an empty progress bar
    if stage == "fit" and not takes_batch_idx(module.training_step):
        # training_step(self, batch) without batch_idx, as Lightning allows: the strategy (and
        # DDP's forward) call module.training_step(batch, batch_idx), so this stage's module
        # answers with an adapter; it is removed at teardown.
        module.training_step = step_without_batch_idx(module.training_step)


def setup_stage(trainer: Trainer, stage: str, module: TrainingModule, data: DataSource, described: str | None) -> str | None:
    """Seed, deterministic kernels, the device report (unless it is ``described``, the one printed
    last), prepare_data, then the setup hooks: datamodule, callbacks, module. Returns the report
    printed last."""
    if trainer.seed is not None:
        seed_generators(trainer.seed)
    elif trainer.world_size > 1:  # as Lightning's DDP and FSDP: every rank from seed_everything's seed
        reset_seed()
    if trainer.deterministic:
        use_deterministic_algorithms()
    if trainer.strategy.is_global_zero:  # once per Trainer and process, not again for each stage
        description = trainer.strategy.describe()
        if description != described:
            print(description, file=sys.stderr)
            described = description
    prepare_data(data, trainer.strategy, trainer.datamodule)  # local rank zero; the other processes wait
    stage = TrainerFn(stage)  # as Lightning passes trainer.state.fn: a str enum, == "fit", str() "TrainerFn.FITTING"
    if trainer.datamodule is not None:  # stage= by keyword, as Lightning calls them (an override may rename the rest)
        trainer.datamodule.setup(stage=stage)
    for callback in trainer.callbacks:
        callback.setup(trainer, module, stage=stage)
    module.setup(stage=stage)
    return described


def call_exception_hooks(trainer: Trainer, module: TrainingModule, datamodule: Any, error: BaseException) -> None:
    """The stage raised ``error``: the callbacks' ``on_exception`` (the loggers' finalize("failed") among
    them), then the DataModule's, as in Lightning. They may not ``self.log`` (Lightning's rule)."""
    trainer.metrics.current = trainer.metrics.refused
    for callback in trainer.callbacks:
        callback.on_exception(trainer, module, error)
    if datamodule is not None and hasattr(datamodule, "on_exception"):
        datamodule.on_exception(error)


def teardown_stage(trainer: Trainer, stage: str, module: TrainingModule, data: DataSource, plan: StagePlan | None,
                   loaders: list[Any]) -> None:
    """Also after an error: the teardown hooks (datamodule, callbacks, module), the strategy's, what
    the stage attached to the module and the optimizers (``plan``'s step hooks), and the workers of
    the ``loaders`` it made."""
    stage = TrainerFn(stage)  # as in setup_stage
    trainer.metrics.current = trainer.metrics.refused  # the teardown hooks may not self.log (Lightning's rule)
    if trainer.datamodule is not None:  # stage= by keyword, as in setup_stage
        trainer.datamodule.teardown(stage=stage)
    for callback in trainer.callbacks:
        callback.teardown(trainer, module, stage=stage)
    module.teardown(stage=stage)
    trainer.strategy.teardown(trainer.optimizers)  # the module and the optimizers' states back to the CPU
    for handle in plan.step_hook_handles if plan is not None else ():
        handle.remove()  # manual optimization's optimizer hooks
    vars(module).pop("training_step", None)  # enter_stage's batch_idx adapter, if any
    for callback in trainer.callbacks:  # enter_stage's self.log: the callbacks keep no module alive
        vars(callback).pop("log", None), vars(callback).pop("log_dict", None)
    trainer.metrics.stop()
    end_workers(loaders)
