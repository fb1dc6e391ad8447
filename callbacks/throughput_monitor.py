"""Lightning's ``ThroughputMonitor`` (and the ``Throughput`` it computes with): samples, batches,
items and FLOPs per second in the loggers.

For each stage (``train``, ``validate``, ``test``, ``predict``) the callback counts batches and
samples (``batch_size_fn(batch)``), items (``length_fn(batch)``: tokens, say) and FLOPs (the
module's ``flops_per_batch``, e.g. from ``torch.utils.flop_counter``), and at log steps writes
``<stage>/<metric>``: ``time``, ``batches``, ``samples``, ``lengths``, and, once ``window_size``
batches were seen, the rolling rates ``device/batches_per_sec``, ``device/samples_per_sec``,
``device/items_per_sec``, ``device/flops_per_sec`` (``device/mfu`` with ``available_flops``) and,
with several processes, the totals ``batches_per_sec``, ... (times the world size), as Lightning.
Training's clock stops while fit validates, so validation does not lower training's rates.

The rates are measured on rank zero. Lightning calls ``torch.cuda.synchronize()`` after every
batch; Cadence only at the batches whose values are written (log steps, at the end of an
accumulation window): the clock reads in between are the host's, and the window's rate, from one
synchronized read to another, counts the device's time all the same.

Differences from Lightning: Lightning looks the device's peak FLOPs up in a table of GPUs to give
``device/mfu``; Cadence has no such table, so pass ``available_flops`` (per device, for the compute
dtype) to get it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.console import MisconfigurationException, warn
from callbacks.logging import Logger

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class Throughput:
    """Rolling rates over the last ``window_size`` updates of running totals (Lightning's ``Throughput``).

    ``update(time=, batches=, samples=, lengths=None, flops=None)`` takes totals (``flops``: of the
    last batch, per device); ``compute()`` returns the metrics named in the module's docstring.
    """

    def __init__(self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100,
                 separator: str = "/", using_sparse_model: bool | None = None,
                 sparse_cuda_acceleration_factor: float = 2.0) -> None:
        if window_size < 2:
            raise MisconfigurationException(
                f"Throughput(window_size={window_size}): the rates need two points; use 2 or more.")
        if world_size < 1:
            raise MisconfigurationException(
                f"Throughput(world_size={world_size}): use the number of processes (1 or more).")
        if sparse_cuda_acceleration_factor < 1.0:
            raise MisconfigurationException(
                "Throughput: sparse acceleration factor cannot reduce peak FLOPs (use a factor >= 1).")
        if using_sparse_model and available_flops is not None:
            available_flops *= sparse_cuda_acceleration_factor
        self.available_flops, self.world_size, self.separator = available_flops, world_size, separator
        self._time: deque[float] = deque(maxlen=window_size)
        self._batches: deque[int] = deque(maxlen=window_size)
        self._samples: deque[int] = deque(maxlen=window_size)
        self._lengths: deque[int] = deque(maxlen=window_size)
        self._flops: deque[float] = deque(maxlen=window_size)

    def update(self, *, time: float, batches: int, samples: int, lengths: int | None = None,
               flops: float | None = None) -> None:
        for name, window, value in (("time", self._time, time), ("batches", self._batches, batches)):
            if window and window[-1] >= value:
                raise MisconfigurationException(
                    f"Throughput.update: Expected the value to increase, last: {window[-1]}, current: "
                    f"{value} ({name} are running totals).")
        if samples < batches:
            raise MisconfigurationException(
                f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        if lengths is not None and lengths < samples:
            raise MisconfigurationException(
                f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
        self._time.append(time)
        self._batches.append(batches)
        self._samples.append(samples)
        if lengths is not None:
            self._lengths.append(lengths)
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> dict[str, float]:
        metrics: dict[str, float] = {"time": self._time[-1], "batches": self._batches[-1], "samples": self._samples[-1]}
        if self._lengths:
            metrics["lengths"] = self._lengths[-1]
        device, every = f"device{self.separator}", self.world_size > 1
        if len(self._time) == self._time.maxlen:
            elapsed = self._time[-1] - self._time[0]
            rates = {"batches_per_sec": (self._batches[-1] - self._batches[0]) / elapsed,
                     "samples_per_sec": (self._samples[-1] - self._samples[0]) / elapsed}
            if len(self._lengths) == self._lengths.maxlen:
                rates["items_per_sec"] = (self._lengths[-1] - self._lengths[0]) / elapsed
            for name, rate in rates.items():
                metrics[device + name] = rate
                if every:
                    metrics[name] = rate * self.world_size
        if len(self._flops) == self._flops.maxlen:
            flops_per_sec = (sum(self._flops) - self._flops[0]) / (self._time[-1] - self._time[0])
            if every:
                metrics["flops_per_sec"] = flops_per_sec
            metrics[device + "flops_per_sec"] = flops_per_sec / self.world_size
            if self.available_flops:
                metrics[device + "mfu"] = flops_per_sec / self.world_size / self.available_flops
        return metrics

    def reset(self) -> None:
        for window in (self._time, self._batches, self._samples, self._lengths, self._flops):
            window.clear()


_THROUGHPUT_ARGUMENTS = {"available_flops", "window_size", "separator", "using_sparse_model",
                         "sparse_cuda_acceleration_factor"}


class _Count:
    """One stage's running totals and clock."""

    def __init__(self, throughput: Throughput) -> None:
        self.throughput, self.t0, self.batches, self.samples, self.lengths = throughput, time.perf_counter(), 0, 0, 0
        self.last = self.t0  # the clock at the last update
        self.before = 0  # fit's validation: the batches of its earlier validations (Lightning counts them on)
        throughput.reset()


class ThroughputMonitor(Callback):
    """Log throughput at log steps (Lightning's arguments).

    Args:
        batch_size_fn: ``batch -> number of samples`` in it.
        length_fn: ``batch -> number of items`` (tokens, ...) in it; None: no items metrics.
        **kwargs: :class:`Throughput`'s: ``window_size`` (100 batches), ``separator`` ("/"),
            ``available_flops`` (peak FLOPs of one device, for ``device/mfu``), ``using_sparse_model``,
            ``sparse_cuda_acceleration_factor``.
    """

    def __init__(self, batch_size_fn: Callable[[Any], int], length_fn: Callable[[Any], int] | None = None,
                 **kwargs: Any) -> None:
        if not callable(batch_size_fn) or (length_fn is not None and not callable(length_fn)):
            raise MisconfigurationException(
                "ThroughputMonitor(batch_size_fn=..., length_fn=...): pass functions of the batch, e.g. "
                "batch_size_fn=lambda batch: batch[0].size(0).")
        unknown = sorted(set(kwargs) - _THROUGHPUT_ARGUMENTS)
        if unknown:
            raise TypeError(f"ThroughputMonitor got {unknown}: besides batch_size_fn and length_fn it takes Throughput's "
                            f"arguments {sorted(_THROUGHPUT_ARGUMENTS)}.")
        Throughput(**kwargs)  # a wrong value fails here, not when fit starts
        self.kwargs, self.batch_size_fn, self.length_fn = kwargs, batch_size_fn, length_fn
        self.available_flops: float | None = kwargs.get("available_flops")  # Lightning's member (its own from a GPU table)
        self._counts: dict[str, _Count] = {}
        self._module_has_flops: bool | None = None
        self._last_train_update: float | None = None

    def _start(self, trainer: Trainer, stage: str) -> None:
        if trainer.is_global_zero:
            self._counts[stage] = _Count(Throughput(world_size=trainer.world_size, **self.kwargs))

    @torch.inference_mode()  # in case batch_size_fn or length_fn compute with autograd
    def _update(self, trainer: Trainer, module: TrainingModule, stage: str, batch: Any, logs: bool, step: int) -> None:
        count = self._counts.get(stage)
        if count is None:
            return
        if logs and trainer.strategy.device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.device)  # only before the values written: see the module's docstring
        now = time.perf_counter()
        if self._module_has_flops is None:
            self._module_has_flops = hasattr(module, "flops_per_batch")
            if not self._module_has_flops:
                warn("When using the `ThroughputMonitor`, you need to define a `flops_per_batch` attribute or property "
                     f"in {type(module).__name__} to compute the FLOPs.")
        count.batches += 1
        count.samples += self.batch_size_fn(batch)
        if self.length_fn is not None:
            count.lengths += self.length_fn(batch)
        count.throughput.update(time=now - count.t0, batches=count.batches, samples=count.samples,
                                lengths=count.lengths if self.length_fn is not None else None,
                                flops=module.flops_per_batch if self._module_has_flops else None)
        count.last = now
        if stage == "train":
            self._last_train_update = now
        if logs:
            separator = count.throughput.separator
            metrics = {f"{stage}{separator}{key}": value for key, value in count.throughput.compute().items()}
            if stage == "train":  # as Lightning's logger connector, which adds it to the rows it steps itself
                metrics["epoch"] = trainer.current_epoch
            for logger in trainer.loggers:  # called as Lightning's logger connector calls them
                logger.log_metrics(metrics=metrics, step=step)
                if not isinstance(logger, Logger):  # Cadence's write in their own time; another's is saved, as there
                    logger.save()

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start(trainer, "train")
        self._counts.pop("validate", None)  # this fit's validation steps count from its first

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Written when an accumulation window ends (the optimizer step is in the time) at a log step, at
        # Lightning's step: the optimizer steps before this one (every batch under manual optimization).
        count = self._counts.get("train")
        seen = count.batches + 1 if count is not None else 0
        window_ends = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch
        stepped = trainer.global_step if module.automatic_optimization else seen
        self._update(trainer, module, "train", batch, window_ends and stepped % trainer.log_every_n_steps == 0, stepped - 1)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking:
            earlier = self._counts.get("validate") if trainer.stage == "fit" else None  # on_train_start forgets fit's
            self._start(trainer, "validate")
            if earlier is not None and "validate" in self._counts:
                self._counts["validate"].before = earlier.before + earlier.batches

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._evaluation_update(trainer, module, "validate", batch)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        train = self._counts.get("train")
        if trainer.sanity_checking or trainer.stage != "fit" or train is None or self._last_train_update is None:
            return
        # Training's clock skips the validation: from its last update to validation's last (as Lightning's,
        # which reads no clock here: what follows validation's last batch counts as training).
        validation = self._counts.get("validate")
        train.t0 += (validation.last if validation is not None else time.perf_counter()) - self._last_train_update

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start(trainer, "test")

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._evaluation_update(trainer, module, "test", batch)

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start(trainer, "predict")

    def on_predict_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._evaluation_update(trainer, module, "predict", batch)

    def _evaluation_update(self, trainer: Trainer, module: TrainingModule, stage: str, batch: Any) -> None:
        count = self._counts.get(stage)
        seen = count.batches + 1 if count is not None else 0
        before = count.before if count is not None else 0  # fit's validation: step counted on over the fit, as Lightning
        self._update(trainer, module, stage, batch, seen % trainer.log_every_n_steps == 0, before + seen)
