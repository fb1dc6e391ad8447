"""The performance report: at the end of ``fit``, where the time went and what to change.

``Trainer(report=True)`` (the default) adds a :class:`PerformanceReport`. At the end of ``fit``,
rank zero prints it to stderr and saves it as ``<log_dir>/performance_report.txt`` (when the run
has a log directory: loggers or checkpoints)::

    Performance report (fit): 300 training batches (300 optimizer steps) in 4.1 s
      training: 73.4 batches/s, 2349 samples/s (batch loops 4.1 s; validation and log steps excluded)
      waiting for the next batch   3.2 s   78.9% of the batch loops
      training steps               0.9 s   21.1%
      validation 0.0 s, checkpointing 0.0 s, log steps 0.0 s; other (setup, epoch ends) 0.1 s
      peak memory: host RSS 412 MiB (the process's)
    Recommendations:
      - The loop waited for the next batch 78.9% of the time ...

Measuring costs no device sync: the Trainer reads the host clock twice a batch
(``trainer/timing.py``); the loop thread's CPU time is read when training starts and ends, memory
and the load average once, at the end. The callbacks and the strategy say what they changed
(``performance_facts``: autocast, compile and its one-time seconds; ``compute_dtype``: FSDP's
mixed precision). The advice is drawn in ``callbacks/advice.py``. On an accelerator the host runs ahead
of the device, so a step that launches work quickly looks short; the data wait is still the time
the device had nothing new to do. ``callbacks.Profiler`` measures the device itself.
This is also what ``Trainer(profiler="simple")`` gives (Lightning's SimpleProfiler times every
hook; timing each hook would cost every step, so Cadence times the phases of the loop instead).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.advice import RunFacts, format_report
from callbacks.base import Callback, defines
from strategies.transfer import pins_batches

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


_clock = time.perf_counter  # bound at import, as the loop's clock (trainer/timing.py PhaseTimes.clock)


class PerformanceReport(Callback):
    """Print and save where the time of ``fit`` went, with recommendations drawn from it.

    Added by ``Trainer(report=True)`` (the default); ``report=False`` leaves it out.
    After ``fit``, ``report.text`` holds the report and ``report.facts`` the measured figures
    (:class:`callbacks.advice.RunFacts`). The GPU's peak memory is this fit's: it is reset when
    the fit starts.
    """

    def __init__(self) -> None:
        self.text = ""
        self.facts: RunFacts | None = None
        self._start: tuple[float, dict[str, float]] | None = None  # at setup: clock, phase totals
        self._first = (0, 0)  # at fit start: global step, epoch
        self._loop_thread: tuple[float, float] | None = None  # at train start: thread CPU time, clock

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit":
            self._start = (_clock(), trainer.phase_times.totals())
            self._loop_thread = None
            device = trainer.strategy.device
            if device.type == "cuda":  # the report's peak is this fit's, not the process's
                torch.cuda.reset_peak_memory_stats(device)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._first = (trainer.global_step, trainer.current_epoch)  # after a checkpoint was restored

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._loop_thread = (time.thread_time(), _clock())  # the loop runs in this thread

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._start is None:
            return
        facts = measure_run(trainer, module, *self._start, *self._first, self._loop_thread)
        shares = trainer.strategy.all_gather_object(facts.data_wait_share)  # one collective, at the end
        slowest = max(range(len(shares)), key=shares.__getitem__)
        if shares[slowest] > facts.data_wait_share:
            facts.slowest_rank = (slowest, shares[slowest])
        if facts.batches == 0:  # fit trained nothing (its end was reached already): nothing to report
            return
        self.facts, self.text = facts, format_report(facts, memory_line(module.device))
        if not trainer.is_global_zero:
            return
        print(self.text, file=sys.stderr, flush=True)
        log_dir = Path(trainer.log_dir) if trainer.log_dir is not None else None
        # Without a logger, log_dir is default_root_dir: nothing there; fast_dev_run writes nothing (its DummyLogger).
        if log_dir is not None and trainer.loggers and not trainer.fast_dev_run:
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "performance_report.txt").write_text(self.text + "\n")

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit":
            self._start = None


def measure_run(trainer: Trainer, module: TrainingModule, started: float, before: dict[str, float],
                first_step: int, first_epoch: int, loop_thread: tuple[float, float] | None = None) -> RunFacts:
    """The figures of the fit that began at ``started`` with the phase totals ``before``;
    ``loop_thread`` is the loop thread's CPU time and the clock when training started."""
    after = trainer.phase_times.totals()
    spent = {key: after[key] - before[key] for key in after}
    loader = trainer.train_dataloader
    device = module.device
    facts: dict[str, Any] = {}  # what the callbacks and the strategy say they changed
    for callback in trainer.callbacks:
        if defines(callback, "performance_facts"):
            facts.update(callback.performance_facts())
    compile_seconds = facts.get("compile_seconds", {})
    half_weights = any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.world_size))
    return RunFacts(
        seconds=_clock() - started, data_wait=spent["data_wait"], training_steps=spent["training_steps"],
        validation=spent["validation"], checkpointing=spent["checkpointing"], logging=spent["logging"],
        batches=int(spent["batches"]), optimizer_steps=trainer.global_step - first_step,
        epochs=trainer.current_epoch - first_epoch, samples_per_batch=batch_size(loader),
        world_size=trainer.world_size, device_type=device.type,
        device_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        num_workers=getattr(loader, "num_workers", None), pin_memory=pins_batches(loader) if loader is not None else None,
        persistent_workers=getattr(loader, "persistent_workers", None),
        autocast=facts.get("autocast") is not None or trainer.strategy.compute_dtype() is not None or half_weights,
        compiled=bool(facts.get("compiled")), compile_training=compile_seconds.get("training", 0.0),
        compile_validation=compile_seconds.get("validation", 0.0), log_every_n_steps=trainer.log_every_n_steps,
        cpus_per_process=max(1, cores // max(1, local)), torch_threads=torch.get_num_threads(), local_processes=local,
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        loop_thread_cpu=time.thread_time() - loop_thread[0] if loop_thread else None,
        loop_thread_wall=_clock() - loop_thread[1] if loop_thread else None,
        microbatches=facts.get("microbatches"),
    )


def batch_size(loader: Any) -> int | None:
    """Samples per batch: the loader's ``batch_size``, its (wrapped) batch sampler's, or that of a
    sampler yielding whole batches (``batch_size=None``); None if unknown."""
    size, sampler = getattr(loader, "batch_size", None), getattr(loader, "batch_sampler", None)
    while size is None and sampler is not None:
        size, sampler = getattr(sampler, "batch_size", None), getattr(sampler, "batch_sampler", None)
    if size is None:
        size = getattr(getattr(loader, "sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def memory_line(device: torch.device) -> str:
    """Peak host memory of this process, and of the device when there is one (read once, no sync)."""
    parts = []
    try:
        import resource  # Unix only; loaded when a report is made
    except ImportError:
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # macOS: bytes; Linux: KiB. The operating system keeps one peak per process, not per fit.
        parts.append(f"host RSS {_size(peak * (1 if sys.platform == 'darwin' else 1024))} (the process's)")
    if device.type == "cuda":
        parts.append(f"{device} {_size(torch.cuda.max_memory_allocated(device))} allocated "
                     f"({_size(torch.cuda.max_memory_reserved(device))} reserved) in this fit")
    elif device.type == "mps":
        parts.append(f"mps {_size(torch.mps.driver_allocated_memory())} allocated by the driver (now, not peak)")
    return "peak memory: " + "; ".join(parts) if parts else ""


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"
