"""The workloads the benchmarks time: models, data, a hand-written loop and the framework runs.

Every contender trains the same model on the same batches for one epoch of ``steps`` optimizer
steps. A contender and the hand loop run in lockstep (two processes taking turns every
``segment`` steps, see :class:`Lockstep`), so each pair of segments meets the same machine;
fixed costs (building a Trainer, starting logger threads, the end-of-epoch checkpoint) stay
outside the timed segments.

Contenders:
    hand               the loop a user writes without a framework (the baseline)
    cadence-lean       Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    cadence-users      Trainer() defaults; training_step calls self.log(..., prog_bar=True)
    lightning-lean     the same two configurations in PyTorch Lightning, when it is installed
    lightning-users
    hand-again         the hand loop paired with itself: its "overhead" is the noise floor
    hand-bf16          the hand loop with forward and loss under torch.autocast(bfloat16)
    cadence-bf16-lean  cadence-lean with callbacks=[AMP("bf16")], measured against hand-bf16
                       (``baseline_of``), so its overhead is Cadence's, not autocast's
    hand-clipped       the hand loop with clip_grad_norm_(network.parameters(), 1.0) before each step
    cadence-clipped-lean  cadence-lean with gradient_clip_val=1.0, measured against hand-clipped

Used by ``overhead.py`` and ``parity.py``; ``ddp_bench.py`` has its own 2-process workload.
"""

from __future__ import annotations

import contextlib
import os
import sys
import json
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from trainer import Trainer, TrainingModule  # noqa: E402


@dataclass(frozen=True)
class Workload:
    """A model shape and a data size. One epoch is ``steps`` batches."""

    name: str
    width: int
    depth: int  # number of Linear layers
    batch_size: int
    steps: int  # batches in the one epoch each run trains
    warmup_steps: int  # batches before the first timed segment
    segment: int  # steps per timed segment; log_every_n_steps (50) for tiny: one log step each
    threads: int


# Segment boundaries fall between log steps (every 50th batch ends one), so the logger thread's
# work for a log step is done inside the segment that logged it, not in the other runner's.
TINY = Workload("tiny", width=32, depth=2, batch_size=32, steps=2000, warmup_steps=125, segment=50, threads=1)
MEDIUM = Workload("medium", width=1024, depth=4, batch_size=256, steps=111, warmup_steps=10, segment=10, threads=2)
WORKLOADS = {"tiny": TINY, "medium": MEDIUM}


def make_network(workload: Workload) -> nn.Sequential:
    """``depth`` Linear layers of ``width`` with ReLUs between them, ending in one output."""
    layers: list[nn.Module] = []
    for index in range(workload.depth):
        out_features = 1 if index == workload.depth - 1 else workload.width
        layers.append(nn.Linear(workload.width, out_features))
        if index < workload.depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Lockstep:
    """Two processes that take turns, one segment of steps at a time, so both see the same machine.

    On a shared machine (a VM whose host is busy) the speed of a core changes over seconds; a
    pair of segments run back to back, milliseconds apart, meets the same conditions, while two
    whole runs do not. The runs live in two forked processes, each in its own main thread, so
    neither gets a different thread, allocator arena or interpreter lock than the other. A run
    hands the turn over by writing a byte into the other's pipe and then blocks reading its own,
    so the waiting process takes no CPU.

    Args:
        read_fd: the pipe this run waits on.
        write_fd: the pipe the other run waits on.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.other_finished = False

    def wait_for_turn(self) -> None:
        if not self.other_finished and os.read(self.read_fd, 1) == b"":
            self.other_finished = True  # its end of the pipe closed: run on without waiting

    def pass_turn(self) -> None:
        if self.other_finished:
            return
        try:
            os.write(self.write_fd, b".")
        except BrokenPipeError:
            self.other_finished = True

    def finish(self) -> None:
        """Hand the turn over for good: the other run continues alone."""
        self.pass_turn()
        os.close(self.write_fd)
        self.other_finished = True


class ClockedBatchSampler(BatchSampler):
    """A shuffling BatchSampler that times segments of ``segment`` steps after ``start`` and, with
    a :class:`Lockstep`, takes turns with the other run at each segment boundary.

    The switch happens while the sampler is asked for a batch, outside the timed segments. Every
    contender fetches batches through it the same way, so it costs them all the same. A loop that
    fetches one batch ahead (Lightning) shifts every boundary by one batch, which keeps the number
    of steps per segment.
    """

    def __init__(self, num_samples: int, batch_size: int, start: int, segment: int, seed: int,
                 lockstep: Lockstep | None) -> None:
        super().__init__(RandomSampler(range(num_samples), generator=torch.Generator().manual_seed(seed)),
                         batch_size, drop_last=False)
        self.start, self.segment, self.lockstep = start, segment, lockstep
        self.durations: list[float] = []

    def __iter__(self):
        self.durations = []
        last = len(self) - 1
        began = None
        for index, batch in enumerate(super().__iter__()):
            if index == last:
                if self.lockstep is not None:
                    self.lockstep.finish()  # the last step runs untimed
            elif index >= self.start and (index - self.start) % self.segment == 0:
                now = time.perf_counter()
                if began is not None:
                    self.durations.append(now - began)
                if self.lockstep is not None:
                    self.lockstep.pass_turn()
                    self.lockstep.wait_for_turn()
                began = time.perf_counter()
            yield batch


def make_loader(workload: Workload, lockstep: Lockstep | None = None, seed: int = 0) -> DataLoader:
    """An in-memory TensorDataset of one epoch, shuffled by its own seeded generator; its batch
    sampler times segments, in turn with another run when given a ``lockstep``."""
    generator = torch.Generator().manual_seed(seed)
    samples = workload.steps * workload.batch_size
    inputs = torch.randn(samples, workload.width, generator=generator)
    targets = inputs[:, :1] * 0.5 + 0.1 * torch.randn(samples, 1, generator=generator)
    sampler = ClockedBatchSampler(samples, workload.batch_size, workload.warmup_steps, workload.segment, seed + 1,
                                  lockstep)
    return DataLoader(TensorDataset(inputs, targets), batch_sampler=sampler, num_workers=0)


def make_optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)


def initial_network(workload: Workload, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return make_network(workload)


# --------------------------------------------------------------------------------------------
# The baseline: the loop written by hand
# --------------------------------------------------------------------------------------------
def hand_loop(network: nn.Module, loader: DataLoader) -> None:
    optimizer = make_optimizer(network.parameters())
    network.train()
    for inputs, targets in loader:
        loss = F.mse_loss(network(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def hand_loop_bf16(network: nn.Module, loader: DataLoader) -> None:
    """The hand loop with forward and loss under bfloat16 autocast (backward outside it), as AMP does."""
    optimizer = make_optimizer(network.parameters())
    network.train()
    for inputs, targets in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(network(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def hand_loop_clipped(network: nn.Module, loader: DataLoader) -> None:
    """The hand loop with the gradients clipped to norm 1 before each step, as a script writes it."""
    optimizer = make_optimizer(network.parameters())
    network.train()
    for inputs, targets in loader:
        loss = F.mse_loss(network(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# Cadence
# --------------------------------------------------------------------------------------------
class CadenceRegressor(TrainingModule):
    """The hand loop's step as a TrainingModule; ``log_every_step`` is the as-users-run variant."""

    def __init__(self, network: nn.Module, log_every_step: bool) -> None:
        super().__init__()
        self.network = network
        self.log_every_step = log_every_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.mse_loss(self.network(inputs), targets)
        if self.log_every_step:
            self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


def cadence_fit(network: nn.Module, loader: DataLoader, users: bool, root: str, **options: Any) -> None:
    module = CadenceRegressor(network, log_every_step=users)
    if users:
        trainer = Trainer(max_epochs=1, strategy="cpu", default_root_dir=root, **options)
    else:
        trainer = Trainer(max_epochs=1, strategy="cpu", default_root_dir=root,
                          logger=False, enable_progress_bar=False, enable_checkpointing=False, **options)
    trainer.fit(module, loader)


def lean_with_idle_thread(network: nn.Module, loader: DataLoader, root: str) -> None:
    """cadence-lean in a process that has started one more thread, which waits forever: glibc's malloc
    and free take their arena lock from then on (the loggers' writer threads bring this cost too)."""
    import threading

    threading.Thread(target=threading.Event().wait, name="idle", daemon=True).start()
    cadence_fit(network, loader, False, root)


def lean_after_a_thread(network: nn.Module, loader: DataLoader, root: str) -> None:
    """cadence-lean in a process that started one more thread and joined it before training: what a
    process pays on for having had a second thread (glibc keeps its locked paths from then on)."""
    import threading

    thread = threading.Thread(target=lambda: None, name="ended")
    thread.start()
    thread.join()
    cadence_fit(network, loader, False, root)


def cadence_bf16_fit(network: nn.Module, loader: DataLoader, root: str) -> None:
    from callbacks import AMP

    cadence_fit(network, loader, False, root, callbacks=[AMP("bf16")])


# --------------------------------------------------------------------------------------------
# PyTorch Lightning (optional: pip install .[bench])
# --------------------------------------------------------------------------------------------
def lightning_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lightning")
    except Exception:
        return None


def lightning_fit(network: nn.Module, loader: DataLoader, users: bool, root: str) -> None:
    import lightning as L

    class LightningRegressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network = network

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            loss = F.mse_loss(self.network(inputs), targets)
            if users:
                self.log("train/loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    if users:
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root)
    else:
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False)
    trainer.fit(LightningRegressor(), loader)


# --------------------------------------------------------------------------------------------
# Timing one run
# --------------------------------------------------------------------------------------------
def contenders(variants: bool = False) -> dict[str, Callable[..., None]]:
    """Name -> function(network, loader, root); Lightning only when it is installed.

    ``variants`` adds Cadence configurations that are run only when named: ``cadence-lean-no-report``
    (``report=False``), ``cadence-lean-profiled`` (a Profiler whose one-batch schedule ends on the
    first batch, so the other batches pay what a finished profiler costs) and
    ``cadence-lean-microbatch`` (``AutoMicrobatch()``, whose batches fit: what the seam costs); and the
    parts of ``cadence-users``, to split its cost over lean (benchmarks/RESULTS.md, round 6 overhead):
    ``cadence-lean-thread`` (lean after starting one Python thread that never wakes: what a process pays
    for having a second thread), ``cadence-lean-thread-ended`` (lean after a thread that started and ended: what
    it pays for having had one), ``cadence-users-nologgers`` (``logger=False``: ``self.log``, the bar and
    the checkpoint callback), ``cadence-users-nolog`` (``log_every_n_steps=100000``: the loggers present,
    no log step), ``cadence-users-csvonly`` and ``cadence-users-tbonly`` (one default logger each).
    """
    found: dict[str, Callable[..., None]] = {
        "hand": lambda network, loader, root: hand_loop(network, loader),
        "cadence-lean": lambda network, loader, root: cadence_fit(network, loader, False, root),
        "cadence-users": lambda network, loader, root: cadence_fit(network, loader, True, root),
    }
    found["hand-again"] = found["hand"]  # the hand loop paired with itself: the noise floor
    found["hand-bf16"] = lambda network, loader, root: hand_loop_bf16(network, loader)
    found["cadence-bf16-lean"] = cadence_bf16_fit
    found["hand-clipped"] = lambda network, loader, root: hand_loop_clipped(network, loader)
    found["cadence-clipped-lean"] = lambda network, loader, root: cadence_fit(network, loader, False, root,
                                                                               gradient_clip_val=1.0)
    if variants:
        from callbacks import AutoMicrobatch, CSVLogger, Profiler, TensorBoardLogger

        found["cadence-lean-no-report"] = lambda network, loader, root: cadence_fit(network, loader, False, root, report=False)
        found["cadence-lean-microbatch"] = lambda network, loader, root: cadence_fit(
            network, loader, False, root, callbacks=[AutoMicrobatch()])
        found["cadence-lean-profiled"] = lambda network, loader, root: cadence_fit(
            network, loader, False, root, callbacks=[Profiler(wait=0, warmup=0, active=1, record_shapes=False, profile_memory=False)])
        found["cadence-lean-thread"] = lean_with_idle_thread
        found["cadence-lean-thread-ended"] = lean_after_a_thread
        found["cadence-users-nologgers"] = lambda network, loader, root: cadence_fit(network, loader, True, root, logger=False)
        found["cadence-users-nolog"] = lambda network, loader, root: cadence_fit(network, loader, True, root,
                                                                                  log_every_n_steps=100000)
        found["cadence-users-csvonly"] = lambda network, loader, root: cadence_fit(network, loader, True, root,
                                                                                    logger=CSVLogger())
        found["cadence-users-tbonly"] = lambda network, loader, root: cadence_fit(network, loader, True, root,
                                                                                   logger=TensorBoardLogger())
    if lightning_version() is not None:
        found["lightning-lean"] = lambda network, loader, root: lightning_fit(network, loader, False, root)
        found["lightning-users"] = lambda network, loader, root: lightning_fit(network, loader, True, root)
    return found


#: The loop a contender is compared with when it is not the plain hand loop.
BASELINES = {"cadence-bf16-lean": "hand-bf16", "cadence-clipped-lean": "hand-clipped"}


def baseline_of(name: str) -> str:
    """The contender ``name`` is measured against: the hand loop doing the same math."""
    return BASELINES.get(name, "hand")


def run_once(contender: Callable[..., None], workload: Workload, loader: DataLoader) -> None:
    """One epoch of ``contender`` on a fresh copy of the initial network, in a temporary root."""
    network = initial_network(workload)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        contender(network, loader, root)


def time_pair(contender: Callable[..., None], workload: Workload, contender_first: bool,
              baseline: str = "hand") -> tuple[list[float], list[float]]:
    """Run ``contender`` and the ``baseline`` hand loop in lockstep; return their segment times per step.

    Each run is a forked child of this process (which imported everything, ran nothing, and
    so forks cleanly even with several torch threads). ``contender_first`` says who starts.
    """
    hand = contenders()[baseline]
    runs = [contender, hand] if contender_first else [hand, contender]
    turns = [os.pipe(), os.pipe()]  # turns[k]: what run k waits on
    results = [os.pipe(), os.pipe()]
    children = []
    for k in (0, 1):
        child = os.fork()
        if child == 0:  # the child: run, report, leave without running the parent's cleanup
            status = 1
            try:
                for fd in (turns[k][1], turns[1 - k][0], results[k][0], *results[1 - k]):
                    os.close(fd)
                lockstep = Lockstep(read_fd=turns[k][0], write_fd=turns[1 - k][1])
                lockstep.wait_for_turn()
                loader = make_loader(workload, lockstep)
                run_once(runs[k], workload, loader)
                report, status = {"durations": loader.batch_sampler.durations}, 0
            except BaseException:
                report = {"error": traceback.format_exc()}
            finally:
                with os.fdopen(results[k][1], "w") as out:
                    out.write(json.dumps(report))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        children.append(child)
    os.write(turns[0][1], b".")  # run 0 starts
    for fd in (*turns[0], *turns[1], results[0][1], results[1][1]):
        os.close(fd)
    reports = []
    for k in (0, 1):
        with os.fdopen(results[k][0]) as answer:
            reports.append(json.loads(answer.read() or '{"error": "the run died without a report"}'))
    for child in children:
        os.waitpid(child, 0)
    for report in reports:
        if "error" in report:
            raise RuntimeError(f"a benchmark run failed:\n{report['error']}")
    steps = [[seconds / workload.segment for seconds in report["durations"]] for report in reports]
    return (steps[0], steps[1]) if contender_first else (steps[1], steps[0])


def import_lazy_modules() -> None:
    """Import what the runs would import on first use (TensorBoard, tqdm, dynamo, Lightning), so
    each forked run starts with them loaded, as a long-lived process has them."""
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step)
    import torch.utils.tensorboard  # noqa: F401
    from tqdm.auto import tqdm  # noqa: F401

    if lightning_version() is not None:
        import lightning  # noqa: F401


@contextlib.contextmanager
def terminal_output():
    """Point stdout and stderr at a pseudo-terminal drained by ``cat``, as in an interactive shell.

    Progress bars then draw as they do for a user at a terminal (tqdm is skipped or simplified
    when output is a pipe or file). Results are printed to the original stdout, which is returned.
    """
    import pty
    import subprocess

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    leader, follower = pty.openpty()
    drain = subprocess.Popen(["cat"], stdin=leader, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.dup2(follower, 1)
    os.dup2(follower, 2)
    try:
        yield os.fdopen(os.dup(saved[0]), "w", buffering=1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(follower)
        drain.terminate()
        drain.wait()
        os.close(leader)
        for fd in saved:
            os.close(fd)
