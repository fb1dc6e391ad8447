"""LearningRateFinder: Lightning's learning-rate range test, and :class:`LRFinder`, its result.

At the start of fit the finder trains ``num_training_steps`` optimizer steps with the learning rate
rising from ``min_lr`` to ``max_lr`` (exponentially or linearly), records the smoothed loss of
each step, stops when the loss diverges (``early_stop_threshold`` times its best), and suggests
the learning rate where the loss falls fastest. The steps run in ``Trainer.run_trial``, which
puts the weights, optimizer, counters and RNG states back afterwards: the fit then trains as if
the finder had not run, with the suggested learning rate. ``Tuner(trainer).lr_find(model)`` runs
the same search without the fit.

Where Cadence differs from Lightning 2.6 on purpose: the search runs ``num_training_steps``
steps over as many epochs as that takes (Lightning stops at ``max_epochs``, then says the loss
diverged); the recorded loss is the one ``training_step`` returned (Lightning's is divided by
``accumulate_grad_batches``: same suggestion); and with ``update_attr`` the schedulers attached
to the optimizer continue from the suggested rate (their ``base_lrs``), as if
``configure_optimizers`` had used it.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from callbacks.search import SearchProgress, has_attribute, set_attribute

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class LRFinder:
    """What a learning-rate search found: ``results`` (``{"lr": [...], "loss": [...]}``, one entry
    per step), :meth:`suggestion`, :meth:`plot` (a matplotlib figure) and :meth:`table` (the same,
    as text).

    Args:
        mode: ``"exponential"`` or ``"linear"``: how the learning rate rose.
        lr_min, lr_max: where it started and where it would have ended.
        num_training: the number of steps asked for.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        if mode not in LearningRateFinder.SUPPORTED_MODES:
            raise MisconfigurationException(
                f"LRFinder(mode={mode!r}): use one of {LearningRateFinder.SUPPORTED_MODES}.")
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, list[float]] = {}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the loss falls fastest (the most negative slope of the loss over
        the learning rate), leaving out the first ``skip_begin`` and last ``skip_end`` points and
        non-finite losses; None, with a message, when fewer than two points remain."""
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            print("Failed to compute suggestion for learning rate because there are not enough points. Increase the "
                  "loop iteration limits or the size of your dataset/dataloader.", file=sys.stderr)
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]  # d loss / d lr, at the points' own spacing
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[int(torch.argmin(gradients))])
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (a log axis in exponential mode) as a matplotlib figure,
        with the suggestion marked in red when ``suggest``; shown when ``show``. Without matplotlib
        (not a dependency of Cadence) it prints :meth:`table` instead and returns None."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn("LRFinder.plot draws with matplotlib, which is not installed: here are the numbers "
                          "instead (pip install matplotlib for the figure).", stacklevel=2)
            print(self.table(suggest=suggest))
            return None
        figure = None
        if ax is None:
            figure, ax = plt.subplots()
        else:
            figure = ax.figure
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx:
            index = self._optimal_idx
            ax.plot(self.results["lr"][index], self.results["loss"][index], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return figure

    def table(self, suggest: bool = True, rows: int = 25) -> str:
        """The curve as text: about ``rows`` of the points (learning rate, loss, and a bar as long
        as the loss), the suggested point marked when ``suggest``."""
        lrs, losses = self.results.get("lr", []), self.results.get("loss", [])
        if not lrs:
            return "LRFinder: no results."
        marked = self.suggestion() if suggest else None
        every = max(1, math.ceil(len(lrs) / rows))
        indices = sorted(set(range(0, len(lrs), every)) | ({self._optimal_idx} if marked is not None else set()))
        finite = [loss for loss in losses if math.isfinite(loss)]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        lines = [f"{'lr':>10}  {'loss':>10}"]
        for index in indices:
            loss = losses[index]
            length = round(30 * (loss - low) / (high - low)) + 1 if math.isfinite(loss) and high > low else 1
            bar = "#" * length if math.isfinite(loss) else "(not finite)"
            note = "  <- suggestion" if marked is not None and index == self._optimal_idx else ""
            lines.append(f"{lrs[index]:>10.3e}  {loss:>10.4g}  {bar}{note}")
        return "\n".join(lines)


class LearningRateFinder(Callback):
    """At the start of fit, search a good initial learning rate (Lightning's range test) and set it.

    Args:
        min_lr: the learning rate of the first step.
        max_lr: the learning rate the last step would reach.
        num_training_steps: the number of learning rates (optimizer steps) to try.
        mode: ``"exponential"`` (each step multiplies the rate) or ``"linear"``.
        early_stop_threshold: stop once the smoothed loss exceeds this many times its best; None
            runs every step.
        update_attr: set the suggestion as the module's ``lr`` or ``learning_rate`` (attribute or
            hparams key, or the DataModule's) and as the optimizer's learning rate.
        attr_name: the attribute to set instead of ``lr``/``learning_rate``.

    After the search, ``optimal_lr`` holds the :class:`LRFinder` (its results and suggestion).
    Override ``on_fit_start`` and call ``self.lr_find(trainer, module)`` from another hook
    (``on_train_epoch_start`` at chosen epochs) to search again later in a fit.

    Example::

        trainer = Trainer(callbacks=[LearningRateFinder()])
        trainer.fit(model)            # searches, then trains with model.lr = the suggestion
    """

    SUPPORTED_MODES = ("linear", "exponential")

    def __init__(self, min_lr: float = 1e-8, max_lr: float = 1, num_training_steps: int = 100,
                 mode: str = "exponential", early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                 attr_name: str = "") -> None:
        mode = mode.lower() if isinstance(mode, str) else mode
        if mode not in self.SUPPORTED_MODES:
            raise MisconfigurationException(
                f"LearningRateFinder(mode={mode!r}): `mode` should be either of {self.SUPPORTED_MODES}.")
        if not (isinstance(num_training_steps, int) and num_training_steps >= 1):
            raise MisconfigurationException(
                f"LearningRateFinder(num_training_steps={num_training_steps!r}): use an int >= 1.")
        if not (min_lr > 0 and max_lr > 0):
            raise MisconfigurationException(
                f"LearningRateFinder(min_lr={min_lr}, max_lr={max_lr}): learning rates must be > 0.")
        self._min_lr, self._max_lr, self._num_training_steps = min_lr, max_lr, num_training_steps
        self._mode, self._early_stop_threshold = mode, early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        self.optimal_lr: LRFinder | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        self.lr_find(trainer, pl_module)

    def lr_find(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        """Search now (from a hook of a running fit); see the class docstring."""
        if trainer.fast_dev_run:
            warnings.warn("Skipping learning rate finder since `fast_dev_run` is enabled.", stacklevel=2)
            return
        attr_name = lr_attribute(pl_module, self._attr_name) if self._update_attr else ""
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"`model.configure_optimizers()` returned {len(trainer.optimizers)} optimizers, but the "
                "learning rate finder only works with single optimizer.")
        finder = LRFinder(self._mode, self._min_lr, self._max_lr, self._num_training_steps)
        recorder = _LRRecorder(self._num_training_steps, self._early_stop_threshold,
                               SearchProgress(trainer, "Finding best initial lr", self._num_training_steps),
                               start_step=trainer.global_step)
        try:
            trainer.run_trial(self._num_training_steps, callbacks=[recorder], schedulers=self._sweep)
        finally:
            recorder.progress.close()
        if recorder.diverged:
            recorder.progress.say(f"LR finder stopped early after {len(recorder.losses)} steps: the smoothed loss "
                                  f"rose above early_stop_threshold={self._early_stop_threshold} times its best.")
        finder.results = trainer.strategy.broadcast_object({"lr": recorder.lrs, "loss": recorder.losses})
        self.optimal_lr = finder
        if attr_name:
            lr = finder.suggestion()
            if lr is not None:
                set_attribute(pl_module, attr_name, lr)
                apply_learning_rate(trainer, lr)
                recorder.progress.say(f"Learning rate set to {lr}")

    def _sweep(self, optimizers: list[torch.optim.Optimizer]) -> list[LRScheduler]:
        """The trial's scheduler: every group starts at min_lr and rises to max_lr over the steps."""
        [optimizer] = optimizers
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self._min_lr
        sweep = _LinearLR if self._mode == "linear" else _ExponentialLR
        return [sweep(optimizer, self._max_lr, self._num_training_steps)]

    # The results travel back from spawned processes (and into checkpoints) as plain data.
    def state_dict(self) -> dict[str, Any]:
        finder = self.optimal_lr
        if finder is None:
            return {}
        return {"mode": finder.mode, "lr_min": finder.lr_min, "lr_max": finder.lr_max,
                "num_training": finder.num_training, "results": finder.results}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.optimal_lr = LRFinder(state_dict["mode"], state_dict["lr_min"], state_dict["lr_max"],
                                       state_dict["num_training"])
            self.optimal_lr.results = state_dict["results"]


def lr_attribute(module: TrainingModule, attr_name: str = "") -> str:
    """The name the found learning rate is written to: ``attr_name``, else ``lr`` or ``learning_rate``."""
    if attr_name:
        if not has_attribute(module, attr_name):
            raise AttributeError(f"The attribute name for the learning rate was set to {attr_name}, but could not find "
                                 "this as a field in `model` or `model.hparams`.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if has_attribute(module, name):
            return name
    raise AttributeError("When using the learning rate finder, either `model` or `model.hparams` should have one of "
                         "these fields: ('lr', 'learning_rate'). If your model has a different name for the learning "
                         "rate, set it with `.lr_find(attr_name=...)`.")


def apply_learning_rate(trainer: Trainer, lr: float) -> None:
    """Set ``lr`` in every param group of the Trainer's optimizers, and as the base of the
    schedulers that drive them, so that they continue from it."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
            if "initial_lr" in group:
                group["initial_lr"] = lr
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if hasattr(scheduler, "base_lrs") and any(scheduler.optimizer is o for o in trainer.optimizers):
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)


class _LRRecorder(Callback):
    """The trial's callback: the learning rate each optimizer step uses and the smoothed loss it
    gave; sets ``trainer.should_stop`` when the loss diverges. Reads one loss a step to the host
    (a search, not the training run)."""

    def __init__(self, num_training: int, early_stop_threshold: float | None, progress: SearchProgress,
                 beta: float = 0.98, start_step: int = 0) -> None:
        self.num_training, self.early_stop_threshold, self.beta = num_training, early_stop_threshold, beta
        self.start_step = start_step  # the search's steps count from here (Lightning counts from the run's start)
        self.progress = progress
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0
        self.diverged = False

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return
        self.lrs.append(trainer.lr_scheduler_configs[0].scheduler.lr[0])

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches != 0:
            return
        if outputs is None or (isinstance(outputs, Mapping) and not outputs):
            self.losses.append(float("nan"))  # a skipped batch: not used for the suggestion
            return
        self.progress.update()
        loss = (outputs if isinstance(outputs, torch.Tensor) else outputs["loss"]).item()
        # The search's own step: Lightning uses global_step, so a search later in a run (its documented
        # FineTuneLearningRateFinder at a milestone epoch) compares with a best loss of 0 and stops at once.
        step = trainer.global_step - self.start_step
        # A running mean, corrected for its start at zero (as Adam's moments are).
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * loss
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        if self.early_stop_threshold is not None and step > 1 and smoothed > self.early_stop_threshold * self.best_loss:
            trainer.should_stop = self.diverged = True
        trainer.should_stop = trainer.strategy.broadcast_object(trainer.should_stop)  # every rank stops together
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)


class _RangeLR(LRScheduler):
    """Raises the learning rate from each group's base to ``end_lr`` over ``num_iter`` steps, by
    :meth:`at` (a fraction of the way)."""

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1) -> None:
        self.end_lr, self.num_iter = end_lr, num_iter
        super().__init__(optimizer, last_epoch)

    def at(self, base: float, fraction: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        fraction = (self.last_epoch + 1) / self.num_iter
        self._lr = [self.at(base, fraction) for base in self.base_lrs] if self.last_epoch > 0 else list(self.base_lrs)
        return self._lr

    @property
    def lr(self) -> list[float]:
        return self._lr


class _LinearLR(_RangeLR):
    """Linearly, as Lightning's ``_LinearLR``."""

    def at(self, base: float, fraction: float) -> float:
        return base + fraction * (self.end_lr - base)


class _ExponentialLR(_RangeLR):
    """Geometrically, as Lightning's ``_ExponentialLR``."""

    def at(self, base: float, fraction: float) -> float:
        return base * (self.end_lr / base) ** fraction
