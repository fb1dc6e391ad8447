"""When the training loop validates (``val_check_interval`` and ``check_val_every_n_epoch``) and
when ``should_stop`` may end it (``min_epochs`` and ``min_steps``), as in Lightning."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def validation_interval(val_check_interval: int | float, check_val_every_n_epoch: int | None, epoch: int,
                        num_batches: int | float) -> int | None:
    """Validate every this many training batches in ``epoch``; None: not in this epoch."""
    if check_val_every_n_epoch is not None and (epoch + 1) % check_val_every_n_epoch != 0:
        return None
    if isinstance(val_check_interval, int):
        if check_val_every_n_epoch is not None and val_check_interval > num_batches:
            raise ValueError(
                f"Trainer(val_check_interval={val_check_interval}) is more than the {num_batches} "
                "training batches of an epoch, so validation would never run. Use a smaller int, or "
                "check_val_every_n_epoch=None to count batches across epochs."
            )
        return val_check_interval
    if num_batches == math.inf:
        raise ValueError(
            "val_check_interval is a fraction of the epoch, but the training loader has no length. "
            "Use an int val_check_interval (every N batches)."
        )
    return max(1, int(num_batches * val_check_interval))


def validation_due(val_check_interval: int | float, check_val_every_n_epoch: int | None, batch_idx: int,
                   every: int, num_batches: int | float, batches_seen: int) -> bool:
    """As in Lightning: an int interval counts batches of the epoch, or of the whole run (``batches_seen``)
    when check_val_every_n_epoch is None; a float interval also validates after the epoch's last batch."""
    if isinstance(val_check_interval, float):
        return (batch_idx + 1) % every == 0 or batch_idx + 1 == num_batches
    count = batches_seen if check_val_every_n_epoch is None else batch_idx + 1
    return count % every == 0


def may_stop(trainer: Trainer) -> bool:
    """should_stop is set: stop, unless min_epochs/min_steps are not met yet (as in Lightning,
    early stopping then waits; a preemption signal does not). Says so once, on rank zero."""
    met = (trainer.min_epochs or 0) <= trainer.current_epoch and (trainer.min_steps or 0) <= trainer.global_step
    if met or trainer._preemption.stop_now:
        return True
    if not trainer._said_min_not_met and trainer.is_global_zero:
        trainer._said_min_not_met = True
        print(f"Cadence: should_stop was set, but min_epochs={trainer.min_epochs} / min_steps={trainer.min_steps} are "
              "not met yet; training continues until they are.", file=sys.stderr)
    return False


def say_nothing_to_train(trainer: Trainer) -> None:
    """``fit`` found its end already reached before the first batch (a second ``fit`` with the same
    ``max_epochs``, a resume from a run's final checkpoint): say which limit, on rank zero."""
    if not trainer.is_global_zero:
        return
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        reason, fix = f"max_steps={trainer.max_steps} reached (global_step={trainer.global_step})", "Raise max_steps"
    elif trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
        reason = f"max_epochs={trainer.max_epochs} reached (current_epoch={trainer.current_epoch})"
        fix = "Raise max_epochs (Trainer(max_epochs=...))"
    else:
        reason, fix = "trainer.should_stop was already set", "Set trainer.should_stop = False"
    print(f"Trainer.fit trained nothing: {reason}. {fix} to train more.", file=sys.stderr, flush=True)
