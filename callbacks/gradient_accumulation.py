"""GradientAccumulationScheduler: change ``accumulate_grad_batches`` by epoch (Lightning's).

``GradientAccumulationScheduler(scheduling={0: 8, 4: 4, 8: 1})`` accumulates 8 batches per
optimizer step in epochs 0-3, 4 in epochs 4-7, then 1. It sets ``trainer.accumulate_grad_batches``
when each epoch starts, which the loop reads at every batch, so accumulation, the loss scaling
by the window's length and DDP's gradient sync (once per window) follow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from callbacks.base import Callback
from callbacks.console import MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class GradientAccumulationScheduler(Callback):
    """Accumulate ``scheduling[e]`` batches per optimizer step from epoch ``e`` on.

    Args:
        scheduling: ``{first epoch: batches to accumulate}``; epochs before the first key accumulate 1.
    """

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(f"GradientAccumulationScheduler(scheduling={scheduling!r}): use a non-empty dict "
                            "{epoch: batches to accumulate}, such as {0: 8, 4: 1}.")
        if any(isinstance(key, bool) or not isinstance(key, int) or key < 0 for key in scheduling):
            raise MisconfigurationException(
                f"Epoch should be an int >= 0: GradientAccumulationScheduler(scheduling={scheduling!r}): "
                "the keys are epochs, ints >= 0.")
        if any(isinstance(value, bool) or not isinstance(value, int) or value < 1 for value in scheduling.values()):
            raise MisconfigurationException(
                f"Accumulation factor should be an int >= 1: GradientAccumulationScheduler(scheduling="
                f"{scheduling!r}): the values are numbers of batches to accumulate, ints >= 1.")
        self.scheduling = {0: 1, **scheduling}  # as in Lightning: 1 until the first epoch given
        self.epochs = sorted(self.scheduling)
        self._set: int | None = None  # the factor it last gave the trainer

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(value > 1 for value in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        return self.scheduling[max(first for first in self.epochs if first <= epoch)]

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not module.automatic_optimization:
            raise RuntimeError("Automatic gradient accumulation and the `GradientAccumulationScheduler` is not supported "
                               "for manual optimization: GradientAccumulationScheduler accumulates in automatic "
                               "optimization only; with self.automatic_optimization = False, accumulate in "
                               "training_step (or remove it).")
        overridden = [name for name in ("optimizer_step", "optimizer_zero_grad")  # defined below TrainingModule's
                      if sum(name in vars(cls) for cls in type(module).__mro__) > 1]
        if overridden and self.going_to_accumulate_grad_batches():
            warn(f"When using `Trainer(accumulate_grad_batches != 1)` and overriding `LightningModule.optimizer_{{step,"
                 f"zero_grad}}`, the hooks will not be called on every batch (rather, they are called on every "
                 f"optimization step): {type(module).__name__}.{overridden[0]} runs once per accumulation window.")
        if trainer.accumulate_grad_batches not in (1, self._set):
            raise MisconfigurationException(
                f"You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
                f"callback: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and a "
                "GradientAccumulationScheduler: pass one of them ({0: N} accumulates N from the start).")

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._set = trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)
