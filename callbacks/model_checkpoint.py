"""ModelCheckpoint: save the whole training state on a schedule, keep the best k and the last.

Files are written through ``trainer.save_checkpoint`` (atomic; rank zero writes, every rank
waits). A checkpoint is written only after an optimizer step, never in the middle of a gradient
accumulation window, so resuming from it is exact. The top-k bookkeeping is part of this
callback's state and is updated *before* the files are written, so each file records itself and
the bookkeeping survives a restart; ``last.ckpt`` is a hard link to the ranked file of the same
moment when there is one (one serialization, not two). Under FSDP each checkpoint is a directory
of shards (``strategies/checkpoint/sharded.py``): ``last.ckpt`` is then a directory of hard links
to the ranked one's files, and pruning removes whole directories.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from strategies.checkpoint import link_checkpoint, remove_checkpoint

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class ModelCheckpoint(Callback):
    """Save checkpoints during ``fit``.

    Args:
        dirpath: the directory; default ``<log_dir>/checkpoints``.
        filename: a format string over ``epoch``, ``step`` and logged metrics, e.g.
            ``"{epoch}-{val/loss:.3f}"``; default ``"epoch={epoch}-step={step}"``.
        monitor: the metric that ranks checkpoints; None keeps the most recent ``save_top_k``.
        mode: ``"min"`` or ``"max"``: which values of ``monitor`` are better.
        save_top_k: how many ranked checkpoints to keep; -1 keeps all, 0 none (``last`` only).
        save_last: also keep ``last.ckpt``, the state ``fit(ckpt_path="last")`` resumes from.
        every_n_train_steps: save every this many optimizer steps.
        every_n_epochs: save at the end of every this many epochs (after that epoch's validation).
        train_time_interval: save when this many seconds passed since the last save. Checked at
            log steps (``Trainer(log_every_n_steps)``), where under DDP the ranks agree.

    Example::

        ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=3, every_n_train_steps=1000)
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = 1,
                 train_time_interval: float | None = None) -> None:
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise ValueError(f"ModelCheckpoint(dirpath={dirpath!r}): use a directory path or None.")
        if filename is not None and (not isinstance(filename, str) or not filename):
            raise ValueError(f"ModelCheckpoint(filename={filename!r}): use a format string like \"{{epoch}}-{{step}}\".")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"ModelCheckpoint(monitor={monitor!r}): use the name of a logged metric, or None.")
        if mode not in ("min", "max"):
            raise ValueError(f'ModelCheckpoint(mode="{mode}"): use "min" or "max".')
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0, or a positive int.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelCheckpoint({name}={value!r}): use an int >= 1 or None.")
        if train_time_interval is not None and (isinstance(train_time_interval, bool) or not (
                isinstance(train_time_interval, (int, float)) and train_time_interval > 0)):
            raise ValueError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use seconds > 0 or None.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_train_steps, self.every_n_epochs = every_n_train_steps, every_n_epochs
        self.train_time_interval = train_time_interval
        self.best_k_models: dict[str, float] = {}  # path -> score, the files kept on disk
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()
        self._step_at_last_batch = 0
        self._validated = False  # a validation ran in this fit: a missing monitor is then an error
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    # --- when to save ---------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir) / "checkpoints"
        if self.dirpath.exists() and not self.dirpath.is_dir():
            raise ValueError(f"ModelCheckpoint(dirpath={str(self.dirpath)!r}) is a file; use a directory.")
        self._last_save_time = time.monotonic()
        if stage == "fit":  # before a checkpoint is restored, which may set it again
            self._validated = False

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._step_at_last_batch = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped = trainer.global_step != self._step_at_last_batch
        self._step_at_last_batch = trainer.global_step
        if not stepped:  # mid accumulation window: a checkpoint would lose the partial gradients
            return
        due = self.every_n_train_steps is not None and trainer.global_step % self.every_n_train_steps == 0
        if self.train_time_interval is not None and trainer.global_step % trainer.log_every_n_steps == 0:
            # Each rank reads its own clock; they agree here, every log_every_n_steps steps, not per step.
            elapsed = time.monotonic() - self._last_save_time >= self.train_time_interval
            due = trainer.strategy.reduce_any(elapsed) or due
        if due and trainer.global_step != self._last_saved_step:
            self.save(trainer)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking and trainer.stage == "fit":
            self._validated = True

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    # --- saving ---------------------------------------------------------------------------
    def save(self, trainer: Trainer) -> None:
        """Write a checkpoint now: rank it by ``monitor`` (keeping ``save_top_k``), refresh ``last.ckpt``."""
        self._last_save_time = time.monotonic()
        self._last_saved_step = trainer.global_step
        # Rank zero's values decide, so every rank takes the same branch (and meets the same barrier).
        metrics = trainer.strategy.broadcast_object({k: float(v) for k, v in trainer.callback_metrics.items()})
        score = self._score(metrics, trainer)
        if self.save_top_k == 0 or score is None or not self._improves(score):
            if self.save_last:
                self.write_last(trainer)
            if score is None and self._validated and self.save_top_k != 0:
                raise RuntimeError(
                    f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric after validation; logged "
                    f"metrics are {sorted(metrics)}. {'last.ckpt was saved. ' if self.save_last else ''}Log it "
                    "with self.log or fix monitor, then resume with fit(..., ckpt_path=\"last\")."
                )
            return
        path = self.dirpath / (self._format_name(trainer, metrics) + ".ckpt")
        before = self.state_dict()
        self.best_k_models[str(path)] = score
        pruned = self._rank()
        if self.save_last:
            self.last_model_path = str(self.dirpath / "last.ckpt")
        try:
            trainer.save_checkpoint(path)
            if self.save_last and trainer.is_global_zero:
                link_checkpoint(path, Path(self.last_model_path))
        except BaseException:
            self.load_state_dict(before)
            raise
        if trainer.is_global_zero:
            for old in pruned:
                if old != str(path):
                    remove_checkpoint(old)

    def write_last(self, trainer: Trainer) -> Path:
        """Write ``<dirpath>/last.ckpt`` now (also used by the Trainer when preempted); return its path."""
        last = self.dirpath / "last.ckpt"
        previous, self.last_model_path = self.last_model_path, str(last)
        try:
            trainer.save_checkpoint(last)
        except BaseException:
            self.last_model_path = previous
            raise
        return last

    def _score(self, metrics: dict[str, float], trainer: Trainer) -> float | None:
        if self.monitor is None:
            return float(trainer.global_step)  # no monitor: the newest checkpoints are "best"
        score = metrics.get(self.monitor)
        if score is None:
            if not self._validated and not self._warned_missing and trainer.is_global_zero:
                self._warned_missing = True
                warnings.warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric at step {trainer.global_step} "
                    f"(logged: {sorted(metrics)}); this checkpoint is not ranked, only last.ckpt is written. "
                    "It is an error once a validation has run.", stacklevel=3)
            return None
        if math.isnan(score):  # NaN is the worst score, never the best
            return math.inf if self.mode == "min" else -math.inf
        return score

    def _improves(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        scores = self.best_k_models.values()
        return score < max(scores) if self._mode == "min" else score > min(scores)

    @property
    def _mode(self) -> str:
        return self.mode if self.monitor is not None else "max"

    def _rank(self) -> list[str]:
        """Update best_model_path/score; return the paths that fall out of the top k."""
        ranked = sorted(self.best_k_models, key=self.best_k_models.get, reverse=(self._mode == "max"))
        self.best_model_path = ranked[0]
        self.best_model_score = self.best_k_models[ranked[0]]
        if self.save_top_k == -1:
            return []
        for path in ranked[self.save_top_k:]:
            del self.best_k_models[path]
        return ranked[self.save_top_k:]

    def _format_name(self, trainer: Trainer, metrics: dict[str, float]) -> str:
        values = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({k.replace("/", "_"): v for k, v in metrics.items()})
        template = self.filename.replace("/", "_")
        try:
            return template.format(**values)
        except (KeyError, ValueError, IndexError) as error:
            raise ValueError(f"ModelCheckpoint(filename={self.filename!r}) names {error}, which is not "
                             f"among epoch, step and the logged metrics {sorted(metrics)}.") from None

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "last_saved_step": self._last_saved_step, "validated": self._validated,
                "dirpath": str(self.dirpath) if self.dirpath is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = state_dict.get("last_saved_step", -1)
        self._validated = state_dict.get("validated", False)
        if self.dirpath is not None and state_dict.get("dirpath") not in (None, str(self.dirpath)):
            # Lightning does the same: ranking files in another directory could delete them.
            warnings.warn(
                f"ModelCheckpoint's dirpath changed from {state_dict['dirpath']} to {self.dirpath}; the "
                "top-k bookkeeping of the old directory is not restored.", stacklevel=2)
            return
        self.best_k_models = {path: score for path, score in state_dict["best_k_models"].items() if Path(path).exists()}
        self.best_model_path = state_dict["best_model_path"]
        self.best_model_score = state_dict.get("best_model_score")
        self.last_model_path = state_dict["last_model_path"]
