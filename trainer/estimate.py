"""``Trainer.estimated_stepping_batches``: Lightning's total of optimizer steps, which schedules
(linear warm-up, OneCycleLR) read in ``configure_optimizers``.

Lightning builds the training loader early to count its batches. Cadence builds it after
``configure_optimizers`` (so that a resumed run draws its loaders' seeds in the same order), so
only a run bounded by ``max_steps`` alone has a total known by then; any other is an error that
says what to use instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def estimated_stepping_batches(trainer: Trainer) -> int:
    """The optimizer steps the fit will take: ``max_steps`` when nothing else bounds the run."""
    if trainer.max_steps > 0 and trainer.max_epochs in (None, -1):
        return trainer.max_steps
    raise RuntimeError(
        f"trainer.estimated_stepping_batches: Cadence builds the training loader after configure_optimizers, "
        f"so with max_epochs={trainer.max_epochs} and max_steps={trainer.max_steps} the number of optimizer "
        "steps is not known there. Bound the run by steps, Trainer(max_steps=N) without max_epochs, and the "
        "estimate is N; or compute it yourself: ceil(len(train_loader) / accumulate_grad_batches) * max_epochs "
        "(per process under DDP)."
    )
