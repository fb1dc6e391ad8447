"""ModelCheckpoint: save the whole training state on a schedule, keep the best k and the last.

Files are written through ``trainer.save_checkpoint`` (atomic, rank zero only). The top-k
bookkeeping is part of this callback's state, so it survives a restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback

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
        save_last: also keep ``last.ckpt``, the state to resume from.
        every_n_train_steps: save every this many optimizer steps.
        every_n_epochs: save at the end of every this many epochs (after validation).
        train_time_interval: save when this many seconds passed since the last save.

    Example::

        ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=3)
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 monitor: str | None = None, mode: str = "min", save_top_k: int = 1, save_last: bool = True,
                 every_n_train_steps: int | None = None, every_n_epochs: int | None = 1,
                 train_time_interval: float | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f'ModelCheckpoint(mode="{mode}"): use "min" or "max".')
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0, or a positive int.")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelCheckpoint({name}={value!r}): use an int >= 1 or None.")
        if train_time_interval is not None and not (isinstance(train_time_interval, (int, float)) and train_time_interval > 0):
            raise ValueError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use seconds > 0 or None.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "epoch={epoch}-step={step}"
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_train_steps, self.every_n_epochs = every_n_train_steps, every_n_epochs
        self.train_time_interval = train_time_interval
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.last_model_path = ""
        self._last_save_time: float | None = None
        self._last_saved_step = -1

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir) / "checkpoints"
        import time

        self._clock = time.monotonic
        self._last_save_time = self._clock()

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        due = self.every_n_train_steps is not None and trainer.global_step % self.every_n_train_steps == 0
        if self.train_time_interval is not None and self._clock() - self._last_save_time >= self.train_time_interval:
            due = True
        if due and trainer.global_step != self._last_saved_step:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        """Write a checkpoint now; rank it by ``monitor``; refresh ``last.ckpt``."""
        self._last_save_time = self._clock()
        self._last_saved_step = trainer.global_step
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if self.save_top_k != 0:
            score = metrics.get(self.monitor) if self.monitor else float(trainer.global_step)
            if self.monitor is not None and score is None:
                raise RuntimeError(
                    f"ModelCheckpoint(monitor={self.monitor!r}) found no such metric; logged metrics are "
                    f"{sorted(metrics)}. Log it with self.log or change monitor."
                )
            mode = self.mode if self.monitor else "max"
            if self._improves(score, mode):
                path = self.dirpath / (self._format_name(trainer, metrics) + ".ckpt")
                trainer.save_checkpoint(path)
                self.best_k_models[str(path)] = score
                self._prune(mode, trainer)
        if self.save_last:
            last = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(last)
            self.last_model_path = str(last)

    def _improves(self, score: float, mode: str) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        worst = max(self.best_k_models.values()) if mode == "min" else min(self.best_k_models.values())
        return score < worst if mode == "min" else score > worst

    def _prune(self, mode: str, trainer: Trainer) -> None:
        ranked = sorted(self.best_k_models, key=self.best_k_models.get, reverse=(mode == "max"))
        self.best_model_path = ranked[0]
        if self.save_top_k == -1:
            return
        for path in ranked[self.save_top_k:]:
            del self.best_k_models[path]
            if trainer.is_global_zero:
                Path(path).unlink(missing_ok=True)

    def _format_name(self, trainer: Trainer, metrics: dict[str, float]) -> str:
        values = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({k.replace("/", "_"): v for k, v in metrics.items()})
        template = self.filename.replace("/", "_")
        try:
            return template.format(**values)
        except (KeyError, ValueError) as error:
            raise ValueError(f"ModelCheckpoint(filename={self.filename!r}) names {error}, which is not "
                             f"among epoch, step and the logged metrics {sorted(metrics)}.") from None

    def state_dict(self) -> dict[str, Any]:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "last_model_path": self.last_model_path, "dirpath": str(self.dirpath) if self.dirpath else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_k_models = dict(state_dict["best_k_models"])
        self.best_model_path = state_dict["best_model_path"]
        self.last_model_path = state_dict["last_model_path"]
