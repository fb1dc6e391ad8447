"""ProgressBar: Lightning's TQDMProgressBar (tqdm bars for each stage), on rank zero only.

The bar shows the metrics of ``get_metrics`` (those logged with ``prog_bar=True``) as they stood
at the last log step; it never asks for a value itself, so it adds no host sync. When stderr is
not a terminal (CI, a log file, SLURM output) the bars are made but not drawn (their ``total``
and, at each stage's end, ``n`` still say where the run is), and one tidy line per epoch and per
validation is printed instead. ``refresh_rate=0`` turns the display off.

Subclass it as in Lightning: override ``init_train_tqdm`` (and ``init_sanity_tqdm``,
``init_validation_tqdm``, ``init_test_tqdm``, ``init_predict_tqdm``) to make the bars, or
``get_metrics`` to choose what they show; read ``train_progress_bar``, ``total_train_batches``, ...
"""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from callbacks.console import epoch_label, MisconfigurationException

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


def get_standard_metrics(trainer: Trainer) -> dict[str, int | str]:
    """Lightning's ``callbacks.progress.progress_bar.get_standard_metrics``: ``{"v_num": version}`` of
    the loggers (one logger's version; several's joined with ``_``, duplicates once; of a string its last
    4 places), ``{}`` without one. Lightning's bars show it; Cadence's do not, a subclass that adds it does.
    The CSVLogger that ``logger=True`` adds beside the TensorBoard one is not counted (Lightning has one)."""
    loggers = [logger for logger in trainer.loggers if not getattr(logger, "_beside_tensorboard", False)]
    if not loggers:
        return {}
    version = loggers[0].version if len(loggers) == 1 else "_".join(
        dict.fromkeys(str(logger.version) for logger in loggers))
    if version in ("", None):
        return {}
    return {"v_num": version[-4:] if isinstance(version, str) else version}


def _format(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                     for name, value in metrics.items())


class ProgressBar(Callback):
    """Progress bars on rank zero (Lightning's ``TQDMProgressBar``).

    Args:
        refresh_rate: redraw every this many batches; 0 turns the bars (and the lines) off. As in
            Lightning, the environment variable ``TQDM_MINITERS`` raises it to at least its value,
            and on Colab (``COLAB_GPU`` set) 1 becomes 20.
        process_position: where the bars go among other tqdm bars (several scripts at once).
        leave: keep each epoch's finished bar on screen (one bar per epoch) instead of one bar for
            the whole fit.

    Example::

        class NoValidationBar(ProgressBar):
            def init_validation_tqdm(self):
                bar = super().init_validation_tqdm()
                bar.disable = True
                return bar
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        for name, value in (("refresh_rate", refresh_rate), ("process_position", process_position)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MisconfigurationException(
                    f"ProgressBar({name}={value!r}): use an int >= 0"
                    + (" (0 turns the bars off)." if name == "refresh_rate" else "."))
        if not isinstance(leave, bool):
            raise MisconfigurationException(f"ProgressBar(leave={leave!r}): use True or False.")
        refresh_rate = _resolve_refresh_rate(refresh_rate)
        self._refresh_rate, self._process_position, self._leave = refresh_rate, process_position, leave
        self._enabled = True
        self.interactive = False  # stderr is a terminal: the bars are drawn
        self._trainer: Trainer | None = None
        self._train_progress_bar: Any = None
        self._val_progress_bar: Any = None
        self._test_progress_bar: Any = None
        self._predict_progress_bar: Any = None
        self._eval_batches = 0
        self._tqdm: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_train_progress_bar": None, "_val_progress_bar": None, "_test_progress_bar": None,
                "_predict_progress_bar": None, "_tqdm": None, "_trainer": None}  # bars hold streams and locks

    # --- what subclasses read -----------------------------------------------------------------
    refresh_rate = property(lambda self: self._refresh_rate)
    process_position = property(lambda self: self._process_position)
    is_enabled = property(lambda self: self._enabled and self._refresh_rate > 0)
    is_disabled = property(lambda self: not self.is_enabled)
    sanity_check_description = "Sanity Checking"
    train_description = "Training"
    validation_description = "Validation"
    test_description = "Testing"
    predict_description = "Predicting"

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise TypeError(f"{type(self).__name__}.trainer is set when a stage starts (setup); none has yet.")
        return self._trainer

    def _bar(name: str) -> property:  # noqa: N805 (a property factory, used in the class body)
        def get(self: ProgressBar) -> Any:
            bar = getattr(self, f"_{name}")
            if bar is None:
                raise TypeError(f"{type(self).__name__}.{name} is made when its stage starts; it has not been yet.")
            return bar

        def set_(self: ProgressBar, bar: Any) -> None:
            setattr(self, f"_{name}", bar)

        return property(get, set_)

    train_progress_bar = _bar("train_progress_bar")
    val_progress_bar = _bar("val_progress_bar")
    test_progress_bar = _bar("test_progress_bar")
    predict_progress_bar = _bar("predict_progress_bar")
    del _bar

    @property
    def total_train_batches(self) -> int | float:
        """This epoch's batches; as Lightning, with ``max_epochs=-1`` at most the steps ``max_steps`` leaves."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_training_batches

    @property
    def total_val_batches(self) -> int | float:
        """The batches of this validation pass over every loader (the sanity check's during it); as
        Lightning's, 0 in an epoch of ``fit`` that ``check_val_every_n_epoch`` leaves without validation."""
        trainer = self.trainer
        if trainer.sanity_checking:
            steps = math.inf if trainer.num_sanity_val_steps == -1 else trainer.num_sanity_val_steps
            return sum(min(steps, count) for count in trainer.num_val_batches)
        every = trainer.check_val_every_n_epoch
        if trainer.state.fn == "fit" and every is not None and (trainer.current_epoch + 1) % every:
            return 0
        return sum(trainer.num_val_batches)

    total_test_batches = property(lambda self: sum(self.trainer.num_test_batches))
    total_predict_batches = property(lambda self: sum(self.trainer.num_predict_batches))

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def get_metrics(self, trainer: Trainer, module: TrainingModule) -> dict[str, Any]:
        """What the bars show: the values logged with ``prog_bar=True`` (override to change it)."""
        return dict(trainer.progress_bar_metrics)

    # --- the bars (override to customize) --------------------------------------------------------
    def _make(self, description: str, position: int, leave: bool) -> Any:
        disable = self.is_disabled or not self.interactive
        return (_without_monitor(self._tqdm) if disable else self._tqdm)(
            desc=description, position=position, disable=disable, leave=leave, dynamic_ncols=True, file=sys.stderr,
            bar_format=self.BAR_FORMAT)

    def init_sanity_tqdm(self) -> Any:
        return self._make(self.sanity_check_description, 2 * self.process_position, leave=False)

    def init_train_tqdm(self) -> Any:
        return self._make(self.train_description, 2 * self.process_position, leave=True)

    def init_validation_tqdm(self) -> Any:
        under_fit = self.trainer.stage == "fit"  # below the training bar, which stays
        return self._make(self.validation_description, 2 * self.process_position + under_fit, leave=not under_fit)

    def init_test_tqdm(self) -> Any:
        return self._make(self.test_description, 2 * self.process_position, leave=True)

    def init_predict_tqdm(self) -> Any:
        return self._make(self.predict_description, 2 * self.process_position, leave=True)

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """``print`` that keeps a drawn bar whole (``self.print`` in a module comes here)."""
        made = any(bar is not None for bar in (self._train_progress_bar, self._val_progress_bar,
                                               self._test_progress_bar, self._predict_progress_bar))
        if made and self.is_enabled:  # through tqdm.write, as Lightning's (the same text when no bar is drawn)
            self._tqdm.write(sep.join(map(str, args)), **{k: v for k, v in kwargs.items() if k != "flush"})
        else:  # no bar (Lightning's would print nothing)
            print(*args, sep=sep, **kwargs)

    # --- hooks ----------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()
        self.interactive = sys.stderr.isatty()
        from tqdm.auto import tqdm  # loaded on first use: importing callbacks stays cheap

        self._tqdm = tqdm
        if type(self).on_train_batch_end is ProgressBar.on_train_batch_end and not (self.interactive and self._refresh_rate):
            # No bar is drawn per batch: as the base class's no-op, the hook leaves the loop's per-batch call
            # list (trainer/hooks.py), and with it the outputs dict built for batch-end hooks.
            self.on_train_batch_end = Callback.on_train_batch_end.__get__(self)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        vars(self).pop("on_train_batch_end", None)  # setup's per-stage choice

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.val_progress_bar = self.init_sanity_tqdm()
        self.val_progress_bar.total = _total(self.total_val_batches)
        self._eval_batches = 0

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self.val_progress_bar.close()

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()  # one bar for the whole fit (with leave, as Lightning's too)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._leave:  # a bar per epoch; the one before goes (on_train_start's: cleared, never having shown an epoch)
            previous, previous.leave = self.train_progress_bar, False
            previous.close()
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.reset(total=_total(self.total_train_batches))
        bar.set_description(epoch_label(trainer), refresh=False)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self._train_progress_bar
        if bar is None or bar.disable or not self._refresh_rate or (batch_idx + 1) % self._refresh_rate \
                and batch_idx + 1 != bar.total:
            return  # not drawn, or not this batch: this is all a batch pays
        bar.update(batch_idx + 1 - bar.n)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        bar = self._train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_postfix_str(_format(self.get_metrics(trainer, module)), refresh=False)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        bar = self.train_progress_bar
        shown = _format(self.get_metrics(trainer, module)) if self.is_enabled else ""
        bar.n = trainer.batch_idx + 1  # where the epoch ended, also when the bar is not drawn
        if not bar.disable:
            bar.set_postfix_str(shown, refresh=True)
        elif self.is_enabled and not self.interactive:
            print(f"{epoch_label(trainer)}: step {trainer.global_step}" + (f", {shown}" if shown else ""),
                  file=sys.stderr, flush=True)
        if self._leave:
            bar.close()

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._train_progress_bar is not None:  # None when fit trained no epoch
            self._train_progress_bar.close()

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        for bar in (self._train_progress_bar, self._val_progress_bar, self._test_progress_bar, self._predict_progress_bar):
            if bar is not None:
                bar.close()

    # --- evaluation --------------------------------------------------------------------------
    def _start_eval(self, name: str, bar: Any, total: int | float) -> None:
        self._eval_batches = 0  # over every loader of the pass
        bar.total = _total(total)
        setattr(self, name, bar)

    def _advance_eval(self, bar: Any) -> None:
        self._eval_batches += 1
        if not bar.disable and self._refresh_rate and (self._eval_batches % self._refresh_rate == 0
                                                       or self._eval_batches == bar.total):
            bar.update(self._eval_batches - bar.n)

    def _end_eval(self, trainer: Trainer, module: TrainingModule, bar: Any, description: str) -> None:
        bar.n = self._eval_batches
        bar.close()
        if not self.is_enabled or trainer.sanity_checking:
            return
        shown = _format(self.get_metrics(trainer, module))
        train_bar = self._train_progress_bar if trainer.stage == "fit" else None
        if train_bar is not None and not train_bar.disable:
            train_bar.set_postfix_str(shown, refresh=True)
        elif not self.interactive and shown:
            print(f"{description}: {shown}", file=sys.stderr, flush=True)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking:
            self._start_eval("val_progress_bar", self.init_validation_tqdm(), self.total_val_batches)

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._advance_eval(self.val_progress_bar)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking:
            self._end_eval(trainer, module, self.val_progress_bar, "Validation")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_eval("test_progress_bar", self.init_test_tqdm(), self.total_test_batches)

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._advance_eval(self.test_progress_bar)

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end_eval(trainer, module, self.test_progress_bar, "Test")

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_eval("predict_progress_bar", self.init_predict_tqdm(), self.total_predict_batches)

    def on_predict_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._advance_eval(self.predict_progress_bar)

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._end_eval(trainer, module, self.predict_progress_bar, "Predict")


#: Lightning's name for it.
TQDMProgressBar = ProgressBar


class RichProgressBar(ProgressBar):
    """Lightning's RichProgressBar, drawn with tqdm (rich is not a dependency): the same bars, counts and
    metrics, and ``leave``. Its ``refresh_rate`` is redraws per second (0 turns it off); tqdm redraws
    at most ten times a second by itself, so any other value draws every batch. ``theme`` and
    ``console_kwargs`` style rich's output only, and are refused rather than ignored."""

    def __init__(self, refresh_rate: int = 100, leave: bool = False, theme: Any = None,
                 console_kwargs: dict[str, Any] | None = None) -> None:
        if theme is not None or console_kwargs is not None:
            raise MisconfigurationException(
                "RichProgressBar(theme=..., console_kwargs=...): Cadence draws this bar with tqdm (rich is "
                "not a dependency), and those set rich's look only. Leave them out.")
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, (int, float)) or refresh_rate < 0:
            raise MisconfigurationException(
                f"RichProgressBar(refresh_rate={refresh_rate!r}): redraws per second, a number >= 0 "
                "(0 turns the bars off).")
        super().__init__(refresh_rate=1 if refresh_rate else 0, leave=leave)
        self._refresh_rate = 1 if refresh_rate else 0  # TQDM_MINITERS and Colab are TQDMProgressBar's, not Rich's


@functools.lru_cache(maxsize=None)
def _without_monitor(tqdm_class: type) -> type:
    """``tqdm_class`` without tqdm's monitor: the thread that any bar starts, drawn or not, and that wakes
    every 10 s for the whole run to redraw a stalled bar. A bar that is not drawn has nothing to redraw."""
    return type(tqdm_class.__name__, (tqdm_class,), {"monitor_interval": 0, "__module__": tqdm_class.__module__})


def _resolve_refresh_rate(refresh_rate: int) -> int:
    """Lightning's: Colab draws every 20 batches rather than every one; ``TQDM_MINITERS`` is a least rate."""
    if os.environ.get("COLAB_GPU") and refresh_rate == 1:
        return 20
    if "TQDM_MINITERS" in os.environ:
        value = os.environ["TQDM_MINITERS"]
        if not value.strip().isdigit():
            raise MisconfigurationException(
                f"TQDM_MINITERS={value!r} in the environment: use an int >= 0 (the least refresh rate of "
                "the progress bar), or unset it.")
        return max(int(value), refresh_rate)
    return refresh_rate


def _total(value: int | float) -> int | None:
    return None if value == math.inf else int(value)
