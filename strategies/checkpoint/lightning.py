"""Lightning's checkpoint layout, both ways: the keys Cadence writes so that tools that read
Lightning checkpoints read Cadence's, and a checkpoint Lightning wrote read as a Cadence one.

Lightning 2.6 writes ``epoch``, ``global_step``, ``pytorch-lightning_version``, ``state_dict``,
``loops`` (progress counters of its fit, validate, test and predict loops), ``callbacks``,
``optimizer_states``, ``lr_schedulers``, ``hyper_parameters`` and ``hparams_name``
(``CheckpointConnector.dump_checkpoint``). Cadence's checkpoints hold the same keys with the same
meaning (``optimizer.state_dict()``, ``scheduler.state_dict()``, callbacks by Lightning's state
keys), plus what Cadence needs to continue exactly (every rank's RNG states, the data position).
Its ``loops`` holds Cadence's counters next to Lightning's ``fit_loop`` progress
(:func:`lightning_loops`), so Lightning's own ``fit(ckpt_path=...)`` finds the epoch and step too.

``pytorch-lightning_version`` names the Lightning release whose layout Cadence follows
(:data:`LIGHTNING_LAYOUT_VERSION`): Lightning's loaders require the key and upgrade checkpoints
older than 2.0 by it, so it must be a Lightning release, not Cadence's version (that is in
``versions["cadence"]``).

A checkpoint written by Lightning (:func:`is_lightning_checkpoint`: it has the version key and no
Cadence ``format``) is translated on reading (:func:`from_lightning`): the loop position comes
from its ``fit_loop`` progress, the AMP scaler from its precision plugin's state; it holds no RNG
states, so ``rng`` is None and the resumed run says once that the data order and random draws do
not continue exactly.
"""

from __future__ import annotations

from typing import Any

#: The Lightning release whose checkpoint layout Cadence writes (checked against Lightning 2.6.6).
LIGHTNING_LAYOUT_VERSION = "2.6.6"
VERSION_KEY = "pytorch-lightning_version"
#: Where Lightning keeps the GradScaler's state (its MixedPrecision plugin), and Cadence (the AMP callback).
_LIGHTNING_SCALER_KEY, _CADENCE_AMP_KEY = "MixedPrecision", "AMP"


def _tracker(count: int, *fields: str, completed: int | None = None) -> dict[str, int]:
    return {**{field: count for field in ("ready", *fields)}, "completed": count if completed is None else completed}


def _progress(current: int, total: int, *fields: str, pending: int = 0) -> dict[str, dict[str, int]]:
    """A Lightning progress counter; ``pending``: how many of the counted are not yet completed."""
    return {"total": _tracker(total, *fields, completed=total - pending),
            "current": _tracker(current, *fields, completed=current - pending)}


def lightning_loops(epoch: int, batches_done: int, global_step: int, batches_seen: int) -> dict[str, Any]:
    """Lightning's ``loops`` entry for a run at ``epoch`` with ``batches_done`` of its batches
    trained and ``global_step`` optimizer steps taken (``batches_seen`` training batches in all), as
    Lightning writes it at the same point.

    Between epochs (``batches_done == 0``) every counter is complete: Lightning starts epoch
    ``epoch``. Mid-epoch, the epoch is started but not processed and the last batch is processed
    but not completed, as in a checkpoint Lightning saves in ``on_train_batch_end``: Lightning
    completes that batch and goes on with the next."""
    mid_epoch = 1 if batches_done else 0
    epoch_progress = _progress(epoch, epoch, "started", "processed")
    for counters in epoch_progress.values():
        counters["ready"] = counters["started"] = epoch + mid_epoch
    steps = _progress(global_step, global_step)
    fit_loop = {
        "state_dict": {},
        "epoch_progress": epoch_progress,
        "epoch_loop.state_dict": {"_batches_that_stepped": batches_seen - mid_epoch},
        "epoch_loop.batch_progress": {**_progress(batches_done, batches_seen, "started", "processed", pending=mid_epoch),
                                      "is_last_batch": False},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {"step": steps, "zero_grad": _progress(global_step, global_step, "started")}},
        "epoch_loop.manual_optimization.optim_step_progress": steps,
    }
    evaluation = {"state_dict": {}, "batch_progress": _progress(0, 0, "started", "processed")}
    return {"fit_loop": fit_loop, "validate_loop": evaluation, "test_loop": evaluation, "predict_loop": evaluation}


def lightning_keys(epoch: int, global_step: int, hparams: dict[str, Any],
                   hparams_name: str | None = "kwargs") -> dict[str, Any]:
    """The top-level keys Lightning's checkpoints have besides those Cadence writes anyway;
    ``hparams_name``: the ``__init__`` argument one dict or Namespace of hyperparameters came from
    (``"kwargs"``: several arguments), which loading passes them back as."""
    keys = {"epoch": epoch, "global_step": global_step, VERSION_KEY: LIGHTNING_LAYOUT_VERSION}
    if hparams:
        keys["hparams_name"] = hparams_name
    return keys


def is_lightning_checkpoint(state: Any) -> bool:
    """True for a checkpoint Lightning wrote (it has Lightning's version key, not Cadence's format)."""
    return isinstance(state, dict) and VERSION_KEY in state and "format" not in state


def from_lightning(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint Lightning wrote, in Cadence's layout (the same dict, completed): the loop
    position from its ``fit_loop`` progress, its AMP scaler as the AMP callback's state, and
    ``rng`` None (Lightning keeps no RNG states). A weights-only one (no optimizer states) is left
    without the training state, so that resuming from it is refused as for Cadence's."""
    loops = state.get("loops")
    if isinstance(loops, dict) and "fit_loop" in loops and "optimizer_states" in state:
        state["loops"] = {**loops, **_position(loops["fit_loop"], int(state.get("global_step", 0)))}
        state.setdefault("rng", None)
        state.setdefault("callbacks", {})
        if _LIGHTNING_SCALER_KEY in state:
            state["callbacks"].setdefault(_CADENCE_AMP_KEY, {"scaler": state[_LIGHTNING_SCALER_KEY]})
    return state


def _position(fit_loop: dict[str, Any], global_step: int) -> dict[str, int]:
    """Cadence's loop counters from Lightning's ``fit_loop`` progress (see ``lightning_loops``)."""
    epochs = fit_loop.get("epoch_progress", {}).get("current", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    completed, processed, started = (int(epochs.get(key, 0)) for key in ("completed", "processed", "started"))
    if started > completed and (processed > completed or batches.get("is_last_batch")):
        # Saved after the epoch's last batch (in its end hooks, after its validation): Lightning steps the
        # epoch-interval schedulers with that batch, so the epoch is done but for hooks that already ran.
        epoch, batches_done = completed + 1, 0
    elif started > completed:  # saved mid-epoch: its batches whose training step ran are done
        epoch, batches_done = completed, int(batches.get("current", {}).get("processed", 0))
    else:  # between epochs
        epoch, batches_done = completed, 0
    seen = batches.get("total", {}).get("processed")  # training steps run (Lightning's log step lags it by one)
    if seen is None:
        seen = fit_loop.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", global_step)
    return {"epoch": epoch, "batches_done": batches_done, "global_step": global_step, "train_batches_seen": int(seen)}
