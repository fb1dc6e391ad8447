"""Lightning's batch transfer hooks: ``on_before_batch_transfer``, ``transfer_batch_to_device`` and
``on_after_batch_transfer``, of the DataModule or the module.

Each batch of every stage goes through them in that order, with its ``dataloader_idx``, as in
Lightning: the first sees the batch as the loader made it, the last sees it on the device (GPU
augmentation, as Lightning's Kornia tutorial does it, belongs there). Where both the DataModule and
the module define a hook, the DataModule's runs (Lightning's rule). A stage whose DataModule and
module define none of them moves its batches as before, through the strategy, at no cost per step
(unless a callback converts batches: ``TruePrecision``'s ``convert_input`` runs before the hooks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


@dataclasses.dataclass(frozen=True)
class BatchTransfer:
    """The three hooks as bound methods (the overriding DataModule's or module's, else the module's
    defaults), and the module, whose device a batch goes to; or, with the hooks None, only
    ``convert``, the callbacks' ``convert_input`` (TruePrecision's dtype), which runs first, as
    Lightning's precision plugin's ``convert_input`` does; then the strategy moves the batches."""

    module: Any
    before: Any
    transfer: Any
    after: Any
    convert: Any = None

    def batches(self, batches: Iterator[tuple[int, Any]], dataloader_idx: int = 0) -> Iterator[tuple[int, Any]]:
        """``(batch_idx, batch)`` pairs with each batch through the three hooks, lazily (a batch goes
        through them when the loop asks for it)."""
        convert = self.convert
        if self.before is None:
            for batch_idx, batch in batches:
                yield batch_idx, convert(batch)
            return
        device = self.module.device  # once per pass: where setup put the module
        before, transfer, after = self.before, self.transfer, self.after
        for batch_idx, batch in batches:
            batch = batch if convert is None else convert(batch)
            yield batch_idx, after(transfer(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx)


def batch_transfer(module: Any, datamodule: Any, converts: Sequence[Any] = ()) -> BatchTransfer | None:
    """The hooks of ``module`` and ``datamodule`` (None: no DataModule) after the ``converts``
    (the callbacks' ``convert_input`` overrides), or None when there is nothing to call."""
    from trainer.datamodule import overrides  # trainer.datamodule imports the module's package

    convert = _chained(converts)
    owners = [owner for owner in (datamodule, module) if owner is not None]
    chosen = {hook: next((getattr(owner, hook) for owner in owners if overrides(owner, hook)), None) for hook in HOOKS}
    if not any(chosen.values()):
        return None if convert is None else BatchTransfer(module, None, None, None, convert)
    from trainer.stage_metrics import refusing  # the overrides refuse self.log, as Lightning's (per batch: only theirs)

    return BatchTransfer(module, *(functools.partial(refusing, module, hook, chosen[hook]) if chosen[hook] else
                                   getattr(module, hook) for hook in HOOKS), convert=convert)


def _chained(converts: Sequence[Any]) -> Any:
    """One function applying each of ``converts`` in turn, or None for none."""
    if len(converts) <= 1:
        return converts[0] if converts else None

    def convert(batch: Any) -> Any:
        for each in converts:
            batch = each(batch)
        return batch
    return convert


def transferred(batches: Iterator[tuple[int, Any]], transfer: BatchTransfer | None,
                dataloader_idx: int = 0) -> Iterator[tuple[int, Any]]:
    """``batches`` through ``transfer``'s hooks; unchanged (no wrapper) when there are none."""
    if transfer is None:
        return batches
    return transfer.batches(batches, dataloader_idx)

