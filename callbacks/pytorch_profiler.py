"""PyTorchProfiler: Lightning's ``torch.profiler`` profiler, driven by the actions of a stage.

``Trainer(profiler="pytorch")`` or ``Trainer(profiler=PyTorchProfiler(...))``. The first action
starts ``torch.profiler.profile``; each action becomes a ``record_function`` range named
``[pl][profile]<action>`` (Lightning's names, so tools that look for them find them), each
submodule's forward a ``[pl][module]<class>: <name>`` range, and each step method
(``training_step``, ``validation_step``, ...) one step of the schedule (default: wait 1, warmup 1,
active 3, as in Lightning). As in Lightning, each kind of step counts its own steps and records its
first window only; ``schedule=None`` records everything; a stage with fewer than 5 steps of a kind
records everything, with a warning, instead of the default schedule. Each recorded window is
written as a Chrome trace under ``dirpath`` (``trainer.log_dir`` by default), named
``<stage>-<filename>-<step action>.<time>.pt.trace.json``; the report at the end of the stage is
the ``key_averages`` table of the last window (``function_events``).
For bounded traces of training batches with a verdict in words, use ``callbacks.Profiler``.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

from callbacks.console import MisconfigurationException, warn
from callbacks.profiler import ignore_cycle_warning
from callbacks.profilers import Profiler

STEP_FUNCTIONS = ("training_step", "validation_step", "test_step", "predict_step")
#: Lightning's default schedule: little overhead over a long run.
DEFAULT_SCHEDULE = torch.profiler.schedule(wait=1, warmup=1, active=3)
_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warn(message)


class StepSchedule:
    """A ``torch.profiler`` schedule counted per kind of step, each kind through its first window only.

    As Lightning's: training, validation, test and predict steps each count their own steps (so the
    validation inside fit does not advance training's window; the sanity check's steps count), and
    after a kind's window is saved its steps record nothing. The profiler calls it with its own step
    number, which it ignores.
    """

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule
        self.reset()

    def reset(self) -> None:
        self.kind: str | None = None  # the kind of the step that just ended (set before profiler.step())
        self.counts = dict.fromkeys(STEP_FUNCTIONS, 0)
        self.done: set[str] = set()
        self.previous = torch.profiler.ProfilerAction.NONE

    def __call__(self, step_num: int) -> Any:
        kind, actions = self.kind, torch.profiler.ProfilerAction
        if kind is None or kind in self.done:
            return actions.NONE
        self.counts[kind] += 1
        action = self.schedule(self.counts[kind])
        if self.previous == actions.RECORD and action == actions.WARMUP:
            action = actions.RECORD  # a kind that starts inside another's window: torch refuses RECORD -> WARMUP
        if action == actions.RECORD_AND_SAVE:
            self.done.add(kind)
        self.previous = action
        return action


class PyTorchProfiler(Profiler):
    """``torch.profiler`` over the stage's actions; Chrome traces and the operators' table.

    Args:
        dirpath, filename: see :class:`callbacks.profilers.Profiler`.
        group_by_input_shapes: group the table by input shapes (needs ``record_shapes=True``).
        emit_nvtx: refused: NVTX ranges are for ``nsys``; wrap ``trainer.fit`` in
            ``torch.autograd.profiler.emit_nvtx()`` yourself.
        export_to_chrome: write each recorded window as a Chrome trace (``.pt.trace.json``).
        row_limit: rows of the table (-1: all).
        sort_by_key: the table's order: one of :attr:`AVAILABLE_SORT_KEYS`; default the CPU time
            (the CUDA time when CUDA is profiled).
        record_module_names: a range per submodule forward, named after it.
        table_kwargs: more keyword arguments of ``EventList.table``.
        **profiler_kwargs: keyword arguments of ``torch.profiler.profile`` (``schedule``,
            ``record_shapes``, ``profile_memory``, ``with_stack``, ``activities``, ...).
    """

    STEP_FUNCTIONS = set(STEP_FUNCTIONS)
    AVAILABLE_SORT_KEYS = {"cpu_time", "cuda_time", "cpu_time_total", "cuda_time_total", "cpu_memory_usage",
                           "cuda_memory_usage", "self_cpu_memory_usage", "self_cuda_memory_usage", "count"}

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, group_by_input_shapes: bool = False,
                 emit_nvtx: bool = False, export_to_chrome: bool = True, row_limit: int = 20,
                 sort_by_key: str | None = None, record_module_names: bool = True,
                 table_kwargs: dict[str, Any] | None = None, **profiler_kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if emit_nvtx:
            raise MisconfigurationException(
                "PyTorchProfiler(emit_nvtx=True): Cadence does not emit NVTX ranges. Run trainer.fit inside "
                "`with torch.autograd.profiler.emit_nvtx():` under nsys instead.")
        known = set(inspect.signature(torch.profiler.profile).parameters)
        unknown = sorted(set(profiler_kwargs) - known)
        if unknown:
            raise MisconfigurationException(
                f"PyTorchProfiler({unknown[0]}=...): not an argument of torch.profiler.profile; it takes "
                f"{', '.join(sorted(known))}.")
        activities = profiler_kwargs.get("activities")
        cuda = torch.cuda.is_available() if activities is None else torch.profiler.ProfilerActivity.CUDA in activities
        self._sort_by_key = sort_by_key or f"{'cuda' if cuda else 'cpu'}_time_total"
        if self._sort_by_key not in self.AVAILABLE_SORT_KEYS:
            raise MisconfigurationException(
                f"PyTorchProfiler(sort_by_key={sort_by_key!r}): use one of "
                f"{', '.join(sorted(self.AVAILABLE_SORT_KEYS))}.")
        table_kwargs = dict(table_kwargs or {})
        table_keys = set(inspect.signature(torch.autograd.profiler_util.EventList.table).parameters) - {"self"}
        for key in table_kwargs:  # Lightning's words first: scripts match them
            if key in ("sort_by", "row_limit"):
                raise KeyError(f"Found invalid table_kwargs key: {key}. This is already a positional argument of the "
                               f"Profiler. PyTorchProfiler(table_kwargs={{{key!r}: ...}}): {key} has its own argument "
                               "(sort_by_key, row_limit).")
            if key not in table_keys:
                raise KeyError(f"Found invalid table_kwargs key: {key}. PyTorchProfiler(table_kwargs={{{key!r}: ...}}): "
                               f"use keys of EventList.table: {', '.join(sorted(table_keys - {'sort_by', 'row_limit'}))}.")
        schedule = profiler_kwargs.pop("schedule", DEFAULT_SCHEDULE)  # given as None: record every step (Lightning's)
        if schedule is not None and (not callable(schedule) or not isinstance(schedule(0), torch.profiler.ProfilerAction)):
            raise MisconfigurationException(
                f"PyTorchProfiler(schedule={schedule!r}): use torch.profiler.schedule(...), a function of "
                "the step number that returns a torch.profiler.ProfilerAction, or None to record every step.")
        self._schedule = None if schedule is None else StepSchedule(schedule)
        self._group_by_input_shapes = group_by_input_shapes and profiler_kwargs.get("record_shapes", False)
        self._export_to_chrome, self._row_limit = export_to_chrome, row_limit
        self._record_module_names, self._table_kwargs = record_module_names, table_kwargs
        self._profiler_kwargs = profiler_kwargs
        self.profiler: Any = None  # the running torch.profiler.profile
        self.function_events: Any = None  # the events of the last recorded window
        self._recording: dict[str, Any] = {}  # action -> its open record_function
        self._module_hooks: list[Any] = []
        self._step_action: str | None = None  # the step action that last ended (names the trace file)

    def start(self, action_name: str) -> None:
        if self.profiler is None:
            if self._schedule is not None:
                self._schedule.reset()
            schedule = self._schedule if self._schedule is not None else None
            self.profiler = torch.profiler.profile(schedule=schedule, on_trace_ready=self._on_trace_ready,
                                                   **self._profiler_kwargs)
            self.profiler.start()
            ignore_cycle_warning()
            if self._record_module_names and self._module is not None:
                self._module_hooks = _record_module_names(self._module)
        if action_name not in self._recording:
            recording = record_function("[pl][profile]" + action_name)
            recording.__enter__()
            self._recording[action_name] = recording

    def stop(self, action_name: str) -> None:
        recording = self._recording.pop(action_name, None)
        if recording is not None:
            recording.__exit__(None, None, None)
        if self.profiler is not None and action_name.endswith(STEP_FUNCTIONS):
            kind = next(step for step in STEP_FUNCTIONS if action_name.endswith(step))
            if self._schedule is not None and self._schedule.schedule is DEFAULT_SCHEDULE and self._steps_of(kind) < 5:
                warn_once(f"The PyTorch Profiler default schedule will be overridden as there is not enough steps to "
                          f"properly record traces: this {self._stage} runs fewer than 5 {kind}s (wait 1, warmup 1, "
                          "record 3), so every step is recorded. Give PyTorchProfiler(schedule=...) to choose.")
                self._schedule = None
                self.profiler.schedule = torch.profiler.profiler._default_schedule_fn  # record from here on
            if self._schedule is not None:
                self._schedule.kind = kind
            self._step_action = action_name
            self.profiler.step()

    def _steps_of(self, kind: str) -> float:
        """How many ``kind`` steps the running stage takes (validation: with the sanity check's), as Lightning counts."""
        trainer = getattr(self._module, "trainer", None)
        if trainer is None:
            return math.inf
        if kind == "training_step":
            return trainer.num_training_batches
        if kind == "validation_step":
            return sum(trainer.num_val_batches) + (sum(trainer.num_sanity_val_batches) if self._stage == "fit" else 0)
        return sum(trainer.num_test_batches if kind == "test_step" else trainer.num_predict_batches)

    def _on_trace_ready(self, profile: Any) -> None:
        if not self._export_to_chrome:
            return
        if self.dirpath is None:
            warn_once("The PyTorchProfiler failed to export trace as `dirpath` is None: give PyTorchProfiler(dirpath=...), "
                      "or run it under a Trainer (its log_dir).")
            return
        Path(self.dirpath).mkdir(parents=True, exist_ok=True)
        name = self._prepare_filename(action_name=self._step_action, extension="")
        profile.export_chrome_trace(os.path.join(self.dirpath, f"{name}.{time.time_ns()}.pt.trace.json"))

    def summary(self) -> str:
        self._stop_profiler()
        if not self.function_events:
            return ""
        averages = self.function_events.key_averages(group_by_input_shapes=self._group_by_input_shapes)
        table = averages.table(sort_by=self._sort_by_key, row_limit=self._row_limit, **self._table_kwargs)
        return self._stats_to_str({"records": table})

    def _stop_profiler(self) -> None:
        for action in list(self._recording):
            self._recording.pop(action).__exit__(None, None, None)
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()  # a window cut short by the end of the stage is kept
            if profiler.profiler is not None:  # the last window's events (None when no step was recorded)
                self.function_events = profiler.events()

    def teardown(self, stage: str | None) -> None:
        self._stop_profiler()
        super().teardown(stage=stage)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(profiler=None, function_events=None, _recording={}, _module_hooks=[])
        return state


def _record_module_names(model: torch.nn.Module) -> list[Any]:
    """A ``[pl][module]<module.Class>: <name>`` range around each submodule's forward; the hook handles."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        records: list[Any] = []
        label = f"[pl][module]{type(module).__module__}.{type(module).__name__}: {name}"
        handles.append(module.register_forward_pre_hook(functools.partial(_enter, records, label)))
        handles.append(module.register_forward_hook(functools.partial(_exit, records)))
    return handles


def _enter(records: list[Any], label: str, module: Any, inputs: Any) -> None:
    record = record_function(label)
    record.__enter__()
    records.append(record)


def _exit(records: list[Any], module: Any, inputs: Any, output: Any) -> None:
    if records:
        records.pop().__exit__(None, None, None)
