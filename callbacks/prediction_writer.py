"""BasePredictionWriter: write predictions as they come (Lightning's), instead of keeping them.

Subclass it and implement ``write_on_batch_end`` (``write_interval="batch"``), ``write_on_epoch_end``
(``"epoch"``) or both (``"batch_and_epoch"``); then ``trainer.predict(model, loader,
return_predictions=False)`` keeps nothing in memory. Under DDP each process writes its own share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

WRITE_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Hand each batch's predictions, or the whole pass's, to your ``write_on_*`` methods.

    Args:
        write_interval: ``"batch"``, ``"epoch"`` or ``"batch_and_epoch"``.

    ``batch_indices`` are Lightning's: the dataset indices of each batch's samples (under DDP too), a
    list per batch; at the epoch end a list of those per loader. ``[]`` where a loader does not say
    (an IterableDataset's, or a loader with ``batch_size=None``).

    Example::

        class TorchSave(BasePredictionWriter):
            def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
                torch.save(predictions, f"predictions_{trainer.global_rank}.pt")
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in WRITE_INTERVALS:
            raise MisconfigurationException(
                f"`write_interval` should be one of {list(WRITE_INTERVALS)}: "
                f"BasePredictionWriter(write_interval={write_interval!r}).")
        self.interval = write_interval
        self._predictions: list[list[Any]] = []
        self._indices: list[list[list[int]]] = []  # per loader, per batch

    def write_on_batch_end(self, trainer: Trainer, pl_module: TrainingModule, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Write one batch's predictions (override it for ``write_interval="batch"``)."""
        raise NotImplementedError(f"{type(self).__name__} writes each batch (write_interval={self.interval!r}): "
                                  "implement write_on_batch_end.")

    def write_on_epoch_end(self, trainer: Trainer, pl_module: TrainingModule, predictions: Sequence[Any],
                           batch_indices: Sequence[Any] | None) -> None:
        """Write the pass's predictions: a list of batch outputs (a list of them per loader with several)."""
        raise NotImplementedError(f"{type(self).__name__} writes at the end (write_interval={self.interval!r}): "
                                  "implement write_on_epoch_end.")

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._predictions, self._indices = [], []

    def on_predict_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        loaders = trainer.predict_dataloaders
        loader = loaders[dataloader_idx] if isinstance(loaders, list) else loaders
        seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", None)
        indices = seen[batch_idx] if seen else []
        if self.interval != "epoch":
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)
        if self.interval != "batch":  # kept for write_on_epoch_end
            while len(self._predictions) <= dataloader_idx:
                self._predictions.append([])
                self._indices.append([])
            self._predictions[dataloader_idx].append(outputs)
            if seen:
                self._indices[dataloader_idx].append(indices)

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.interval != "batch":
            predictions, self._predictions = self._predictions, []
            indices, self._indices = self._indices or [[]], []
            self.write_on_epoch_end(trainer, module, predictions if len(predictions) > 1 else (predictions or [[]])[0],
                                    indices)
