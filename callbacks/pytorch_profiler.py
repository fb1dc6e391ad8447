"""PyTorchProfiler: Lightning's ``torch.profiler`` profiler, driven by the actions of a stage.

``Trainer(profiler="pytorch")`` or ``Trainer(profiler=PyTorchProfiler(...))``. The first action
starts ``torch.profiler.profile``; each action becomes a ``record_function`` range named
``[pl][profile]<action>`` (Lightning's names, so tools that look for them find them), each
submodule's forward a ``[pl][module]<class>: <name>`` range, and each step method
(``training_step``, ``validation_step``, ...) one step of the schedule (default: wait 1, warmup 1,
active 3, as in Lightning). Each recorded window is written as a Chrome trace under ``dirpath``
(``trainer.log_dir`` by default); the report at the end of the stage is the ``key_averages`` table.
For bounded traces of training batches with a verdict in words, use ``callbacks.Profiler``.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function

from callbacks.profilers import Profiler

STEP_FUNCTIONS = ("training_step", "validation_step", "test_step", "predict_step")


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
            raise ValueError("PyTorchProfiler(emit_nvtx=True): Cadence does not emit NVTX ranges. Run trainer.fit inside "
                             "`with torch.autograd.profiler.emit_nvtx():` under nsys instead.")
        known = set(inspect.signature(torch.profiler.profile).parameters)
        unknown = sorted(set(profiler_kwargs) - known)
        if unknown:
            raise ValueError(f"PyTorchProfiler({unknown[0]}=...): not an argument of torch.profiler.profile; it takes "
                             f"{', '.join(sorted(known))}.")
        activities = profiler_kwargs.get("activities")
        cuda = torch.cuda.is_available() if activities is None else torch.profiler.ProfilerActivity.CUDA in activities
        self._sort_by_key = sort_by_key or f"{'cuda' if cuda else 'cpu'}_time_total"
        if self._sort_by_key not in self.AVAILABLE_SORT_KEYS:
            raise ValueError(f"PyTorchProfiler(sort_by_key={sort_by_key!r}): use one of "
                             f"{', '.join(sorted(self.AVAILABLE_SORT_KEYS))}.")
        table_kwargs = dict(table_kwargs or {})
        table_keys = set(inspect.signature(torch.autograd.profiler_util.EventList.table).parameters) - {"self"}
        for key in table_kwargs:
            if key in ("sort_by", "row_limit"):
                raise KeyError(f"PyTorchProfiler(table_kwargs={{{key!r}: ...}}): {key} has its own argument "
                               "(sort_by_key, row_limit).")
            if key not in table_keys:
                raise KeyError(f"PyTorchProfiler(table_kwargs={{{key!r}: ...}}): use keys of EventList.table: "
                               f"{', '.join(sorted(table_keys - {'sort_by', 'row_limit'}))}.")
        schedule = profiler_kwargs.pop("schedule", None)
        if schedule is not None and (not callable(schedule) or not isinstance(schedule(0), torch.profiler.ProfilerAction)):
            raise ValueError(f"PyTorchProfiler(schedule={schedule!r}): use torch.profiler.schedule(...), a function of "
                             "the step number that returns a torch.profiler.ProfilerAction.")
        self._schedule = schedule or torch.profiler.schedule(wait=1, warmup=1, active=3)
        self._group_by_input_shapes = group_by_input_shapes and profiler_kwargs.get("record_shapes", False)
        self._export_to_chrome, self._row_limit = export_to_chrome, row_limit
        self._record_module_names, self._table_kwargs = record_module_names, table_kwargs
        self._profiler_kwargs = profiler_kwargs
        self.profiler: Any = None  # the running torch.profiler.profile
        self.function_events: Any = None  # the events of the last recorded window
        self._recording: dict[str, Any] = {}  # action -> its open record_function
        self._module_hooks: list[Any] = []

    def start(self, action_name: str) -> None:
        if self.profiler is None:
            self.profiler = torch.profiler.profile(schedule=self._schedule, on_trace_ready=self._on_trace_ready,
                                                   **self._profiler_kwargs)
            self.profiler.start()
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
            with warnings.catch_warnings():  # each window is written when it ends: that the next starts empty is the point
                warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
                self.profiler.step()

    def _on_trace_ready(self, profile: Any) -> None:
        self.function_events = profile.events()
        if self._export_to_chrome and self.dirpath is not None:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            name = self._prepare_filename(extension="")
            profile.export_chrome_trace(os.path.join(self.dirpath, f"{name}.{profile.step_num}.pt.trace.json"))

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
            if self.function_events is None and profiler.profiler is not None:
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
