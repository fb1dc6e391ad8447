"""ModelCheckpoint: Lightning's callback of that name, with its arguments, file names and triggers.

Files are written through ``trainer.save_checkpoint`` (atomic; rank zero writes, every rank
waits). A checkpoint is written only after an optimizer step, never inside a gradient
accumulation window, so resuming from it is exact. The top-k bookkeeping is updated *before* a
file is written, so each file records itself and the bookkeeping survives a restart. ``last.ckpt``
is refreshed at every trigger, ranked or not, so it always holds the newest state; it is a hard
link to the ranked file of the same moment when there is one (one serialization, not two), or
with ``save_last="link"`` a symbolic link to the newest ranked file, as in Lightning. Under FSDP
each checkpoint is a directory of shards (``strategies/checkpoint/sharded.py``), linked and
pruned whole. Names and arguments are checked in ``callbacks/checkpoint_names.py``. With
``async_save=True`` the step waits for a snapshot only; the write, then the link and the pruning
that must follow it, run in a background thread (``strategies/checkpoint/background.py``).
"""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from callbacks.base import Callback, Checkpoint
from callbacks.checkpoint_names import CheckpointNames, TrainTimeClock, check_arguments, resolve_triggers
from callbacks.console import epoch_label, MisconfigurationException, warn, write_line
from strategies.checkpoint import link_checkpoint, remove_checkpoint, symlink_checkpoint
from strategies.checkpoint.background import BackgroundWriter

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class ModelCheckpoint(CheckpointNames, Checkpoint):
    """Save checkpoints during ``fit``; arguments, defaults and file names as in Lightning 2.6.

    Args:
        dirpath: the directory; default ``<trainer.log_dir>/checkpoints``.
        filename: a format string over ``epoch``, ``step`` and logged metrics; ``"{epoch}-{val_loss:.3f}"``
            names a file ``epoch=14-val_loss=0.012.ckpt``. Default ``"{epoch}-{step}"``.
        monitor: the metric that ranks checkpoints; None keeps the newest one (``save_top_k=1``) or all (-1).
        verbose: say on stderr (above the progress bar) what was saved and why.
        save_last: refresh ``last.ckpt`` at every trigger and when training ends (``fit(ckpt_path="last")``
            resumes from it); ``"link"``: a symbolic link to the newest ranked file; False or None: none.
        save_top_k: keep the best k ranked files; -1 all, 0 none.
        save_on_exception: when ``fit`` fails, save the state it failed in (one process only).
        save_weights_only: files hold the weights (and hyperparameters) only: ``load_from_checkpoint`` and
            ``validate/test(ckpt_path=...)`` read them; ``fit`` cannot resume from them.
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        auto_insert_metric_name: ``{epoch}`` in ``filename`` becomes ``epoch=3``; False: ``3``. A metric name
            with ``/`` then makes a subdirectory, as in Lightning.
        every_n_train_steps: save every this many optimizer steps (0 or None: not by steps).
        train_time_interval: save once this much training time passed (a ``timedelta``, or seconds), checked
            after every optimizer step with the host clock (no device sync): at most that much is lost.
        every_n_epochs: save every this many epochs; None: 1 unless another trigger is set; 0: never.
        save_on_train_epoch_end: save at the end of the training epoch (True) or after validation
            (False); None decides as Lightning: after validation when it runs other than once per epoch.
        enable_version_counter: a name already on disk gets ``-v1``, ``-v2``, ... instead of being
            overwritten (``last.ckpt`` is always replaced: it is the state to resume from).
        async_save: training waits for a copy of the state on the host only; a thread writes it (Cadence's;
            Lightning has AsyncCheckpointIO). The next save and the end of fit wait for it; its error is
            raised at the next step (several processes: at the next save or the end of fit).

    Example::

        ModelCheckpoint(monitor="val_loss", filename="{epoch}-{val_loss:.3f}", save_top_k=3)
    """

    monitors_metrics = True  # its on_train_epoch_end sees what the module's logged

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None, monitor: str | None = None,
                 verbose: bool = False, save_last: bool | Literal["link"] | None = True, save_top_k: int = 1,
                 save_on_exception: bool = False, save_weights_only: bool = False, mode: str = "min",
                 auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: timedelta | float | None = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True,
                 async_save: bool = False) -> None:
        check_arguments(dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose, save_last=save_last,
                        save_top_k=save_top_k, save_on_exception=save_on_exception,
                        save_weights_only=save_weights_only, mode=mode, auto_insert_metric_name=auto_insert_metric_name,
                        save_on_train_epoch_end=save_on_train_epoch_end, enable_version_counter=enable_version_counter)
        steps, epochs, interval = resolve_triggers(every_n_train_steps, every_n_epochs, train_time_interval)
        self._every_n_train_steps, self._every_n_epochs, self._train_time_interval = steps, epochs, interval
        self.dirpath = dirpath or None
        self.filename = filename or None
        self.monitor, self.verbose, self.save_last, self.save_top_k = monitor, verbose, save_last, save_top_k
        self.mode, self.save_on_exception, self.save_weights_only = mode, save_on_exception, save_weights_only
        self.auto_insert_metric_name, self._enable_version_counter = auto_insert_metric_name, enable_version_counter
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self.best_k_models: dict[str, torch.Tensor] = {}  # path -> score, the ranked files kept on disk
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_checkpoint_saved = ""  # the newest ranked file (what save_last="link" points at)
        self._last_global_step_saved = 0  # nothing to save before the first step, as in Lightning
        self._step_at_last_batch = 0
        self._clock = TrainTimeClock()  # train_time_interval's
        self._defer_save_until_validation = False  # a step/time trigger waits for the monitored metric
        self._validated = False  # a validation ran in this fit: a missing monitor is then an error
        self._warned: set[str] = set()
        self._background = BackgroundWriter() if async_save else None  # None: saves are written in the step

    @property
    def dirpath(self) -> str | None:
        """Where the checkpoints go (a str, ``~`` expanded, as Lightning's); None until ``setup``."""
        return str(self._dir) if self._dir is not None else None

    @dirpath.setter
    def dirpath(self, dirpath: str | os.PathLike | None) -> None:
        self._dir = Path(os.path.realpath(os.path.expanduser(dirpath))) if dirpath is not None else None

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def state_key(self) -> str:
        """Lightning's key, so that two ModelCheckpoints differing in monitor, mode or trigger keep
        separate state, and a Lightning checkpoint's state is found."""
        key = {"monitor": self.monitor, "mode": self.mode, "every_n_train_steps": self._every_n_train_steps,
               "every_n_epochs": self._every_n_epochs, "train_time_interval": self._train_time_interval}
        return f"{type(self).__qualname__}{key!r}"

    # --- when to save ---------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self._dir is None:  # as Lightning's: relative when the log directory is (a dirpath given is made absolute)
            self._dir = Path(trainer.log_dir) / "checkpoints"
        if self._dir.exists() and not self._dir.is_dir():
            raise MisconfigurationException(f"ModelCheckpoint(dirpath={self.dirpath!r}) is a file; use a directory.")
        if self._background is not None and not trainer.strategy.supports_background_saves:
            raise MisconfigurationException(
                f"ModelCheckpoint(async_save=True) is not supported by {trainer.strategy.describe()}: its "
                "save_checkpoint writes in the step (supports_background_saves is False). Use async_save=False.")
        if stage == "fit":  # before a checkpoint is restored, which may set it again
            self._validated, self._defer_save_until_validation = False, False
            if not self._every_n_train_steps and self._train_time_interval is None and self._background is None:
                # Epoch triggers need nothing per batch: the base no-op leaves the loop's call list (trainer/hooks.py)
                self.on_train_batch_end = Callback.on_train_batch_end.__get__(self)  # bound, as methods are
            if self.save_on_exception and trainer.world_size > 1:
                raise MisconfigurationException(
                    f"ModelCheckpoint(save_on_exception=True) with {trainer.world_size} processes: an error reaches "
                    "only the process it happened in, and the others cannot join in writing a checkpoint then. Save "
                    "periodically instead (every_n_train_steps or train_time_interval); a SIGTERM saves last.ckpt.")

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # As Lightning, say when the files of another run are there (unless this run continues it).
        ours = any(path and self._dir in Path(path).parents for path in (self.last_model_path, self.best_model_path))
        if (trainer.is_global_zero and self.save_top_k != 0 and not ours and self._dir.is_dir()
                and any(self._dir.iterdir())):
            warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._step_at_last_batch = trainer.global_step
        self._clock.start(trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._background is not None and trainer.world_size == 1:
            self._background.check()  # a failed background write, named at the next step (no host sync)
        if not self._every_n_train_steps and self._train_time_interval is None:
            return
        stepped = trainer.global_step != self._step_at_last_batch
        self._step_at_last_batch = trainer.global_step
        if not stepped:  # mid accumulation window: a checkpoint would lose the partial gradients
            return
        due = self._every_n_train_steps > 0 and trainer.global_step % self._every_n_train_steps == 0
        if self._train_time_interval is not None and self._clock.is_due(trainer, self._train_time_interval):
            due = True
            self._clock.restart(trainer.global_step)
        if not due or trainer.global_step == self._last_global_step_saved:
            return
        if self.monitor is not None:  # this batch's step values, as Lightning ranks by them (one host copy per save)
            trainer.metrics.peek_step_values(trainer.global_step)
        metrics = self._monitor_candidates(trainer)
        missing = self.monitor is not None and self.monitor not in metrics
        stale = self.monitor is not None and not self._saves_on_train_epoch_end(trainer) and _validates_next(trainer)
        if missing or stale:  # rank after the validation that logs it; keep the state meanwhile
            self._defer_save_until_validation = True
            if self.save_last:
                self._save_last(trainer, metrics)
            return
        self._save_topk_and_last(trainer, metrics)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.sanity_checking or trainer.stage != "fit":
            return
        self._validated = True
        if self._defer_save_until_validation:
            self._defer_save_until_validation = False
            self._save_topk_and_last(trainer, self._monitor_candidates(trainer))
        elif not self._saves_on_train_epoch_end(trainer):
            self._save_on_epoch_trigger(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._saves_on_train_epoch_end(trainer):
            self._save_on_epoch_trigger(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._defer_save_until_validation and self.monitor not in trainer.callback_metrics and trainer.is_global_zero:
            warn(f"ModelCheckpoint(monitor={self.monitor!r}) never found its metric: no validation logged it "
                 f"(logged: {sorted(trainer.callback_metrics)}), so no checkpoint was ranked; "
                 f"{'only last.ckpt was written' if self.save_last else 'nothing was saved'}.")
        if self.save_last and trainer.global_step != self._last_global_step_saved:
            self._save_last(trainer, self._monitor_candidates(trainer))  # the end of training, whatever the triggers
        if self._background is not None:
            self._background.wait_everywhere(trainer.strategy.reduce_any)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        vars(self).pop("on_train_batch_end", None)  # setup's per-stage choice
        if self._background is not None:  # any exit path (an exception, a stop) waits for the last write
            self._background.wait_and_warn(warn)

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        if (not self.save_on_exception or trainer.stage != "fit" or trainer.sanity_checking or trainer.module is None
                or trainer.global_step == self._last_global_step_saved):
            return
        metrics = self._monitor_candidates(trainer)
        path = Path(self.format_checkpoint_name(metrics))
        try:
            self._write(trainer, path, ranked=True)
            if self.save_last:
                self._save_last(trainer, metrics, path)
        except Exception as failure:  # the run's own error is what the user must see
            warn(f"ModelCheckpoint(save_on_exception=True) could not save {path}: {failure}")
            return
        write_line(trainer, f"An {type(error).__name__} was raised with message: {error}, saved checkpoint to {path}")

    def _save_on_epoch_trigger(self, trainer: Trainer) -> None:
        if (self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0
                and trainer.global_step != self._last_global_step_saved):
            self._save_topk_and_last(trainer, self._monitor_candidates(trainer))

    def _saves_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False  # validation does not follow every epoch: save when it runs
        if sum(trainer.num_val_batches) == 0:
            return True  # no validation
        return trainer.val_check_interval == 1.0  # several validations an epoch: save after each

    # --- saving ---------------------------------------------------------------------------
    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
        """Rank zero's metrics (so every rank takes the same branch), with ``epoch`` and ``step``."""
        metrics = trainer.strategy.broadcast_object({k: float(v) for k, v in trainer.callback_metrics.items()})
        metrics["epoch"] = int(metrics["epoch"]) if "epoch" in metrics else trainer.current_epoch
        metrics["step"] = int(metrics["step"]) if "step" in metrics else trainer.global_step
        return metrics

    def _save_topk_and_last(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        ranked = self._save_topk(trainer, metrics) if self.save_top_k != 0 else None
        if self.save_last:
            self._save_last(trainer, metrics, ranked)

    def _save_topk(self, trainer: Trainer, metrics: dict[str, Any]) -> Path | None:
        """Write a ranked checkpoint if it makes the top k; return its path (None: it did not)."""
        if self.monitor is None:
            path = self._free_path(trainer, metrics, keep=self.best_model_path)
            previous, self.best_model_path = self.best_model_path, str(path)
            self._write(trainer, path, restore={"best_model_path": previous}, ranked=True)
            if self.save_top_k == 1 and previous and previous != str(path):
                self._remove(trainer, previous)
            return path
        if self.monitor not in metrics:
            if self._validated:
                if self.save_last:
                    self._save_last(trainer, metrics)
                raise RuntimeError(
                    f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric after validation; logged metrics "
                    f"are {sorted(set(metrics) - {'epoch', 'step'})}. {'last.ckpt was saved. ' if self.save_last else ''}"
                    f"Log it with self.log or fix monitor, then resume with fit(..., ckpt_path=\"last\").")
            return None
        current = torch.tensor(metrics[self.monitor])
        if torch.isnan(current):  # NaN is the worst score, never the best
            current = torch.tensor(math.inf if self.mode == "min" else -math.inf)
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        worst = max if self.mode == "min" else min
        dropped = worst(self.best_k_models, key=self.best_k_models.get) if len(self.best_k_models) >= k else None
        if dropped is not None and not (current < self.best_k_models[dropped] if self.mode == "min"
                                        else current > self.best_k_models[dropped]):
            if self.verbose and trainer.is_global_zero:
                write_line(trainer, f"{epoch_label(trainer)}, global step {trainer.global_step}: {self.monitor!r} was "
                                    f"not in top {self.save_top_k}")
            return None
        before = self.state_dict()
        self.best_k_models.pop(dropped, None)
        path = self._free_path(trainer, metrics, keep=dropped)
        self.current_score, self.best_k_models[str(path)] = current, current
        if len(self.best_k_models) == k:
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        self.best_model_path = (min if self.mode == "min" else max)(self.best_k_models, key=self.best_k_models.get)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose and trainer.is_global_zero:
            write_line(trainer, f"{epoch_label(trainer)}, global step {trainer.global_step}: {self.monitor!r} reached "
                                f"{current:0.5f} (best {self.best_model_score:0.5f}), saving model to {str(path)!r} as top {k}")
        self._write(trainer, path, restore=before, ranked=True)
        if dropped and dropped != str(path):
            self._remove(trainer, dropped)
        return path

    def write_last(self, trainer: Trainer) -> Path:
        """Write the whole training state to ``last.ckpt`` now (the Trainer does when preempted, also
        with ``save_weights_only``, so that the run resumes); return its path."""
        return self._save_last(trainer, self._monitor_candidates(trainer), whole=True)

    def _save_last(self, trainer: Trainer, metrics: dict[str, Any], ranked: Path | None = None,
                   whole: bool = False) -> Path:
        """Refresh ``last.ckpt``: a hard link to ``ranked`` (the ranked file of this moment), with ``save_last="link"``
        a symbolic link to the newest ranked file, or else written (also when save_checkpoint wrote no file)."""
        last = Path(self.format_checkpoint_name(metrics, self.CHECKPOINT_NAME_LAST))
        previous, self.last_model_path = self.last_model_path, str(last)
        if self.save_last == "link" and self.save_top_k != 0 and self._last_checkpoint_saved:
            ranked = Path(self._last_checkpoint_saved)
        try:
            if ranked is None or whole or (self._background is None and not self.file_exists(ranked, trainer)):
                self._write(trainer, last, weights_only=False if whole else None)
            else:
                self._link(trainer, ranked, last)
        except BaseException:
            self.last_model_path = previous
            raise
        if previous and previous != str(last):  # CHECKPOINT_NAME_LAST with a format field
            self._remove(trainer, previous)
        return last

    def _link(self, trainer: Trainer, ranked: Path, last: Path) -> None:
        """Rank zero links; every rank learns whether it could, so all raise together or none. With
        async_save, once the ranked file is complete (errors then come with the write's)."""
        error, link = None, symlink_checkpoint if self.save_last == "link" else link_checkpoint
        if self._background is not None and trainer.is_global_zero:
            self._background.submit(str(last), functools.partial(link, ranked, last))
        elif self._background is None and trainer.is_global_zero:
            try:
                link(ranked, last)
            except OSError as failure:
                error = failure
        if trainer.strategy.reduce_any(error is not None):
            raise error or OSError(f"Rank zero could not update {last}; see its error.")
        self._last_global_step_saved = trainer.global_step

    def _write(self, trainer: Trainer, path: Path, restore: dict[str, Any] | None = None,
               weights_only: bool | None = None, ranked: bool = False) -> None:
        """``trainer.save_checkpoint`` on every rank; on failure, the bookkeeping goes back to ``restore``."""
        try:
            if self._background is not None:  # the previous write first: one snapshot at a time
                self._background.wait_everywhere(trainer.strategy.reduce_any)
            trainer.save_checkpoint(path, weights_only=self.save_weights_only if weights_only is None else weights_only,
                                    background=self._background)
        except BaseException:
            if restore is not None:
                self.load_state_dict({**self.state_dict(), **restore})
            raise
        self._clock.restart(trainer.global_step)
        self._last_global_step_saved = trainer.global_step
        if ranked:
            self._last_checkpoint_saved = str(path)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _free_path(self, trainer: Trainer, metrics: dict[str, Any], keep: str | None) -> Path:
        """The checkpoint's name; with the version counter, ``-v1``, ``-v2``... while the name is taken
        (on rank zero's disk, so every rank uses the same name), unless by ``keep``, about to go."""
        path = self.format_checkpoint_name(metrics)
        if self._enable_version_counter:
            version = self.STARTING_VERSION
            if trainer.is_global_zero:
                while os.path.lexists(path) and path != keep:
                    path, version = self.format_checkpoint_name(metrics, ver=version), version + 1
            path = trainer.strategy.broadcast_object(path)
        return Path(path)

    def _remove(self, trainer: Trainer, path: str) -> None:
        """Delete a checkpoint this callback wrote (only inside its directory, never ``last.ckpt``, nor, as in
        Lightning, the checkpoint this run resumed from)."""
        resumed_from = Path(trainer.ckpt_path).absolute() if trainer.ckpt_path is not None else None
        if (trainer.is_global_zero and self._dir in Path(path).parents and path != self.last_model_path
                and path not in self.best_k_models and Path(path).absolute() != resumed_from):
            if self._background is not None:  # only once the file replacing it is complete
                self._background.submit(path, functools.partial(remove_checkpoint, path))
            else:
                remove_checkpoint(path)

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` (path: score) to ``filepath`` (default ``<dirpath>/best_k_models.yaml``)."""
        import yaml

        best_k = {path: score.item() for path, score in self.best_k_models.items()}
        with open(filepath if filepath is not None else self._dir / "best_k_models.yaml", "w") as file:
            yaml.dump(best_k, file)

    def file_exists(self, filepath: str | os.PathLike, trainer: Trainer) -> bool:
        """Whether ``filepath`` exists on rank zero's disk, the same answer on every rank."""
        return trainer.strategy.broadcast_object(os.path.exists(filepath))

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best_model_score": self.best_model_score, "best_model_path": self.best_model_path,
                "current_score": self.current_score, "dirpath": self.dirpath,
                "best_k_models": dict(self.best_k_models), "kth_best_model_path": self.kth_best_model_path,
                "kth_value": self.kth_value, "last_model_path": self.last_model_path,
                "last_global_step_saved": self._last_global_step_saved, "validated": self._validated}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_model_path = state_dict["best_model_path"]
        self._last_global_step_saved = state_dict.get("last_global_step_saved", state_dict.get("last_saved_step", 0))
        self._validated = state_dict.get("validated", False)
        saved_in = state_dict.get("dirpath")
        if self._dir is None and saved_in is not None:  # the caller of a spawned fit: where the workers saved
            self._dir = Path(saved_in)
        elif self._dir is not None and saved_in is not None and os.path.realpath(saved_in) != os.path.realpath(self._dir):
            # As Lightning: ranking files in another directory could delete them.
            warn(f"The dirpath has changed from {saved_in!r} to {self.dirpath!r}, therefore ModelCheckpoint's top-k "
                 "bookkeeping of the old directory (best_k_models, best_model_score, kth_best_model_path, kth_value, "
                 "last_model_path) is not reloaded; only best_model_path is.")
            return
        self.best_k_models = {path: torch.as_tensor(score) for path, score in state_dict["best_k_models"].items()
                              if os.path.lexists(path)}
        self.best_model_score = _tensor_or_none(state_dict.get("best_model_score"))
        self.current_score = _tensor_or_none(state_dict.get("current_score"))
        self.kth_best_model_path = state_dict.get("kth_best_model_path", "")
        self.kth_value = torch.as_tensor(state_dict.get("kth_value", self.kth_value))
        self.last_model_path = state_dict.get("last_model_path", "")

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        # Checkpoints of Cadence before Lightning's state keys name this callback by monitor and mode.
        states = checkpoint.get("callbacks", {})
        legacy = f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"
        if self.state_key not in states and legacy in states:
            states[self.state_key] = states.pop(legacy)


def _validates_next(trainer: Trainer) -> bool:
    """The epoch's last batch ran, and an end-of-epoch validation follows it (Lightning defers then)."""
    every = trainer.check_val_every_n_epoch
    return (trainer.is_last_batch and sum(trainer.num_val_batches) > 0  # also a loader without a length
            and (every is None or (trainer.current_epoch + 1) % every == 0))


def _tensor_or_none(value: Any) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value)
