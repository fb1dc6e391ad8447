"""Lightning's read-only Trainer members, as views of what the Trainer holds.

Each is computed from the Trainer's public state (its strategy, callbacks, limits, stage) every time
it is read; none holds state of its own, and none is read by the loop. The Trainer inherits them
from :class:`TrainerProperties` so that ``trainer/trainer.py`` stays the loop; jump-to-definition
lands here. Lightning's names and meanings (``trainer/trainer.py`` of Lightning 2.6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import callbacks as callbacks_package
from callbacks.base import defines
from callbacks.console import MisconfigurationException, warn
from trainer.log_dir import preview_log_dir
from trainer.stage_loaders import estimated_stepping_batches, lightnings_setup_iterator
from trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class TrainerProperties:
    """Read-only views (Lightning's names) that :class:`trainer.Trainer` inherits."""

    # --- where this process is: the strategy's answers
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    global_rank = property(lambda self: self.strategy.global_rank)
    local_rank = property(lambda self: self.strategy.local_rank)
    world_size = property(lambda self: self.strategy.world_size)
    num_nodes = property(lambda self: getattr(self.strategy, "num_nodes", 1))

    @property
    def node_rank(self: Trainer) -> int:
        """This machine's index among ``num_nodes`` (torchrun's ``GROUP_RANK``, or ``NODE_RANK``)."""
        for variable in ("GROUP_RANK", "NODE_RANK"):
            if os.environ.get(variable, "").isdigit():
                return int(os.environ[variable])
        return 0

    @property
    def num_devices(self: Trainer) -> int:
        """Devices (processes) per machine."""
        return max(1, self.world_size // max(1, self.num_nodes)) if self.world_size > 1 else \
            getattr(self.strategy, "num_processes", 1)

    @property
    def device_ids(self: Trainer) -> list[int]:
        """The indices of this machine's devices, as Lightning lists them ([0, 1] for two processes)."""
        devices = getattr(self.strategy, "devices", None)
        if isinstance(devices, list):
            return list(devices)
        device = getattr(self.strategy, "device", None)
        if self.num_devices == 1 and getattr(device, "index", None) is not None:
            return [device.index]
        return list(range(self.num_devices))

    # --- the callbacks that play a named role, in the order given
    progress_bar_callback = property(lambda self: next(iter(self._callbacks_of(callbacks_package.ProgressBar)), None))

    @property
    def loggers(self: Trainer) -> list[Any]:
        """The logger callbacks, in order (a logger of Lightning's interface that is not a callback, a
        Mock say, as given: the LoggerAdapter's ``wrapped``). Settable, as in Lightning: the list given
        replaces them."""
        return [c.wrapped if isinstance(c, callbacks_package.LoggerAdapter) else c
                for c in self._callbacks_of(callbacks_package.Logger)]

    @loggers.setter
    def loggers(self: Trainer, loggers: Any) -> None:
        new = [callbacks_package.as_logger(logger) for logger in loggers] if loggers else []
        for logger in new:
            if not isinstance(logger, callbacks_package.Logger):
                raise TypeError(f"trainer.loggers = [...]: {type(logger).__name__} is not a callbacks.Logger.")
        first = next((i for i, c in enumerate(self.callbacks) if isinstance(c, callbacks_package.Logger)), len(self.callbacks))
        others = [c for c in self.callbacks if not isinstance(c, callbacks_package.Logger)]
        at = len([c for c in self.callbacks[:first] if not isinstance(c, callbacks_package.Logger)])
        self.callbacks = others[:at] + new + others[at:]  # where the old ones were

    @property
    def logger(self: Trainer) -> Any:
        """The first logger, or None. Settable, as in Lightning: ``trainer.logger = None`` removes them all."""
        return next(iter(self.loggers), None)

    @logger.setter
    def logger(self: Trainer, logger: Any) -> None:
        self.loggers = [logger] if logger else []

    checkpoint_callbacks = property(lambda self: self._callbacks_of(callbacks_package.Checkpoint))
    checkpoint_callback = property(lambda self: next(iter(self.checkpoint_callbacks), None))
    early_stopping_callbacks = property(lambda self: self._callbacks_of(callbacks_package.EarlyStopping))
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None))

    def _callbacks_of(self: Trainer, kind: type) -> list[Any]:
        return [callback for callback in self.callbacks if isinstance(callback, kind)]

    # --- the metric store's values (trainer/metrics.py), and the non-finite guard's count
    callback_metrics = property(lambda self: self.metrics.callback_metrics)
    progress_bar_metrics = property(lambda self: self.metrics.progress_bar_metrics)
    logged_metrics = property(lambda self: self.metrics.logged_metrics)
    num_skipped_steps = property(lambda self: self._guard.skipped)  # steps on_nonfinite_loss="skip" skipped
    profiler = property(lambda self: callbacks_package.profiler_of(self.callbacks))  # a PassThroughProfiler if none
    interrupted = property(lambda self: self._preemption.interrupted)  # the last stage ended by an error or a signal

    # --- what runs now: Lightning's TrainerState.stage as booleans
    training = property(lambda self: self.stage == "fit" and self._evaluation_stage is None)
    validating = property(lambda self: self._evaluation_stage == "validate" and not self.sanity_checking)
    testing = property(lambda self: self._evaluation_stage == "test")
    predicting = property(lambda self: self._evaluation_stage == "predict")
    evaluating = property(lambda self: self._evaluation_stage in ("validate", "test") and not self.sanity_checking)
    #: Lightning's: the running (or last) training batch is the epoch's last; for a loader without a length
    #: (an IterableDataset's) known by reading it one batch ahead, as Lightning does (stage_loaders.train_batches).
    is_last_batch = property(lambda self: self.batch_idx + 1 == self._progress.epoch_batches)

    # --- the arguments, as Lightning reports them
    limit_train_batches = property(lambda self: _limit(self.limits["train"]))
    limit_val_batches = property(lambda self: _limit(self.limits["validate"]))
    limit_test_batches = property(lambda self: _limit(self.limits["test"]))
    limit_predict_batches = property(lambda self: _limit(self.limits["predict"]))
    enable_validation = property(lambda self: self.limits["validate"] != 0)

    @property
    def num_sanity_val_batches(self: Trainer) -> list[int | float]:
        """The sanity check's batches per validation loader: fit's; [] in and after ``validate``, whose loaders
        ``num_val_batches`` then counts (Lightning's reads its fit loop's, [] until a fit has made them)."""
        if self.state.fn == "validate":
            return []
        steps = math.inf if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
        return [min(steps, count) for count in self.num_val_batches]

    @property
    def log_dir(self: Trainer) -> str:
        """The run's directory, a str as in Lightning (``<first logger's save_dir>/<name>/version_<N>``;
        without a logger ``default_root_dir``; trainer/log_dir.py): the running or last stage's, and
        before any, the one the next stage will take."""
        return str(self._log_dir if self._log_dir is not None else preview_log_dir(self.loggers, self.default_root_dir))

    @log_dir.setter
    def log_dir(self: Trainer, value: str | os.PathLike | None) -> None:
        self._log_dir = Path(value) if value is not None else None

    @property
    def ckpt_path(self: Trainer) -> str | None:
        """The checkpoint the running or last stage loaded (a str, as in Lightning), or None."""
        return str(self._ckpt_path) if self._ckpt_path is not None else None

    @ckpt_path.setter
    def ckpt_path(self: Trainer, value: str | os.PathLike | None) -> None:
        """As in Lightning, ``trainer.ckpt_path = path`` makes the following stages load ``path`` when they are
        given no ``ckpt_path`` (you are in charge of setting it back to None); one given wins, with a warning."""
        self._ckpt_path, self._ckpt_path_set = (Path(value) if value is not None else None), True

    def _stage_ckpt_path(self: Trainer, stage: str, ckpt_path: Any) -> Any:
        """The ``ckpt_path`` a stage loads: the one it was given, else the one set with ``trainer.ckpt_path = ...``."""
        if not self._ckpt_path_set:
            return ckpt_path
        if ckpt_path is None:
            return self._ckpt_path
        if self.is_global_zero:
            warn(f"`trainer.ckpt_path = {self.ckpt_path!r}` was set, but then you passed "
                 f"`trainer.{stage}(ckpt_path={str(ckpt_path)!r})`: the latter is loaded.")
        self._ckpt_path_set = False  # as Lightning: the Trainer chooses again from now on
        return ckpt_path

    # --- what Lightning's accelerator connector and signal connector answer
    @property
    def precision(self: Trainer) -> str:
        """Lightning's precision string: ``"bf16-mixed"`` or ``"16-mixed"`` under an AMP callback (or FSDP's
        mixed-precision policy), ``"64-true"``, ``"bf16-true"`` or ``"16-true"`` under a TruePrecision,
        else ``"32-true"``. As in Lightning, ``"16-mixed"`` on the CPU is bf16."""
        true_precision = next(iter(self._callbacks_of(callbacks_package.TruePrecision)), None)
        if true_precision is not None:
            return true_precision.precision
        amp = next(iter(self._callbacks_of(callbacks_package.AMP)), None)
        if amp is not None:
            on_cpu = amp.cpu_dtype == "bfloat16" and getattr(getattr(self.strategy, "device", None), "type", "cpu") == "cpu"
            return "bf16-mixed" if amp.requested == "bfloat16" or on_cpu else "16-mixed"
        policy = getattr(self.strategy, "mp_policy", None)
        if policy is not None and getattr(policy, "param_dtype", None) in (torch.bfloat16, torch.float16):
            return "bf16-mixed" if policy.param_dtype == torch.bfloat16 else "16-mixed"
        return "32-true"

    @property
    def accelerator(self: Trainer) -> Any:
        """Refused: Lightning's Accelerator object, which Cadence does not have (where the run is, is the strategy's)."""
        raise AttributeError(
            "trainer.accelerator is Lightning's Accelerator object; Cadence has none. Where the run is, is the "
            "strategy's: trainer.strategy.device (torch.device; .type is 'cpu', 'cuda' or 'mps'), trainer.num_devices, "
            "trainer.device_ids.")

    @property
    def state(self: Trainer) -> TrainerState:
        """Lightning's ``trainer.state`` (trainer/states.py): the last method's ``fn``, the ``stage`` running
        now (None between stages) and the ``status``; a snapshot, read again to see a later stage."""
        running = self.module is not None  # from enter_stage to after the teardown hooks, in every process
        if not running:
            stage = None
        elif self.sanity_checking:
            stage = RunningStage.SANITY_CHECKING
        else:
            stage = RunningStage(self._evaluation_stage or "train") if self.stage == "fit" else RunningStage(self.stage)
        status = (TrainerStatus.INITIALIZING if self.stage is None else TrainerStatus.RUNNING if running
                  else TrainerStatus.INTERRUPTED if self.interrupted else TrainerStatus.FINISHED)
        return TrainerState(status, TrainerFn(self.stage) if self.stage is not None else None, stage)

    @property
    def batches_that_stepped(self: Trainer) -> int:
        """The step the loggers get for the next training batch (Lightning's
        ``fit_loop.epoch_loop._batches_that_stepped``): the batches that ended an accumulation window,
        every batch under manual optimization, kept in checkpoints; what ``LearningRateMonitor`` logs at."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            return self._progress.batches_seen
        return self.global_step

    @property
    def _accelerator_connector(self: Trainer) -> Any:
        """Refused: Lightning's private connector (lightning-bolts' SSLOnlineEvaluator reads its ``is_distributed``)."""
        raise AttributeError(
            "trainer._accelerator_connector is Lightning's private accelerator connector; Cadence has none. Whether "
            "the run is distributed: trainer.world_size > 1; how: trainer.strategy (a strategies.DDP or FSDP, whose "
            "device is trainer.strategy.device).")

    @property
    def fit_loop(self: Trainer) -> FitLoopView:
        """Lightning's ``trainer.fit_loop``, as far as scripts use it: its limits (``max_epochs``, ``min_epochs``,
        ``max_steps``, ``min_steps``, also as ``fit_loop.epoch_loop.max_steps``), read and set (continuing a run:
        ``trainer.fit_loop.max_epochs = 20`` then ``fit`` again), and ``epoch_progress.current.completed``."""
        return FitLoopView(self)

    @property
    def received_sigterm(self: Trainer) -> bool:
        """Whether SIGTERM arrived during this fit (Cadence then saves last.ckpt at the end of the step and stops)."""
        return self._preemption.signal_number == signal.SIGTERM

    @contextlib.contextmanager
    def init_module(self: Trainer, empty_init: bool | None = None) -> Iterator[None]:
        """Lightning's ``with trainer.init_module(): model = MyModel()``: the module is made in the
        dtype of ``precision="64-true" | "bf16-true" | "16-true"`` (bfloat16 from the start: never a
        float32 copy) and on the strategy's device where this process trains on one (under a strategy
        that spawns its processes, ``"ddp"``, on the CPU: each process moves it).

        ``empty_init=True`` (Lightning skips the weights' initialization) is refused.
        """
        if empty_init:
            raise MisconfigurationException(
                "trainer.init_module(empty_init=True) skips initializing the weights, which Cadence does not do. "
                "Leave empty_init out (a checkpoint loaded afterwards replaces the initialized weights), or build "
                "large layers in configure_model, which FSDP runs on the meta device.")
        with contextlib.ExitStack() as contexts:
            if not self.strategy.launches_subprocesses:
                contexts.enter_context(self.strategy.device)
            for callback in self.callbacks:
                if defines(callback, "module_init_context") and (context := callback.module_init_context()) is not None:
                    contexts.enter_context(context)
            yield

    @property
    def estimated_stepping_batches(self: Trainer) -> int | float:
        """The optimizer steps fit will take (trainer/stage_loaders.py). Asked during fit before the training loader
        is made (in configure_optimizers), it makes it now (the one view that does): fit trains on that one."""
        if self.stage == "fit" and self._data is not None and self._fit_loaders is None:
            self._make_loaders("fit", self._data, ("train",))
            lightnings_setup_iterator(self._fit_loaders.train, self.current_epoch, self._progress, early=True)  # Lightning's
        return estimated_stepping_batches(self.num_training_batches, self.accumulate_grad_batches, self.max_epochs,
                                          self.max_steps)

    def print(self: Trainer, *args: Any, **kwargs: Any) -> None:
        """``print`` on the first process of each machine only (local rank 0), as Lightning's ``trainer.print``."""
        if self.local_rank == 0:
            print(*args, **kwargs)


def _limit(value: int | float | None) -> int | float:
    return 1.0 if value is None else value


class FitLoopView:
    """``trainer.fit_loop``: the Trainer's limits under the names of Lightning's loop objects. Cadence's loop is the
    Trainer's own code, so the rest of Lightning's loop state (its progress trackers, data fetchers, ``connect``)
    is refused by name, saying what Cadence has instead."""

    _LIMITS = ("max_epochs", "min_epochs", "max_steps", "min_steps")

    def __init__(self, trainer: Trainer) -> None:
        object.__setattr__(self, "_trainer", trainer)

    @property
    def epoch_loop(self) -> FitLoopView:  # Lightning's fit_loop.epoch_loop.max_steps is fit_loop.max_steps
        return self

    @property
    def epoch_progress(self) -> Any:  # ...current.completed: the epochs completed, trainer.current_epoch
        completed = self._trainer.current_epoch
        return _Progress(current=_Progress(completed=completed, processed=completed))

    def __getattr__(self, name: str) -> Any:
        if name in FitLoopView._LIMITS:
            return getattr(self._trainer, name)
        raise AttributeError(
            f"trainer.fit_loop.{name} is Lightning's loop internals, which Cadence does not have (its loop is the "
            "Trainer's own code): fit_loop has max_epochs, min_epochs, max_steps, min_steps and "
            "epoch_progress.current.completed. Where the run is: trainer.current_epoch, trainer.global_step, "
            "trainer.batch_idx, trainer.num_training_batches; to change how it trains, write a callback.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FitLoopView._LIMITS:
            raise AttributeError(f"trainer.fit_loop.{name} cannot be set in Cadence: set max_epochs, min_epochs, "
                                 "max_steps or min_steps (the Trainer's limits), or the Trainer's own attributes.")
        setattr(self._trainer, name, value)


@dataclasses.dataclass(frozen=True)
class _Progress:
    completed: int = 0
    processed: int = 0
    current: Any = None
