"""AutoMicrobatch: a training step that runs out of memory is redone in microbatches, not lost.

When the forward or backward of a batch raises ``torch.OutOfMemoryError``, the callback frees what
the failed attempt held and runs the batch again as 2, 4, 8, ... microbatches, accumulating their
gradients inside the step; the optimizer steps once, on the gradient of the whole batch. Each
microbatch's loss is weighted by its share of the batch (``loss_i * n_i / N``, also for an uneven
last piece), so for a loss that is a mean over the samples the update equals the unsplit one up
to floating-point rounding. The split is kept for the batches that follow (and saved in
checkpoints); the rank that splits says so in one line, and the end-of-fit performance report
names it. No batch and no optimizer step is skipped.

How it composes:

- ``accumulate_grad_batches``: the microbatches of a batch are a window inside the window; the
  loss is also divided by ``accumulate_grad_batches``, as the loop does.
- Gradient clipping, ``on_before_optimizer_step``, the optimizer step, zero grad: unchanged, once
  per window, after the last microbatch.
- AMP: each microbatch runs under autocast; with float16 each scaled loss is backpropagated with
  the same scale (the scaler updates only after the step), so the scaled gradients add up as the
  unsplit batch's would.
- DDP: the microbatches of the window's last batch but its last run under ``no_sync``; the last
  one all-reduces the accumulated gradient. Ranks may split differently: each weights by its own
  share, so each rank's gradient is its batch's mean gradient, and their average is the one an
  unsplit run makes.
- ``on_before_backward``/``on_after_backward`` run once per microbatch (they surround each
  ``backward``, as with accumulation), given the weighted loss that is backpropagated.
- ``self.log`` in ``training_step`` (and the backward hooks): the batch's value is logged once,
  combined from its microbatches by the metric's ``reduce_fx``: a ``"mean"`` weighted by each
  microbatch's share, a ``"sum"`` summed, ``"max"``/``"min"`` reduced; a ``batch_size`` passed per
  microbatch is summed. A metric object (torchmetrics) is updated by every microbatch; its per-step
  value is the last microbatch's.
- ``on_train_batch_end`` gets the whole batch and the last microbatch's outputs with the batch's
  loss (the weighted sum, which is also what the non-finite loss guard checks).

Refused, because the split would change the mathematics: BatchNorm layers in training mode (their
statistics would be a microbatch's; ``allow_batchnorm=True`` accepts that) and manual optimization
(``training_step`` runs its own backward and step). Cannot be redone exactly, so an error says so:
an out-of-memory error in a backward in the middle of an accumulation window (the gradients of the
window's earlier batches are mixed with part of this one's), and, with several processes, in the
backward that all-reduces (the other ranks have exchanged part of the gradients) or in a DDP
forward that had broadcast the module's buffers. ``AutoMicrobatch(microbatches=N)`` starts split,
which avoids them. Under FSDP every forward and backward gathers and scatters shards: an
out-of-memory error in the middle leaves the processes' collectives out of step, so start split.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from strategies.transfer import rebuild_mapping

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Values that are one per sample when a list of them has the batch's length (default_collate's strings).
_PLAIN = (str, bytes, int, float, bool, type(None))


class AutoMicrobatch(Callback):
    """Redo a batch that runs out of memory as 2, 4, ... microbatches with the same update.

    Args:
        allow_batchnorm: accept BatchNorm layers in training mode, whose batch statistics are then
            a microbatch's (and their running statistics updated once per microbatch).
        microbatches: the split to start with (1: whole batches until one does not fit).

    Example::

        Trainer(callbacks=[AutoMicrobatch()])
    """

    owns_forward_backward = True

    def __init__(self, allow_batchnorm: bool = False, microbatches: int = 1) -> None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise MisconfigurationException(
                f"AutoMicrobatch(microbatches={microbatches!r}): use a whole number of at least 1.")
        self.allow_batchnorm = bool(allow_batchnorm)
        self.microbatches = microbatches  # how many pieces the next batch starts as
        self.splits: list[dict[str, Any]] = []  # each time the split grew: where, why, to what
        self._in_window = False  # a batch of the current accumulation window has run

    def __repr__(self) -> str:
        return f"AutoMicrobatch(microbatches={self.microbatches})"

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # Here, not in setup: the module's configure_model may build layers (BatchNorm) after setup.
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "AutoMicrobatch redoes the Trainer's backward in parts, but with self.automatic_optimization = False "
                "training_step runs its own backward and optimizer step, which cannot be split from outside. Remove "
                "AutoMicrobatch, or split the batch in training_step (several manual_backward calls, one opt.step())."
            )
        norms = [name for name, layer in module.named_modules() if isinstance(layer, _BatchNorm) and layer.training]
        if norms and not self.allow_batchnorm:
            raise MisconfigurationException(
                f"AutoMicrobatch: {type(module).__name__} has BatchNorm layers in training mode ({', '.join(norms[:3])}"
                f"{', ...' if len(norms) > 3 else ''}). They normalize with the statistics of the batch they see, so a "
                "batch split into microbatches would train differently from the whole batch. Use GroupNorm or "
                "LayerNorm, or pass AutoMicrobatch(allow_batchnorm=True) to accept microbatch statistics (also if "
                "the layers are frozen in eval mode during training)."
            )

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._in_window = False  # every epoch ends its last window with a step

    # --- the seam ------------------------------------------------------------------------
    def forward_backward(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, syncs: bool,
                         forward: Any) -> tuple[Any, torch.Tensor]:
        starts_window, self._in_window = not self._in_window, not syncs
        metrics = trainer.metrics
        logs = SplitLogs(metrics.current)
        metrics.current = logs  # self.log writes here while the batch runs (see SplitLogs)
        try:
            outputs, loss = self._run(trainer, batch, batch_idx, syncs, forward, logs, starts_window)
        finally:
            metrics.current = logs.stage
        logs.commit()
        return outputs, loss

    def _run(self, trainer: Trainer, batch: Any, batch_idx: int, syncs: bool, forward: Any, logs: SplitLogs,
             starts_window: bool) -> tuple[Any, torch.Tensor]:
        count, total, done = self.microbatches, None, 0  # done: samples whose gradient is in .grad
        losses: list[torch.Tensor] = []
        accumulate, grown_in = trainer.accumulate_grad_batches, None
        while True:
            if count == 1:
                piece, share, stop = batch, 1.0, None
            else:
                total = batch_size_of(batch) if total is None else total
                stop = min(total, done + math.ceil(total / count))
                piece, share = slice_batch(batch, done, stop, total), (stop - done) / total
            last = stop is None or stop == total
            logs.pieces.append((share, []))
            phase = "forward"
            try:
                # All but the last microbatch of the window's last batch: no gradient all-reduce yet.
                with trainer.strategy.no_backward_sync(trainer.model, enabled=syncs and not last):
                    outputs, loss = forward(piece, batch_idx)
                    phase = "backward"
                    weighted = loss * share if count > 1 else loss
                    trainer.run_backward(weighted / accumulate if accumulate > 1 else weighted)
            except torch.OutOfMemoryError as error:
                # Decided here, so that an error that ends the run has the out-of-memory error as its cause.
                current = self._check_recoverable(trainer, error, phase, piece, batch_idx, syncs and last, starts_window)
            else:
                losses.append(loss.detach() * share if count > 1 else loss)
                if last:
                    break
                done = stop
                continue
            # Out of the except block: the traceback, and with it the failed attempt's tensors, is gone.
            outputs = loss = weighted = piece = None
            logs.pieces.pop()
            if phase == "backward":  # part of this batch's gradient is in .grad: the window starts anew
                for optimizer in trainer.optimizers:
                    optimizer.zero_grad(set_to_none=True)
                done, losses, logs.pieces = 0, [], []
            _free_memory(trainer.strategy.device)
            total = batch_size_of(batch) if total is None else total
            while math.ceil(total / count) >= current:  # 2, 4, 8, ... pieces until one is smaller
                count *= 2
            grown_in = phase
        if grown_in is not None:
            self._say(trainer, batch_idx, count, grown_in, total)
        if count == 1:
            return outputs, losses[0]
        loss = torch.stack(losses).sum() if len(losses) > 1 else losses[0]
        return ({**outputs, "loss": loss} if isinstance(outputs, dict) else loss), loss

    def _check_recoverable(self, trainer: Trainer, error: torch.OutOfMemoryError, phase: str, piece: Any,
                           batch_idx: int, all_reduces: bool, starts_window: bool) -> int:
        """The size of the microbatch that failed; raises, chained to ``error``, where the batch cannot
        be redone exactly (or split further)."""
        where = f"training batch {batch_idx} (epoch {trainer.current_epoch}, global step {trainer.global_step})"
        if phase == "backward" and all_reduces and trainer.world_size > 1:
            raise RuntimeError(
                f"AutoMicrobatch: {where} ran out of memory in the backward that all-reduces the gradients over "
                f"{trainer.world_size} processes; the other processes have exchanged part of them, so the step cannot "
                "be redone. Start split: AutoMicrobatch(microbatches=2) (or more), or a smaller batch_size."
            ) from error
        broadcasts = getattr(trainer.model, "will_sync_module_buffers", None)  # DDP's, per synchronizing forward
        if phase == "forward" and trainer.world_size > 1 and callable(broadcasts) and broadcasts():
            raise RuntimeError(
                f"AutoMicrobatch: {where} ran out of memory in a forward that had broadcast the module's buffers to "
                f"the other processes (DDP does so at each forward that follows a synchronizing one); a retry would "
                "broadcast them again, and the processes' collectives would fall out of step. Start split: "
                "AutoMicrobatch(microbatches=2) (or more), or a smaller batch_size."
            ) from error
        if phase == "backward" and not starts_window:
            raise RuntimeError(
                f"AutoMicrobatch: {where} ran out of memory in the backward, inside an accumulation window "
                f"(accumulate_grad_batches={trainer.accumulate_grad_batches}): the gradients of the window's earlier "
                "batches now hold part of this batch's, and cannot be told apart, so the batch cannot be redone "
                "exactly. Start split: AutoMicrobatch(microbatches=2) (or more), or a smaller batch_size."
            ) from error
        try:
            size = batch_size_of(piece)
            slice_batch(piece, 0, size, size)  # every part of it can be split
        except ValueError as unsplittable:
            raise MisconfigurationException(
                f"AutoMicrobatch: {where} ran out of memory and cannot be split: {unsplittable}") from error
        if size <= 1:
            raise torch.OutOfMemoryError(
                f"AutoMicrobatch: {where} ran out of memory in the {phase} even as microbatches of one sample: the "
                f"model does not fit at all. Make it smaller (GradientCheckpointing, AMP, FSDP). The error: {error}"
            ) from error
        return size

    def _say(self, trainer: Trainer, batch_idx: int, count: int, phase: str, total: int | None) -> None:
        self.microbatches = count
        self.splits.append({"global_step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                            "microbatches": count, "phase": phase})
        rank = f"rank {trainer.global_rank}: " if trainer.world_size > 1 else ""
        samples = f" of up to {math.ceil(total / count)} samples" if total else ""
        print(f"AutoMicrobatch: {rank}training batch {batch_idx} (epoch {trainer.current_epoch}, global step "
              f"{trainer.global_step}) ran out of memory in the {phase}; it and the batches after it run as {count} "
              f"microbatches{samples}, gradients accumulated within the step (the same update).",
              file=sys.stderr, flush=True)

    # --- what the report and checkpoints keep --------------------------------------------
    def performance_facts(self) -> dict[str, Any]:
        if not self.splits:
            return {}
        return {"microbatches": (self.microbatches, self.splits[0]["global_step"])}

    def state_dict(self) -> dict[str, Any]:
        return {"microbatches": self.microbatches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.microbatches = max(self.microbatches, int(state_dict.get("microbatches", 1)))


def _free_memory(device: torch.device) -> None:
    gc.collect()  # reference cycles that hold activations of the failed attempt
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- self.log while a batch runs as microbatches ------------------------------------------------
class SplitLogs:
    """Stands in for the training metrics (``trainer.metrics.current``, where ``self.log`` writes)
    while one batch runs: each microbatch's calls are kept apart, then each metric is logged once
    with the batch's value (:meth:`commit`). A microbatch that ran out of memory is dropped whole."""

    step_only: frozenset[str] = frozenset()  # self.log's per-step shortcut is off: every call is kept apart

    def __init__(self, stage: Any) -> None:
        self.stage = stage  # the training StageMetrics (trainer/stage_metrics.py)
        self.pieces: list[tuple[float, list[tuple[str, Any, tuple]]]] = []  # (share, [(name, value, settings)])

    def log(self, name: str, value: Any, *settings: Any) -> None:
        self.pieces[-1][1].append((name, value, settings))

    def commit(self) -> None:
        if len(self.pieces) == 1:  # not split: the calls as they were made
            for name, value, settings in self.pieces[0][1]:
                self.stage.log(name, value, *settings)
            return
        merged: dict[tuple[str, int], list[tuple[float, Any, tuple]]] = {}  # (name, n-th call in a piece)
        for share, calls in self.pieces:
            seen: dict[str, int] = {}
            for name, value, settings in calls:
                seen[name] = seen.get(name, -1) + 1
                merged.setdefault((name, seen[name]), []).append((share, value, settings))
        for (name, _), calls in merged.items():
            settings = list(calls[0][2])
            spec = self.stage.specs.get(name)  # the first call ever fixed how it reduces
            reduce_fx = spec.reduce_fx if spec is not None else _reduce_name(settings[4])
            sizes = [call[2][8] for call in calls if call[2][8] is not None]
            settings[8] = sum(sizes) if sizes else None
            self.stage.log(name, combine([(share, value) for share, value, _ in calls], reduce_fx), *settings)


def _reduce_name(reduce_fx: Any) -> Any:
    names = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", sum: "sum", max: "max",
             min: "min"}
    return names.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx


def combine(values: list[tuple[float, Any]], reduce_fx: Any) -> Any:
    """The batch's value of a metric from its microbatches' ``(share, value)``, without a host sync;
    anything but numbers and tensors (a metric object) is the last microbatch's."""
    if not all(isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) for _, v in values):
        return values[-1][1]
    plain = [v.detach() if isinstance(v, torch.Tensor) else v for _, v in values]
    if reduce_fx == "sum":
        return sum(plain[1:], plain[0])
    if reduce_fx in ("max", "min"):
        pick = torch.maximum if reduce_fx == "max" else torch.minimum
        result = torch.as_tensor(plain[0])
        for value in plain[1:]:
            result = pick(result, torch.as_tensor(value, device=result.device))
        return result
    shares = sum(share for share, _ in values)  # below 1 when a microbatch did not log it
    return sum(share / shares * value for (share, _), value in zip(values, plain))


# --- splitting a batch ---------------------------------------------------------------------------
def batch_size_of(batch: Any) -> int:
    """The first size of the batch's tensors, which all must share it; a clear error otherwise."""
    sizes: set[int] = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() > 0:
                sizes.add(value.shape[0])
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))

    visit(batch)
    if not sizes:
        raise MisconfigurationException(
            f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension to split along. "
            "Yield tensors (in tuples, lists, dicts, namedtuples or dataclasses).")
    if len(sizes) > 1:
        raise MisconfigurationException(
            f"its tensors have different first sizes ({sorted(sizes)}), so there is no one batch "
            "dimension to split along. Keep per-sample data in tensors whose first dimension is the "
            "batch (pad variable-size items), or drop AutoMicrobatch.")
    return sizes.pop()


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples ``start:stop`` of a batch of ``size``: tensors along dim 0, lists of strings or numbers
    with one item per sample likewise, containers rebuilt as ``strategies/transfer.py`` walks them."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, _PLAIN):
        return batch
    if isinstance(batch, (list, tuple)):
        if len(batch) == size and batch and all(isinstance(item, _PLAIN) for item in batch):
            return type(batch)(batch[start:stop]) if not hasattr(batch, "_fields") else batch
        items = [slice_batch(item, start, stop, size) for item in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, Mapping):
        return rebuild_mapping(batch, {key: slice_batch(value, start, stop, size) for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        rebuilt = copy.copy(batch)
        for field in dataclasses.fields(batch):
            object.__setattr__(rebuilt, field.name, slice_batch(getattr(batch, field.name), start, stop, size))
        return rebuilt
    raise MisconfigurationException(
        f"it holds a {type(batch).__name__}, which AutoMicrobatch cannot split into samples. Yield "
        "tensors, lists of strings or numbers, in tuples, lists, dicts, namedtuples or dataclasses.")
