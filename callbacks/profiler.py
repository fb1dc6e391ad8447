"""Profiler: ``torch.profiler`` over a few scheduled training batches, bounded traces, a verdict.

``Trainer(callbacks=[Profiler()])`` (or ``Trainer(profiler="pytorch")``) profiles the training
loop on its schedule: ``wait`` batches untraced, ``warmup`` traced and discarded, ``active``
traced and kept, ``repeat`` times. Each active window becomes one Chrome-trace file,
``<log_dir>/profiler/rank<R>-window<K>.pt.trace.json.gz``, that opens in https://ui.perfetto.dev
and chrome://tracing; next to it, ``rank<R>-window<K>.txt`` holds the ``key_averages`` table
and a verdict in words, which rank zero also prints. After the schedule the profiler stops:
the remaining batches pay one Python call that returns at once.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import MisconfigurationException
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Keys ``key_averages().table(sort_by=...)`` sorts by.
SORT_KEYS = (
    "self_cpu_time_total", "cpu_time_total", "self_device_time_total", "device_time_total",
    "self_cuda_time_total", "cuda_time_total", "self_cpu_memory_usage", "cpu_memory_usage",
    "self_device_memory_usage", "device_memory_usage", "count", "flops",
)
#: Names of the spans that torch.profiler and PyTorch add around a batch, its data and the optimizer.
STEP_SPAN, DATA_SPAN, OPTIMIZER_SPANS = "ProfilerStep", "enumerate(DataLoader)", ("Optimizer.step#", "Optimizer.zero_grad#")


class Profiler(Callback):
    """Profile a few training batches with ``torch.profiler``; write traces, a table and a verdict.

    Args:
        dirpath: where the traces go; default ``<log_dir>/profiler``.
        wait, warmup, active, repeat: the schedule (``torch.profiler.schedule``), in training
            batches: ``repeat`` windows of ``active`` traced batches, each after ``wait`` skipped
            and ``warmup`` traced-and-discarded ones. ``repeat`` >= 1 keeps the traces bounded.
        record_shapes, profile_memory, with_stack: as in ``torch.profiler.profile``.
        sort_by: the table's order; default self device time with a GPU, self CPU time otherwise.
        row_limit: rows of the table.

    Example::

        Trainer(callbacks=[Profiler(wait=5, warmup=2, active=3)])
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, wait: int = 1, warmup: int = 1, active: int = 3,
                 repeat: int = 1, record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = False,
                 sort_by: str | None = None, row_limit: int = 20) -> None:
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                   ("repeat", repeat, 1), ("row_limit", row_limit, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                why = " (0 would trace every batch to the end: traces must stay bounded)" if name == "repeat" else ""
                raise MisconfigurationException(f"Profiler({name}={value!r}): use an int >= {least}{why}.")
        if sort_by is not None and sort_by not in SORT_KEYS:
            raise MisconfigurationException(f"Profiler(sort_by={sort_by!r}): use one of {', '.join(SORT_KEYS)}.")
        if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
            raise MisconfigurationException(f"Profiler(dirpath={dirpath!r}): use a directory path or None.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.sort_by, self.row_limit = sort_by, row_limit
        self.trace_paths: list[Path] = []  # written by this process
        self._profile: Any = None
        self._steps = 0

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        device = module.device
        activity = {"cuda": torch.profiler.ProfilerActivity.CUDA,
                    "xpu": torch.profiler.ProfilerActivity.XPU}.get(device.type)
        self._directory = self.dirpath or Path(trainer.log_dir) / "profiler"
        self._rank, self._prints = trainer.global_rank, trainer.is_global_zero
        self._device_type = device.type if activity is not None else None
        self._sort = self.sort_by or ("self_device_time_total" if activity is not None else "self_cpu_time_total")
        self._steps, self._windows = 0, 0
        self._profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU] + ([activity] if activity is not None else []),
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat),
            on_trace_ready=self._save_window, record_shapes=self.record_shapes,
            profile_memory=self.profile_memory, with_stack=self.with_stack,
        )
        self._profile.start()
        ignore_cycle_warning()

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._profile is None:  # the schedule is done: this is all a batch pays
            return
        self._profile.step()
        self._steps += 1
        if self._steps >= (self.wait + self.warmup + self.active) * self.repeat:
            self._stop()

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._stop()  # fit ended inside the schedule: an open window is saved as it is

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()

    def _save_window(self, profile: Any) -> None:
        """on_trace_ready: one active window is done; write its trace, table and verdict."""
        window = len(self.trace_paths)
        self._directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self._rank}-window{window}"
        path = self._directory / f"{name}.pt.trace.json.gz"
        temporary = self._directory / f".{name}.tmp.json.gz"  # gzip by the suffix; renamed when whole
        profile.export_chrome_trace(str(temporary))
        os.replace(temporary, path)
        self.trace_paths.append(path)
        averages = profile.key_averages()
        first = self._windows * (self.wait + self.warmup + self.active) + self.wait + self.warmup
        self._windows += 1
        last = min(first + self.active, profile.step_num) - 1  # a fit may end inside the window
        text = (f"Profiler, rank {self._rank}, window {window} (training batches {first}-{last} of this fit): {path}\n"
                f"{averages.table(sort_by=self._sort, row_limit=self.row_limit)}\n"
                f"{verdict(profile.events(), averages, self._sort, self._device_type)}")
        (self._directory / f"{name}.txt").write_text(text + "\n")
        if self._prints:
            print(text, file=sys.stderr, flush=True)


def verdict(events: Any, averages: Any, sort_key: str, device_type: str | None) -> str:
    """A few sentences on one window: the top operators, where the batches' time went, device idle.

    ``events`` are the window's ``FunctionEvent``s. On a GPU the profiler records each
    ``record_function`` range twice, on the host and as a device-side copy (a "gpu_user_annotation"
    spanning the kernels it launched), and kernels of several streams overlap: the batches are
    the host's ``ProfilerStep`` spans, and the device was busy for the union of its kernels'
    intervals (annotations left out), over the window's wall time.
    """
    host = [event for event in events if event.device_type == torch.autograd.DeviceType.CPU]
    steps = [event for event in host if event.name.startswith(STEP_SPAN)]
    step_us = sum(event.time_range.elapsed_us() for event in steps)
    data_us = sum(event.time_range.elapsed_us() for event in host if event.name.startswith(DATA_SPAN))
    optimizer_us = sum(event.time_range.elapsed_us() for event in host if event.name.startswith(OPTIMIZER_SPANS))
    operators = [row for row in averages if not row.key.startswith((STEP_SPAN, DATA_SPAN, *OPTIMIZER_SPANS))]
    by = sort_key.replace("cuda", "device")
    total = sum(getattr(row, by) for row in operators) or 1
    top = sorted(operators, key=lambda row: getattr(row, by), reverse=True)[:3]
    what = {"self_cpu_time_total": "self CPU time", "cpu_time_total": "CPU time (with children)",
            "self_device_time_total": "self device time", "device_time_total": "device time (with children)"}.get(by, by)
    lines = ["Verdict: top operators by " + what + ": "
             + ", ".join(f"{row.key} {getattr(row, by) / total:.0%} ({row.count} calls)" for row in top) + "."]
    if step_us > 0:
        rest = max(0.0, step_us - data_us - optimizer_us)
        lines.append(f"Of the {len(steps)} profiled batches ({step_us / len(steps) / 1000:.2f} ms each on the host): "
                     f"waiting for data {data_us / step_us:.0%}, optimizer step and zero_grad {optimizer_us / step_us:.0%}, "
                     f"the rest of the training step (forward, backward, hooks) {rest / step_us:.0%}.")
        if data_us / step_us >= 0.2:
            lines.append("Data loading is a large share: raise the DataLoader's num_workers, or make __getitem__ cheaper.")
    if device_type is not None and steps:
        device = [event for event in events if event.device_type != torch.autograd.DeviceType.CPU
                  and not _is_annotation(event)]
        start = min(event.time_range.start for event in steps)
        end = max([event.time_range.end for event in steps] + [event.time_range.end for event in device])
        kernels = [(e.time_range.start, e.time_range.end) for e in device if _activity(e) != "gpu_memcpy"]
        copies = [(e.time_range.start, e.time_range.end) for e in device if _activity(e) == "gpu_memcpy"]
        busy = covered_us(kernels, start, end) / (end - start)
        copying = covered_us(copies, start, end) / (end - start)
        lines.append(f"The {device_type} device ran kernels {busy:.0%} of the profiled time (idle {1 - busy:.0%}; "
                     f"copying memory {copying:.0%}, kernels of overlapping streams counted once)"
                     + (": the host does not keep it fed; look at data loading, host syncs (.item(), printing) "
                        "and small kernels (callbacks.Compile)." if busy < 0.7 else "."))
    return "\n".join(lines)


def covered_us(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of ``[start, end]`` that at least one of ``intervals`` covers (overlaps merged)."""
    covered, reached = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, reached), min(high, end)
        if high > low:
            covered += high - low
            reached = high
    return covered


def _activity(event: Any) -> str:
    return str(getattr(event, "activity_type", "") or "")


def _is_annotation(event: Any) -> bool:
    """A device-side copy of a ``record_function`` range (or ``ProfilerStep``), not device work."""
    return bool(getattr(event, "is_user_annotation", False)) or "annotation" in _activity(event)


_CYCLE_WARNING = ".*Profiler clears events at the end of each cycle"


def ignore_cycle_warning() -> None:
    """Silence torch's warning that a schedule's cycle ends with its events cleared: each window is saved when it
    ends, so that the next starts empty is the point. Filtered once, when a profiler starts, not around each step:
    leaving a ``catch_warnings`` block makes Python forget which warnings it has shown, so every warning of the run
    (the user's too) would be shown again after each profiled step."""
    if not any(action == "ignore" and message is not None and message.pattern == _CYCLE_WARNING
               for action, message, *_ in warnings.filters):
        warnings.filterwarnings("ignore", message=_CYCLE_WARNING)
