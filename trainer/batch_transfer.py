"""Lightning's batch transfer hooks: ``on_before_batch_transfer``, ``transfer_batch_to_device`` and
``on_after_batch_transfer``, of the DataModule or the module.

Each batch of every stage goes through them in that order, with its ``dataloader_idx``, as in
Lightning: the first sees the batch as the loader made it, the last sees it on the device (GPU
augmentation, as Lightning's Kornia tutorial does it, belongs there). Where both the DataModule and
the module define a hook, the DataModule's runs (Lightning's rule). A stage whose DataModule and
module define none of them moves its batches as before, through the strategy, at no cost per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


@dataclasses.dataclass(frozen=True)
class BatchTransfer:
    """The three hooks as bound methods (the overriding DataModule's or module's, else the module's
    defaults), and the module, whose device a batch goes to."""

    module: Any
    before: Any
    transfer: Any
    after: Any

    def batches(self, batches: Iterator[tuple[int, Any]], dataloader_idx: int = 0) -> Iterator[tuple[int, Any]]:
        """``(batch_idx, batch)`` pairs with each batch through the three hooks, lazily (a batch goes
        through them when the loop asks for it)."""
        device = self.module.device  # once per pass: where setup put the module
        before, transfer, after = self.before, self.transfer, self.after
        for batch_idx, batch in batches:
            yield batch_idx, after(transfer(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx)


def batch_transfer(module: Any, datamodule: Any) -> BatchTransfer | None:
    """The hooks of ``module`` and ``datamodule`` (None: no DataModule), or None when neither defines one."""
    from trainer.datamodule import overrides  # trainer.datamodule imports the module's package

    owners = [owner for owner in (datamodule, module) if owner is not None]
    chosen = {hook: next((getattr(owner, hook) for owner in owners if overrides(owner, hook)), None) for hook in HOOKS}
    if not any(chosen.values()):
        return None
    return BatchTransfer(module, *(chosen[hook] or getattr(module, hook) for hook in HOOKS))


def transferred(batches: Iterator[tuple[int, Any]], transfer: BatchTransfer | None,
                dataloader_idx: int = 0) -> Iterator[tuple[int, Any]]:
    """``batches`` through ``transfer``'s hooks; unchanged (no wrapper) when there are none."""
    if transfer is None:
        return batches
    return transfer.batches(batches, dataloader_idx)

