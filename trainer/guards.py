"""The non-finite loss guard: find the first NaN or infinite training loss without a per-step sync.

The loop appends a copy of each step's loss to a list (one small device op, no host sync; the list
and the checks are a :class:`LossGuard`, which the Trainer holds). With
``Trainer(on_nonfinite_loss="raise")``, the default, the list is checked with one host sync at
each log step, at the end of each epoch and before each checkpoint is written, so no checkpoint
ever holds the weights a non-finite loss produced; the error names the first bad batch exactly
and the last checkpoint written before it. ``"skip"`` must decide before each optimizer step, so
it costs one host sync per step: a window whose loss is not finite has its gradients dropped and
its step skipped. ``"ignore"`` checks nothing.

Why a copy: under CUDA graphs (``torch.compile(mode="reduce-overhead")``) the loss a step returns
lives in the graph's static output memory, which the next replay overwrites in place; a list of
the loss tensors themselves would be checked against later values, and miss or misplace a NaN.
The options, in CPU instructions added to a step (valgrind; ``benchmarks/loss_guard_cost.py``,
figures in ``benchmarks/RESULTS.md``): the loss itself in the list, +3.7k (what the loop did, wrong
under graphs); a copy (``loss.detach().clone()``), +12.3k; ``isfinite(loss)`` in the list, +41k
(``isfinite`` is a composite of several ops; the value is lost); a running device-side "all finite
so far" flag, +47k; a running float64 sum of the losses (non-finite once any is), +19k. The flag
and the sum forget which batch was bad. The copy is the cheapest correct one and keeps the error's
precision (the value and the first bad batch); on CUDA it is one small kernel per step, queued on
the stream right after the step, so it runs before the next replay. It is made only where a replay
can happen: on CUDA devices (``Strategy.may_replay_graphs``: the module may compile itself) and
under a callback that says its model changes replay graphs (``Compile(mode="reduce-overhead")``);
elsewhere the loop records the detached loss itself (the copy would cost a step 9.3k instructions).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from callbacks.console import MisconfigurationException, warn as warn_at_users_line

NONFINITE_LOSS_MODES = ("raise", "skip", "ignore")

#: One training batch's loss as the loop records it: (detached loss, batch_idx, global_step).
RecordedLoss = tuple[torch.Tensor, int, int]


def check_nonfinite_mode(mode: Any) -> None:
    if mode not in NONFINITE_LOSS_MODES:
        raise MisconfigurationException(
            f"Trainer(on_nonfinite_loss={mode!r}): use 'raise' (stop with an error, the default), "
            "'skip' (drop the step; one host sync per step) or 'ignore'."
        )


def first_nonfinite(losses: list[RecordedLoss]) -> tuple[float, int, int] | None:
    """``(value, batch_idx, global_step)`` of the first NaN or infinite loss in ``losses``, or None.

    One host sync for the whole list (two when one is found). Losses on the CPU are read one by one:
    there is no device to wait for, and stacking 0-d tensors costs a view apiece (~15x the reads).
    """
    for index, (loss, batch_idx, global_step) in enumerate(losses):
        if not loss.is_cpu:  # the rest, on a device: one read for them all
            return _first_nonfinite_on_device(losses[index:])
        value = loss.item()
        if not math.isfinite(value):
            return value, batch_idx, global_step
    return None


def _first_nonfinite_on_device(losses: list[RecordedLoss]) -> tuple[float, int, int] | None:
    finite = torch.isfinite(torch.stack([loss for loss, _, _ in losses]))
    if bool(finite.all()):
        return None
    index = int((~finite).nonzero()[0, 0])
    loss, batch_idx, global_step = losses[index]
    return float(loss), batch_idx, global_step


def nonfinite_loss_error(bad: tuple[float, int, int] | None, epoch: int, last_checkpoint: tuple[str, int] | None) -> FloatingPointError:
    """The error for a non-finite loss; ``bad`` is None on a rank that saw only finite losses."""
    if bad is None:
        what = "Another process saw a non-finite training loss (see its error)"
    else:
        value, batch_idx, global_step = bad
        what = f"The training loss is {value} at epoch {epoch}, batch {batch_idx} (global step {global_step})"
    if last_checkpoint is None:
        saved = "No checkpoint was written before it."
    else:
        saved = (f"The last good checkpoint is {last_checkpoint[0]} (global step {last_checkpoint[1]}); "
                 "resume from it with fit(..., ckpt_path=...) once the cause is fixed.")
    return FloatingPointError(
        f"{what}. Training stopped; no checkpoint holds the weights it produced. {saved} Common causes: "
        "a learning rate too high, no gradient clipping (gradient_clip_val), float16 without loss "
        "scaling, bad samples (NaN/inf in the data). Trainer(on_nonfinite_loss='skip') skips such "
        "steps instead."
    )


class LossGuard:
    """The non-finite loss guard of one Trainer: the losses recorded since the last check, the last
    checkpoint written before them (named in the error) and the steps skipped.

    Args:
        mode: ``Trainer(on_nonfinite_loss=...)``.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.losses: list[RecordedLoss] = []  # the loop appends each step's (loss, batch_idx, global_step)
        self.last_checkpoint: tuple[str, int] | None = None  # (path, global step) last written or loaded
        self.skipped = 0  # optimizer steps skipped for a NaN/inf loss ("skip")

    def check(self, strategy: Any, epoch: int) -> None:
        """"raise": fail on the first NaN/inf loss since the last check (one host sync), on every
        rank if any rank saw one (none waits at a collective). The others forget the losses."""
        losses, self.losses = self.losses, []
        if self.mode != "raise" or not losses:
            return
        bad = first_nonfinite(losses)
        if strategy.reduce_any(bad is not None):
            raise nonfinite_loss_error(bad, epoch, self.last_checkpoint)

    def window_is_finite(self, strategy: Any, optimizers: list[Any], warn: bool, epoch: int, step: int) -> bool:
        """"skip", before an optimizer step: if a loss of this accumulation window is NaN/inf on any
        rank, drop the gradients of ``optimizers``, count the skip and return False; the first skip
        is said (with ``warn``: on rank zero). Deciding now costs a host sync."""
        losses, self.losses = self.losses, []
        bad = first_nonfinite(losses)
        if not strategy.reduce_any(bad is not None):
            return True
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        if self.skipped == 1 and warn:
            what = f"the loss is {bad[0]} at batch {bad[1]}" if bad is not None else "another rank saw a non-finite loss"
            warn_at_users_line(f"Skipped an optimizer step at epoch {epoch}, global step {step}: {what}. Further "
                               "skips are counted in trainer.num_skipped_steps.")
        return False
