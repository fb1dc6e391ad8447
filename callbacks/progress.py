"""ProgressBar: tqdm bars for training and validation, on rank zero only.

The bar shows metrics logged with ``prog_bar=True`` as they stood at the last log step; it never
asks for a value itself, so it adds no host sync. When stderr is not a terminal (CI, a log file,
SLURM output) it prints one tidy line per epoch and per validation instead of redrawing bars.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from callbacks.console import epoch_label

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


def _format(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name}={value:.4g}" for name, value in metrics.items())


class ProgressBar(Callback):
    """Progress bars on rank zero.

    Args:
        refresh_rate: redraw at most every this many batches (bars only).
        leave: keep each epoch's finished bar on screen.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = True) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 1:
            raise ValueError(f"ProgressBar(refresh_rate={refresh_rate!r}): use an int >= 1.")
        self.refresh_rate = refresh_rate
        self.leave = leave
        self.enabled = True
        self.interactive = False
        self._bar: Any = None
        self._eval_bar: Any = None
        self._eval_batches = 0
        self._tqdm: Any = None

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self.enabled = trainer.is_global_zero
        self.interactive = sys.stderr.isatty()
        if self.enabled and self.interactive:
            from tqdm.auto import tqdm  # loaded on first use: importing callbacks stays cheap

            self._tqdm = tqdm

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``print`` that keeps a drawn bar whole (``self.print`` in a module comes here)."""
        if self._tqdm is not None and (self._bar is not None or self._eval_bar is not None):
            self._tqdm.write(sep.join(map(str, args)), file=kwargs.get("file"), end=kwargs.get("end", "\n"))
        else:
            print(*args, sep=sep, **kwargs)

    def _total(self, value: float) -> int | None:
        return None if value == float("inf") else int(value)

    # --- training --------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not (self.enabled and self.interactive):
            return
        total = self._total(trainer.num_training_batches)
        self._bar = self._tqdm(total=total, desc=epoch_label(trainer), leave=self.leave, dynamic_ncols=True,
                               file=sys.stderr)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self._bar
        if bar is None or (batch_idx + 1) % self.refresh_rate:
            return
        bar.update(batch_idx + 1 - bar.n)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        if self._bar is not None and trainer.progress_bar_metrics:
            self._bar.set_postfix_str(_format(trainer.progress_bar_metrics), refresh=False)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(_format(trainer.progress_bar_metrics), refresh=False)
            self._bar.close()
            self._bar = None
        elif not self.interactive:
            metrics = _format(trainer.progress_bar_metrics)
            print(f"{epoch_label(trainer)}: step {trainer.global_step}"
                  + (f", {metrics}" if metrics else ""), file=sys.stderr, flush=True)

    # --- evaluation --------------------------------------------------------------------------
    def _start_eval(self, trainer: Trainer, description: str, num_batches: list[int | float]) -> None:
        self._eval_batches = 0  # over every loader of the pass
        if self.enabled and self.interactive and not trainer.sanity_checking:
            self._eval_bar = self._tqdm(total=self._total(sum(num_batches)), desc=description,
                                        leave=False, dynamic_ncols=True, file=sys.stderr)

    def _advance_eval(self) -> None:
        self._eval_batches += 1
        if self._eval_bar is not None and self._eval_batches % self.refresh_rate == 0:
            self._eval_bar.update(self._eval_batches - self._eval_bar.n)

    def _end_eval(self, trainer: Trainer, description: str) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        if self.enabled and not trainer.sanity_checking:
            shown = {k: v for k, v in trainer.progress_bar_metrics.items()}
            if self._bar is not None:
                self._bar.set_postfix_str(_format(shown), refresh=True)
            elif not self.interactive and shown:
                print(f"{description}: {_format(shown)}", file=sys.stderr, flush=True)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_eval(trainer, "Validation", trainer.num_val_batches)

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._advance_eval()

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end_eval(trainer, "Validation")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_eval(trainer, "Test", trainer.num_test_batches)

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._advance_eval()

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end_eval(trainer, "Test")

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_eval(trainer, "Predict", trainer.num_predict_batches)

    def on_predict_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._advance_eval()

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end_eval(trainer, "Predict")

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        for bar in (self._bar, self._eval_bar):
            if bar is not None:
                bar.close()
        self._bar = self._eval_bar = None
