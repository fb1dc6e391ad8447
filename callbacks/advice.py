"""The performance report's figures (:class:`RunFacts`) and the advice drawn from them.

Pure functions of measured values, so every recommendation can be checked on figures a test
writes down. ``callbacks/performance.py`` measures a fit and prints what this module formats.

The advice follows what changing a setting would do, measured where a user tried it:

- **DataLoader workers** only when the per-batch wait is more than a worker's handoff costs
  (a batch from a worker process arrives through a queue and shared memory: about a millisecond);
  an in-memory dataset that assembles a batch in 0.6 ms ran at half the speed with one worker.
  The number follows from the wait and the step (enough workers to prepare a batch per step),
  and is held to the free cores only when the wait was CPU work: a dataset that waits on a disk,
  the network or a sleep gained 3.6x with 4 workers on 2 cores. The expected gain is stated.
- **Oversubscribed CPUs** (torch's threads, or other processes, wanting more cores than there
  are) make every step slower and every share meaningless: said first.
- **One-time compilation** (``callbacks.Compile``) is kept apart from the steady state: compiling
  the evaluation graph made validation look like 34-48% of a fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Shares of the batch loops (waiting for data) or of the fit (the other phases) above which the
#: report recommends a change.
DATA_WAIT_SHARE = 0.2
VALIDATION_SHARE = 0.25
CHECKPOINT_SHARE = 0.10
LOGGING_SHARE = 0.05
#: A training step shorter than this on a GPU is dominated by kernel launches: compile helps.
SHORT_STEP_SECONDS = 0.02
#: What handing one batch over from a DataLoader worker process costs the loop (queue, unpickling,
#: shared memory): about a millisecond on an idle machine, more on a busy one.
WORKER_HANDOFF_SECONDS = 0.001
#: Workers are advised only when they would make the batch loops at least this much faster.
WORTHWHILE_GAIN = 1.25
#: The most workers the report suggests.
MAX_WORKERS = 8
#: The wait counts as CPU work when the loop's thread computed at least this share of it.
CPU_BOUND_SHARE = 0.5


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
    pin_memory: bool | None = None  # the batches arrive pinned (the user's setting or the strategy's)
    persistent_workers: bool | None = None
    autocast: bool = False  # a callback's autocast, the strategy's mixed precision, or half weights
    compiled: bool = False
    compile_training: float = 0.0  # one-time compile seconds inside the training steps
    compile_validation: float = 0.0  # ... and inside validation (its sanity check included)
    log_every_n_steps: int = 50
    cpus_per_process: int = 1  # the cores this process may use, shared with its machine's other ranks
    torch_threads: int = 1  # torch's intra-op threads in this process
    local_processes: int = 1  # training processes on this machine
    load_average: float | None = None  # the machine's 1-minute load average at the end of the fit
    loop_thread_cpu: float | None = None  # CPU seconds of the loop's thread from train start to end
    loop_thread_wall: float | None = None  # wall seconds of the same span
    slowest_rank: tuple[int, float] | None = None  # (rank, its data-wait share) when another rank waited more
    microbatches: tuple[int, int] | None = None  # AutoMicrobatch's split and the global step it began at

    @property
    def batch_loops(self) -> float:
        return self.data_wait + self.training_steps

    @property
    def data_wait_share(self) -> float:
        """The data wait's share of the batch loops, one-time compilation left out."""
        loops = self.batch_loops - self.compile_training
        return self.data_wait / loops if loops > 0 else 0.0

    @property
    def compile_seconds(self) -> float:
        return self.compile_training + self.compile_validation

    @property
    def steady_step(self) -> float:
        """Seconds of one training step, its one-time compilation left out."""
        return max(0.0, self.training_steps - self.compile_training) / self.batches if self.batches else 0.0

    @property
    def wait_cpu_share(self) -> float | None:
        """How much of the data wait the loop's thread spent computing (a dataset's ``__getitem__``
        and collation without workers) rather than waiting (disk, network, sleep, workers): its CPU
        time over the training span, less the span outside data waits (in which it is busy with
        steps), over the wait. None when not measured."""
        if self.loop_thread_cpu is None or self.loop_thread_wall is None or self.data_wait <= 0:
            return None
        computing = self.loop_thread_cpu - max(0.0, self.loop_thread_wall - self.data_wait)
        return min(1.0, max(0.0, computing / self.data_wait))

    def share_of_fit(self, seconds: float) -> float:
        """``seconds`` as a share of the fit, both without one-time compilation."""
        steady = self.seconds - self.compile_seconds
        return seconds / steady if steady > 0 else 0.0


def format_report(facts: RunFacts, memory: str = "") -> str:
    """The report's text: the measured figures, then the recommendations."""
    loops = facts.batch_loops - facts.compile_training
    lines = [f"Performance report (fit): {facts.batches} training batches ({facts.optimizer_steps} optimizer steps) "
             f"in {facts.seconds:.1f} s"]
    if facts.compiled:
        lines.append(f"  one-time compiling (torch.compile): {facts.compile_training:.2f} s in training, "
                     f"{facts.compile_validation:.2f} s in validation; the figures below leave it out")
    if loops > 0 and facts.batches:
        speed = f"  training: {facts.batches / loops:.1f} batches/s"
        if facts.samples_per_batch:
            speed += f", {facts.batches * facts.samples_per_batch * facts.world_size / loops:.0f} samples/s"
            speed += f" (over {facts.world_size} processes)" if facts.world_size > 1 else ""
        lines.append(speed + f" (batch loops {loops:.1f} s; validation and log steps excluded)")
        lines.append(f"  waiting for the next batch {facts.data_wait:8.2f} s  {facts.data_wait_share:6.1%} of the batch loops")
        lines.append(f"  training steps             {loops - facts.data_wait:8.2f} s  {1 - facts.data_wait_share:6.1%}")
    validation = facts.validation - facts.compile_validation
    other = max(0.0, facts.seconds - facts.batch_loops - facts.validation - facts.checkpointing - facts.logging)
    lines.append(f"  validation {validation:.2f} s ({facts.share_of_fit(validation):.1%} of the fit), "
                 f"checkpointing {facts.checkpointing:.2f} s ({facts.share_of_fit(facts.checkpointing):.1%}), "
                 f"log steps {facts.logging:.2f} s ({facts.share_of_fit(facts.logging):.1%}); "
                 f"other (setup, epoch ends) {other:.2f} s")
    if memory:
        lines.append(f"  {memory}")
    if facts.microbatches is not None:
        count, step = facts.microbatches
        lines.append(f"  microbatches: each batch ran as {count} from global step {step} on (AutoMicrobatch: a batch ran "
                     "out of memory; the updates are the whole batch's)")
    advice = recommendations(facts)
    lines.append("Recommendations:" if advice else "Recommendations: none; no phase stands out.")
    lines += [f"  - {line}" for line in advice]
    return "\n".join(lines)


def recommendations(facts: RunFacts) -> list[str]:
    """Concrete changes suggested by what was measured, most important first."""
    advice = [line for line in (oversubscription(facts), data_loading(facts)) if line]
    if facts.device_type == "cuda" and facts.pin_memory is False:
        advice.append("pin_memory=True in the DataLoader: batches then copy to the GPU without blocking the host.")
    if (facts.num_workers and not facts.persistent_workers and facts.epochs >= 2
            and facts.batch_loops / facts.epochs < 30 and facts.data_wait_share >= DATA_WAIT_SHARE / 2):
        advice.append(f"persistent_workers=True in the DataLoader: each of the {facts.epochs} short epochs started "
                      f"{facts.num_workers} worker processes anew.")
    capability = facts.device_capability
    if facts.device_type == "cuda" and capability is not None and capability >= (7, 0) and not facts.autocast:
        dtype = "bf16" if capability >= (8, 0) else "fp16"
        advice.append(f'Mixed precision: this GPU has tensor cores (compute capability {capability[0]}.{capability[1]}); '
                      f'callbacks.AMP("{dtype}") or Trainer(precision="{dtype}-mixed") runs matrix products faster.')
    if facts.device_type == "cuda" and not facts.compiled and facts.batches and facts.steady_step < SHORT_STEP_SECONDS:
        advice.append(f"callbacks.Compile(): a training step takes {1000 * facts.steady_step:.1f} ms, short enough "
                      "that launching many small kernels dominates; compiling fuses them.")
    if facts.share_of_fit(facts.logging) >= LOGGING_SHARE:
        advice.append(f"Log steps took {facts.share_of_fit(facts.logging):.1%} of the fit: raise "
                      f"Trainer(log_every_n_steps={facts.log_every_n_steps}).")
    validation = facts.share_of_fit(facts.validation - facts.compile_validation)
    if validation >= VALIDATION_SHARE:
        advice.append(f"Validation took {validation:.1%} of the fit: validate less often "
                      "(val_check_interval, check_val_every_n_epoch) or on fewer batches (limit_val_batches).")
    if facts.share_of_fit(facts.checkpointing) >= CHECKPOINT_SHARE:
        advice.append(f"Writing checkpoints took {facts.share_of_fit(facts.checkpointing):.1%} of the fit: save less "
                      "often (ModelCheckpoint every_n_train_steps, train_time_interval).")
    return advice


def oversubscription(facts: RunFacts) -> str | None:
    """Said when this job's threads, or other processes, want more cores than this process has."""
    cores = facts.cpus_per_process
    if facts.device_type == "cpu" and facts.torch_threads > cores:
        return (f"The CPU is oversubscribed: torch runs {facts.torch_threads} threads in each of {facts.local_processes} "
                f"process(es), and each process has {cores} core(s); threads wait for a core, so steps run slower than "
                f"this machine can run them and every share below is distorted. Call torch.set_num_threads({cores}) "
                f"(or set OMP_NUM_THREADS={cores}) before training.")
    if facts.load_average is None:
        return None
    machine = cores * facts.local_processes
    step_threads = min(cores, facts.torch_threads) if facts.device_type == "cpu" else 1
    own = facts.local_processes * (step_threads + (facts.num_workers or 0))  # DataLoader workers are this run's too
    others = facts.load_average - own
    if others < max(1.0, machine / 2):
        return None
    return (f"The CPU is oversubscribed: the machine's load average was {facts.load_average:.1f} on the {machine} core(s) "
            f"this run may use, about {others:.1f} of it from other processes; threads wait for a core, so steps run "
            "slower than this machine can run them (on a shared 2-core machine, up to 70x) and every share below is "
            "distorted. Measure again on a quiet machine, or give this run cores of its own (taskset, a job "
            "scheduler's CPU allocation) and torch.set_num_threads to match.")


def data_loading(facts: RunFacts) -> str | None:
    """Advice when the loop waits for its batches: workers where they pay, with the expected gain."""
    share = facts.data_wait_share
    if share < DATA_WAIT_SHARE or not facts.batches:
        return None
    wait, step = facts.data_wait / facts.batches, facts.steady_step
    waited = f"The loop waited for the next batch {share:.1%} of the time ({1000 * wait:.1f} ms a batch)"
    if facts.slowest_rank is not None:
        waited += f" (rank {facts.slowest_rank[0]}: {facts.slowest_rank[1]:.1%})"
    workers = facts.num_workers
    if workers is None:
        return (f"{waited}: the training loader is not a DataLoader; make its batches cheaper to produce or "
                "produce them in background processes.")
    free_cores = facts.cpus_per_process - (min(facts.torch_threads, facts.cpus_per_process) if facts.device_type == "cpu" else 1)
    computing = facts.wait_cpu_share
    if workers == 0:
        per_batch_work = wait
        cpu_bound = computing is not None and computing >= CPU_BOUND_SHARE
    else:  # the workers deliver a batch every (step + wait); each worker needs `workers` times that per batch
        per_batch_work = workers * (step + wait)
        cpu_bound = None  # the workers' CPU time is not measured
    needed = min(MAX_WORKERS, max(1, math.ceil(per_batch_work / max(step, 1e-4))))
    suggested = min(needed, max(0, free_cores)) if cpu_bound else needed
    now = 1.0 / (step + wait)
    then = 1.0 / max(step + WORKER_HANDOFF_SECONDS, per_batch_work / suggested) if suggested > workers else now
    if suggested <= workers or then / now < WORTHWHILE_GAIN:
        if workers == 0 and wait < 2 * WORKER_HANDOFF_SECONDS:
            return (f"{waited}, about what handing a batch over from a DataLoader worker process costs, so workers would "
                    "not help: assemble batches more cheaply (index an in-memory dataset a batch at a time: "
                    "DataLoader(dataset, sampler=BatchSampler(...), batch_size=None), or keep the data on the GPU).")
        if cpu_bound and free_cores < 1:
            return (f"{waited}; preparing a batch is CPU work, and the training step's {facts.torch_threads} torch "
                    f"thread(s) use this process's {facts.cpus_per_process} core(s): workers would take cores from the "
                    "step. Make __getitem__ cheaper (preprocess once and cache, decode on the GPU).")
        return (f"{waited}, with num_workers={workers}: make __getitem__ cheaper (preprocess once and cache, decode on "
                "the GPU); more workers would not keep up with the step.")
    how = (f"preparing a batch was CPU work, so {suggested} is what this process's {facts.cpus_per_process} core(s) leave "
           "beside the training step" if cpu_bound else
           f"{needed} prepare a batch per training step; if __getitem__ mostly waits (disk, network), workers beyond "
           f"this process's {facts.cpus_per_process} core(s) still help, if it computes, more than "
           f"{max(1, free_cores)} compete with the step for cores")
    return (f"{waited}: raise the DataLoader's num_workers (now {workers}) to {suggested} so that batches are prepared "
            f"while the model trains ({how}). Expected: about {then / now:.1f}x the training batches per second "
            f"({now:.0f} -> {then:.0f}).")
