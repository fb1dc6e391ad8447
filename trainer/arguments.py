"""Checking the Trainer's arguments before anything starts, and what a training step returned.

Every check raises a built-in exception that names the argument, the value given and what would
work (STYLE.md, "Errors teach").
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import torch

from trainer.data import check_limit
from trainer.guards import check_nonfinite_mode
from callbacks.console import MisconfigurationException, warn


class UndefinedHookError(MisconfigurationException, NotImplementedError):
    """A hook the stage needs is None: Lightning's MisconfigurationException, a NotImplementedError as Cadence's was."""


class ArgumentTypeError(MisconfigurationException, TypeError):
    """A Trainer argument of the wrong type: Lightning raises TypeError there, Cadence's checks ValueError."""


def check_positive_int(value: Any, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisconfigurationException(
            f"Trainer({name}={value!r}): use an int >= 1{' or None' if allow_none else ''} "
            f"(`{name}` should be an integer.)")


def check_count(value: Any, name: str) -> None:
    """None or an int >= 0 (``min_epochs``, ``min_steps``, ``reload_dataloaders_every_n_epochs``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise MisconfigurationException(
            f"Trainer({name}={value!r}): use an int >= 0{'' if name.startswith('reload') else ' or None'} "
            f"(`{name}` should be an int >= 0, got {value!r}).")


def check_trainer_arguments(
    *, max_epochs: Any, max_steps: Any, accumulate_grad_batches: Any, log_every_n_steps: Any,
    check_val_every_n_epoch: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any,
    val_check_interval: Any, limits: dict[str, Any], num_sanity_val_steps: Any, on_nonfinite_loss: Any,
    min_epochs: Any = None, min_steps: Any = None, reload_dataloaders_every_n_epochs: Any = 0,
    flags: dict[str, Any] | None = None,
) -> None:
    """Raise a ValueError for the first ``Trainer(...)`` argument that cannot work.

    ``flags`` are the boolean arguments by name (``inference_mode``, ``sync_batchnorm``, ...).
    """
    if max_epochs is not None and (isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < -1):
        raise MisconfigurationException(
            f"Trainer(max_epochs={max_epochs!r}): `max_epochs` must be a non-negative integer or -1 (no "
            "epoch limit), or None (1000 epochs, or no limit with max_steps). 0 trains nothing.")
    for name, value in (("min_epochs", min_epochs), ("min_steps", min_steps),
                        ("reload_dataloaders_every_n_epochs", reload_dataloaders_every_n_epochs)):
        check_count(value, name)
    for name, value in (flags or {}).items():
        if not isinstance(value, bool) and not (name == "benchmark" and value is None):
            raise MisconfigurationException(
                f"Trainer({name}={value!r}): use True or False{' (or None)' if name == 'benchmark' else ''}.")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < -1:
        raise MisconfigurationException(
            f"Trainer(max_steps={max_steps!r}): `max_steps` must be a non-negative integer or -1 (no "
            "limit). 0 trains nothing.")
    check_positive_int(accumulate_grad_batches, "accumulate_grad_batches")
    check_positive_int(log_every_n_steps, "log_every_n_steps")
    check_positive_int(check_val_every_n_epoch, "check_val_every_n_epoch", allow_none=True)
    if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool)
                                          or not isinstance(gradient_clip_val, (int, float))):
        raise ArgumentTypeError(f"`gradient_clip_val` should be an int or a float. Got {gradient_clip_val}. "
                                f"Trainer(gradient_clip_val={gradient_clip_val!r}): use a positive number, or 0 or "
                                "None to clip nothing.")
    if gradient_clip_val is not None and gradient_clip_val < 0:
        raise MisconfigurationException(
            f"Trainer(gradient_clip_val={gradient_clip_val!r}): use a positive number or None "
            "(0 clips nothing, as None).")
    if gradient_clip_algorithm is not None and str(gradient_clip_algorithm).lower() not in ("norm", "value"):
        raise MisconfigurationException(
            f'Trainer(gradient_clip_algorithm="{gradient_clip_algorithm}"): use "norm" or "value" '
            f"(`gradient_clip_algorithm` {gradient_clip_algorithm} is invalid).")
    if isinstance(val_check_interval, (str, dict, datetime.timedelta)):
        raise MisconfigurationException(
            f"Trainer(val_check_interval={val_check_interval!r}): Lightning's time-based validation (a "
            "'DD:HH:MM:SS' string, a datetime.timedelta or a dict of timedelta arguments) is not supported "
            "by Cadence, which validates by batches: use an int >= 1 (every that many training batches) "
            "or a float in (0.0, 1.0] (a share of each epoch).")
    if (isinstance(val_check_interval, bool) or not isinstance(val_check_interval, (int, float))
            or val_check_interval <= 0 or (isinstance(val_check_interval, float) and val_check_interval > 1.0)):
        raise MisconfigurationException(
            f"Trainer(val_check_interval={val_check_interval!r}): you passed invalid value {val_check_interval!r}; "
            "use a float in (0.0, 1.0] (a share of the epoch) or an int >= 1 (a number of training batches)."
        )
    if check_val_every_n_epoch is None and isinstance(val_check_interval, float):
        raise MisconfigurationException(
            f"Trainer(check_val_every_n_epoch=None, val_check_interval={val_check_interval}): `val_check_interval` should "
            "be an integer or a time-based duration (str 'DD:HH:MM:SS', datetime.timedelta, or dict kwargs for timedelta) "
            "when `check_val_every_n_epoch=None`. Cadence has no time-based validation: use an int val_check_interval "
            "(every N training batches)."
        )
    for stage, value in limits.items():
        check_limit(value, "limit_val_batches" if stage == "validate" else f"limit_{stage}_batches")
    if isinstance(num_sanity_val_steps, bool) or not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
        raise MisconfigurationException(
            f"Trainer(num_sanity_val_steps={num_sanity_val_steps!r}): use an int >= 0, or -1 for all.")
    check_nonfinite_mode(on_nonfinite_loss)


def loss_of(outputs: Any, batch_idx: int) -> torch.Tensor:
    """The loss in what training_step returned (not None: see :func:`skipped_batch`), checked without
    reading its value."""
    if isinstance(outputs, torch.Tensor):  # first: a Mapping check is an ABC's, ~1k instructions a step
        loss = outputs
    else:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs  # any mapping, as in Lightning
    if not isinstance(loss, torch.Tensor):
        mapping = isinstance(outputs, Mapping)
        what = "a dict without a 'loss' key" if mapping else type(loss).__name__
        rule = ("when `training_step` returns a dict, the 'loss' key needs to be present" if mapping else
                "`training_step` must return a Tensor, a dict, or None (where the step will be skipped)")
        raise RuntimeError(
            f"training_step returned {what} at batch {batch_idx}. Return the loss tensor, or a dict "
            f'with a "loss" key ({rule}).'
        )
    if loss.dim() != 0:
        raise RuntimeError(
            f"training_step returned a loss of shape {tuple(loss.shape)} at batch {batch_idx}; the "
            "loss must be a scalar. Reduce it (loss.mean()) before returning."
        )
    return loss


def manual_step_output(training_step: Any, batch: Any, batch_idx: int) -> Any:
    """``training_step(batch, batch_idx)`` under manual optimization, whose return must be a tensor, a
    mapping or None, as in Lightning (a number would be accepted and mean nothing)."""
    outputs = training_step(batch, batch_idx)
    if outputs is not None and not isinstance(outputs, (torch.Tensor, Mapping)):
        raise RuntimeError(
            f"training_step returned {type(outputs).__name__} at batch {batch_idx}. In manual optimization, "
            "`training_step` must either return a Tensor or have no return (a dict is passed on to "
            "on_train_batch_end too); step the optimizers in it with self.manual_backward(loss) and opt.step().")
    return outputs


def batch_end_outputs(outputs: Any, accumulate_grad_batches: int) -> dict[str, Any]:
    """What ``on_train_batch_end`` receives, as in Lightning: a dict whose ``"loss"`` is detached (so
    no hook keeps the step's graph alive) and divided by ``accumulate_grad_batches`` as backward saw
    it, with the other keys ``training_step`` returned; ``{}`` for None (manual optimization)."""
    if outputs is None:
        return {}
    extra = dict(outputs) if isinstance(outputs, Mapping) else {"loss": outputs}
    loss = extra.get("loss")
    if isinstance(loss, torch.Tensor):
        extra["loss"] = (loss / accumulate_grad_batches if accumulate_grad_batches > 1 else loss).detach()
    return extra


def skipped_batch(world_size: int, batch_idx: int) -> None:
    """training_step returned None: as in Lightning, the batch gets no backward (the optimizer step
    at the end of its accumulation window still counts in ``global_step``). Said once; refused with
    several processes, where the other ranks would wait for this one's gradients forever."""
    if world_size > 1:
        raise RuntimeError(
            f"training_step returned None at batch {batch_idx} with {world_size} processes. Skipping a batch is "
            "not supported in distributed training: the other processes would wait for this one's gradients. "
            "Return the loss (multiplied by 0 to have no effect) on every process."
        )
    warn("training_step returned None: the batch is skipped (no backward). If this was on purpose, ignore this "
              'warning; otherwise return the loss tensor, or a dict with a "loss" key.')


def none_batch() -> None:
    """The training loader yielded None (a collate_fn that drops a bad batch): as in Lightning, that batch runs
    no hooks and no step, and on_train_batch_end gets outputs None (Python shows the warning once per line)."""
    warn("train_dataloader yielded None. If this was on purpose, ignore this warning: the batch is skipped "
         "(no on_train_batch_start, no training_step; on_train_batch_end gets outputs=None).")


def loss_without_grad(batch_idx: int) -> RuntimeError:
    """The error for a loss that cannot be backpropagated (``Trainer.run_backward``)."""
    return RuntimeError(
        f"The loss at batch {batch_idx} does not require grad: every parameter is frozen "
        "(requires_grad=False) or the loss was detached. Unfreeze parameters or return the "
        "loss tensor itself, not loss.item() or loss.detach()."
    )


def no_training_batches(max_epochs: int | None, epoch: int) -> None:
    """A training epoch got no batch at all (a stream that ran dry): as in Lightning the epoch ends and
    the next begins, with a warning; an error when no ``max_epochs`` bounds the run, which would then
    go on forever."""
    if max_epochs in (None, -1):
        raise RuntimeError("The training DataLoader yielded no batches, and no max_epochs bounds the run, so it would "
                           "never end. Check that the dataset is not empty and that batch_size <= len(dataset) when "
                           "drop_last=True, or set max_epochs.")
    warn(f"The training DataLoader yielded no batches in epoch {epoch}; the epoch ends without a step.")


def require_training_module(module: Any, stage: str) -> None:
    from trainer.module import TrainingModule

    if isinstance(getattr(module, "_orig_mod", None), TrainingModule):  # torch.compile(model): an OptimizedModule
        raise TypeError(
            f"Trainer.{stage} got torch.compile(model) (an OptimizedModule). Pass the module itself and add "
            "callbacks.Compile(...) with the same arguments (mode=, backend=, fullgraph=, dynamic=): it compiles "
            "the module's forward in place, falls back to eager with a warning, and its checkpoints keep the "
            "module's own keys (no `_orig_mod.` prefix)."
        )
    if not isinstance(module, TrainingModule):
        raise TypeError(
            f"Trainer.{stage} needs a trainer.TrainingModule; got {type(module).__name__} (`model` must be a "
            f"`LightningModule`, got `{type(module).__name__}`). Subclass TrainingModule and define training_step "
            "and configure_optimizers."
        )
    predicts_with_forward = type(module).predict_step is TrainingModule.predict_step
    for hook in NEEDED.get(stage, ()) + (("forward",) if stage == "predict" and predicts_with_forward else ()):
        if getattr(module, hook) is None:  # model.training_step = None: Lightning's words first
            lightnings = {"predict_step": "`predict_step` cannot be None to run `Trainer.predict`",
                          "forward": "`Trainer.predict` requires `forward` method to run"}.get(
                hook, f"No `{hook}()` method defined" + ("" if stage == "fit" else f" to run `Trainer.{stage}`"))
            raise UndefinedHookError(f"{lightnings}. {type(module).__name__}.{hook} is None: {stage} needs it; define "
                                      f"{hook} in the module's class, or do not set it to None.")


#: The module's methods each stage calls (a method set to None on the instance is refused when the stage starts).
NEEDED = {"fit": ("training_step", "configure_optimizers"), "validate": ("validation_step",), "test": ("test_step",),
          "predict": ("predict_step",)}
