"""The performance report: at the end of ``fit``, where the time went and what to change.

``Trainer(report=True)`` (the default) adds a :class:`PerformanceReport`. At the end of ``fit``,
rank zero prints it to stderr and saves it as ``<log_dir>/performance_report.txt`` (when the run
has a log directory: loggers or checkpoints)::

    Performance report (fit): 300 training batches (300 optimizer steps) in 4.1 s
      training: 73.4 batches/s, 2349 samples/s (batch loops 4.1 s; validation and log steps excluded)
      waiting for the next batch   3.2 s   78.9% of the batch loops
      training steps               0.9 s   21.1%
      validation 0.0 s, checkpointing 0.0 s, log steps 0.0 s; other (setup, epoch ends) 0.1 s
      peak memory: host RSS 412 MiB
    Recommendations:
      - The loop waited for the next batch 78.9% of the time ...

Measuring costs no device sync: the Trainer reads the host clock twice a batch
(``trainer/timing.py``), memory is read once, at the end. On an accelerator the host runs ahead
of the device, so a step that launches work quickly looks short; the data wait is still the time
the device had nothing new to do. ``callbacks.Profiler`` measures the device itself.
This is also what ``Trainer(profiler="simple")`` gives (Lightning's SimpleProfiler times every
hook; timing each hook would cost every step, so Cadence times the phases of the loop instead).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Shares of the batch loops (waiting for data) or of the fit (the other phases) above which the
#: report recommends a change.
DATA_WAIT_SHARE = 0.2
VALIDATION_SHARE = 0.25
CHECKPOINT_SHARE = 0.10
LOGGING_SHARE = 0.05
#: A training step shorter than this on a GPU is dominated by kernel launches: compile helps.
SHORT_STEP_SECONDS = 0.02
#: Below this wait per batch, DataLoader workers would not help: handing a batch over from a
#: worker process costs about as much (an in-memory TensorDataset feeding a tiny model waits
#: ~0.05 ms a batch, a large share of a tiny step, and needs no workers).
WORKER_WORTHY_WAIT_SECONDS = 0.0005


@dataclass
class RunFacts:
    """What one fit measured, and the settings the recommendations look at."""

    seconds: float  # the whole fit on this rank, setup to on_fit_end
    data_wait: float
    training_steps: float
    validation: float
    checkpointing: float
    logging: float
    batches: int
    optimizer_steps: int
    epochs: int
    samples_per_batch: int | None = None
    world_size: int = 1
    device_type: str = "cpu"
    device_capability: tuple[int, int] | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    autocast: bool = False
    compiled: bool = False
    log_every_n_steps: int = 50
    cpus_per_process: int = 1
    slowest_rank: tuple[int, float] | None = None  # (rank, its data-wait share) when another rank waited more

    @property
    def batch_loops(self) -> float:
        return self.data_wait + self.training_steps

    @property
    def data_wait_share(self) -> float:
        return self.data_wait / self.batch_loops if self.batch_loops > 0 else 0.0

    def share_of_fit(self, seconds: float) -> float:
        return seconds / self.seconds if self.seconds > 0 else 0.0


class PerformanceReport(Callback):
    """Print and save where the time of ``fit`` went, with recommendations drawn from it.

    Added by ``Trainer(report=True)`` (the default); ``report=False`` leaves it out.
    After ``fit``, ``report.text`` holds the report and ``report.facts`` the measured figures.
    """

    def __init__(self) -> None:
        self.text = ""
        self.facts: RunFacts | None = None
        self._start: tuple[float, dict[str, float]] | None = None  # at setup: clock, phase totals
        self._first = (0, 0)  # at fit start: global step, epoch

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit":
            self._start = (time.perf_counter(), trainer.phase_times.totals())

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._first = (trainer.global_step, trainer.current_epoch)  # after a checkpoint was restored

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._start is None:
            return
        facts = measure_run(trainer, module, *self._start, *self._first)
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
        if log_dir is not None and (trainer.loggers or log_dir.exists()):
            log_dir.mkdir(parents=True, exist_ok=True)
            (log_dir / "performance_report.txt").write_text(self.text + "\n")

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit":
            self._start = None


def measure_run(trainer: Trainer, module: TrainingModule, started: float, before: dict[str, float],
                first_step: int, first_epoch: int) -> RunFacts:
    """The figures of the fit that began at ``started`` with the phase totals ``before``."""
    after = trainer.phase_times.totals()
    spent = {key: after[key] - before[key] for key in after}
    loader = trainer.train_dataloader
    device = module.device
    return RunFacts(
        seconds=time.perf_counter() - started, data_wait=spent["data_wait"], training_steps=spent["training_steps"],
        validation=spent["validation"], checkpointing=spent["checkpointing"], logging=spent["logging"],
        batches=int(spent["batches"]), optimizer_steps=trainer.global_step - first_step,
        epochs=trainer.current_epoch - first_epoch, samples_per_batch=batch_size(loader),
        world_size=trainer.world_size, device_type=device.type,
        device_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        num_workers=getattr(loader, "num_workers", None), pin_memory=getattr(loader, "pin_memory", None),
        persistent_workers=getattr(loader, "persistent_workers", None),
        autocast=any(type(c).forward_context is not Callback.forward_context for c in trainer.callbacks)
        or any(p.dtype in (torch.float16, torch.bfloat16) for p in module.parameters()),
        compiled=any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()),
        log_every_n_steps=trainer.log_every_n_steps, cpus_per_process=cpus_per_process(trainer),
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


def cpus_per_process(trainer: Trainer) -> int:
    """The CPU cores this process may use, shared with the other processes of its machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.world_size))
    return max(1, cores // max(1, local))


def memory_line(device: torch.device) -> str:
    """Peak host memory of this process, and of the device when there is one (read once, no sync)."""
    parts = []
    try:
        import resource  # Unix only; loaded when a report is made
    except ImportError:
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        parts.append(f"host RSS {_size(peak * (1 if sys.platform == 'darwin' else 1024))}")  # macOS: bytes; Linux: KiB
    if device.type == "cuda":
        parts.append(f"{device} {_size(torch.cuda.max_memory_allocated(device))} allocated "
                     f"({_size(torch.cuda.max_memory_reserved(device))} reserved)")
    elif device.type == "mps":
        parts.append(f"mps {_size(torch.mps.driver_allocated_memory())} allocated by the driver (now, not peak)")
    return "peak memory: " + "; ".join(parts) if parts else ""


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def format_report(facts: RunFacts, memory: str = "") -> str:
    """The report's text: the measured figures, then the recommendations."""
    loops = facts.batch_loops
    lines = [f"Performance report (fit): {facts.batches} training batches ({facts.optimizer_steps} optimizer steps) "
             f"in {facts.seconds:.1f} s"]
    if loops > 0 and facts.batches:
        speed = f"  training: {facts.batches / loops:.1f} batches/s"
        if facts.samples_per_batch:
            speed += f", {facts.batches * facts.samples_per_batch * facts.world_size / loops:.0f} samples/s"
            speed += f" (over {facts.world_size} processes)" if facts.world_size > 1 else ""
        lines.append(speed + f" (batch loops {loops:.1f} s; validation and log steps excluded)")
        lines.append(f"  waiting for the next batch {facts.data_wait:8.2f} s  {facts.data_wait_share:6.1%} of the batch loops")
        lines.append(f"  training steps             {facts.training_steps:8.2f} s  {1 - facts.data_wait_share:6.1%}")
    other = max(0.0, facts.seconds - loops - facts.validation - facts.checkpointing - facts.logging)
    lines.append(f"  validation {facts.validation:.2f} s ({facts.share_of_fit(facts.validation):.1%} of the fit), "
                 f"checkpointing {facts.checkpointing:.2f} s ({facts.share_of_fit(facts.checkpointing):.1%}), "
                 f"log steps {facts.logging:.2f} s ({facts.share_of_fit(facts.logging):.1%}); "
                 f"other (setup, epoch ends) {other:.2f} s")
    if memory:
        lines.append(f"  {memory}")
    advice = recommendations(facts)
    lines.append("Recommendations:" if advice else "Recommendations: none; no phase stands out.")
    lines += [f"  - {line}" for line in advice]
    return "\n".join(lines)


def recommendations(facts: RunFacts) -> list[str]:
    """Concrete changes suggested by what was measured, most important first."""
    advice = []
    share = facts.data_wait_share
    if share >= DATA_WAIT_SHARE and facts.batches and facts.data_wait / facts.batches >= WORKER_WORTHY_WAIT_SECONDS:
        waited = (f"The loop waited for the next batch {share:.1%} of the time "
                  f"({1000 * facts.data_wait / facts.batches:.1f} ms a batch)")
        if facts.slowest_rank is not None:
            waited += f" (rank {facts.slowest_rank[0]}: {facts.slowest_rank[1]:.1%})"
        workers = facts.num_workers
        suggested = max(1, min(8, facts.cpus_per_process - 1))
        if workers is None:
            advice.append(f"{waited}: the training loader is not a DataLoader; make its batches cheaper to produce "
                          "or produce them in background processes.")
        elif workers < suggested:
            advice.append(f"{waited}: raise the DataLoader's num_workers (now {workers}) to {suggested} "
                          f"(this process has {facts.cpus_per_process} CPU cores) so that batches are prepared "
                          "while the model trains.")
        else:
            advice.append(f"{waited}, with num_workers={workers} already using the {facts.cpus_per_process} CPU cores "
                          "of this process: make __getitem__ cheaper (preprocess once and cache, decode on the GPU).")
    if facts.device_type == "cuda" and facts.pin_memory is False:
        advice.append("pin_memory=True in the DataLoader: batches then copy to the GPU without blocking the host.")
    if (facts.num_workers and not facts.persistent_workers and facts.epochs >= 2
            and facts.batch_loops / facts.epochs < 30 and share >= DATA_WAIT_SHARE / 2):
        advice.append(f"persistent_workers=True in the DataLoader: each of the {facts.epochs} short epochs started "
                      f"{facts.num_workers} worker processes anew.")
    capability = facts.device_capability
    if facts.device_type == "cuda" and capability is not None and capability >= (7, 0) and not facts.autocast:
        dtype = "bf16" if capability >= (8, 0) else "fp16"
        advice.append(f'Mixed precision: this GPU has tensor cores (compute capability {capability[0]}.{capability[1]}); '
                      f'callbacks.AMP("{dtype}") or Trainer(precision="{dtype}-mixed") runs matrix products faster.')
    if (facts.device_type == "cuda" and not facts.compiled and facts.batches
            and facts.training_steps / facts.batches < SHORT_STEP_SECONDS):
        step_ms = 1000 * facts.training_steps / facts.batches
        advice.append(f"callbacks.Compile(): a training step takes {step_ms:.1f} ms, short enough that launching "
                      "many small kernels dominates; compiling fuses them.")
    if facts.share_of_fit(facts.logging) >= LOGGING_SHARE:
        advice.append(f"Log steps took {facts.share_of_fit(facts.logging):.1%} of the fit: raise "
                      f"Trainer(log_every_n_steps={facts.log_every_n_steps}).")
    if facts.share_of_fit(facts.validation) >= VALIDATION_SHARE:
        advice.append(f"Validation took {facts.share_of_fit(facts.validation):.1%} of the fit: validate less often "
                      "(val_check_interval, check_val_every_n_epoch) or on fewer batches (limit_val_batches).")
    if facts.share_of_fit(facts.checkpointing) >= CHECKPOINT_SHARE:
        advice.append(f"Writing checkpoints took {facts.share_of_fit(facts.checkpointing):.1%} of the fit: save less "
                      "often (ModelCheckpoint every_n_train_steps, train_time_interval).")
    return advice
