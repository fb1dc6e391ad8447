"""The data hooks a DataModule and a TrainingModule share (Lightning's ``DataHooks``).

The Trainer asks ``prepare_data`` once per machine (or once in all, with
``prepare_data_per_node = False``) before any process sets up, and the ``*_dataloader`` hooks of
a stage after ``setup(stage)``. A hook returning None gives that stage no loader of its own.
The batch transfer hooks change each batch around its move to the device.
"""

from __future__ import annotations

from typing import Any

import torch

from strategies.transfer import move_to_device


class DataHooks:
    """Where a stage's loaders come from when none are passed to it: each hook is a no-op here."""

    #: Call prepare_data once per machine (True) or once in all (False: shared storage).
    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Download or write data to disk. Runs in one process per machine: state set here is not
        seen by the others (build datasets in ``setup``)."""

    def train_dataloader(self) -> Any:
        """The training loader (``fit``)."""
        return None

    def val_dataloader(self) -> Any:
        """The validation loader, or a list (or dict) of them (``fit``, ``validate``)."""
        return None

    def test_dataloader(self) -> Any:
        """The test loader, or a list (or dict) of them (``test``)."""
        return None

    def predict_dataloader(self) -> Any:
        """The prediction loader, or a list (or dict) of them (``predict``)."""
        return None

    # Each batch of every stage goes through these three, in this order (trainer/batch_transfer.py);
    # the DataModule's override wins over the module's.
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change ``batch`` as the loader made it, before it moves to the device; return it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move ``batch`` to ``device`` (default: every tensor in it, as ``move_data_to_device``); return it."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change ``batch`` on the device (GPU augmentation) before the step sees it; return it."""
        return batch
