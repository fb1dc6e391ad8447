"""Preemption: SIGTERM or SIGUSR1 stop the run at a safe point, save it, and end the process.

A cluster that takes a node back sends SIGTERM and, a grace period later, SIGKILL; SLURM sends
SIGUSR1 ahead of a time limit when asked (``#SBATCH --signal=USR1@120``). During ``fit`` the
Trainer installs handlers (main thread only; the previous handlers return after ``fit``) that
only set a flag. The loop reads that plain bool at the end of every batch; once set, it finishes
the accumulation window it is in, writes ``last.ckpt``, flushes the logs, stops, and ``fit`` then
raises ``SystemExit(128 + signal number)`` (143 for SIGTERM), the exit status of a process ended
by that signal, so a scheduler sees the job as terminated rather than finished and the user's
code after ``fit`` (a test run, an export) does not run on half-trained weights. Running the same
command again with ``fit(..., ckpt_path="last")`` resumes. Under DDP the ranks vote at log steps
(``strategy.reduce_any``, no collective per step), so every rank stops after the same batch.

DataLoader workers are shielded from these signals (:func:`workers_ignore_preemption`): a
scheduler often signals every process of the job, and a worker that died of SIGTERM would crash
the loop before it reached the end of the step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.trainer import Trainer

#: The signals that ask for a graceful stop (SIGUSR1 does not exist on Windows).
PREEMPTION_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


class Preemption:
    """The preemption flag of one Trainer, and the signal handlers that set it."""

    def __init__(self) -> None:
        self.signal_number: int | None = None  # the first preemption signal received during fit
        self.stop_now = False  # read by the loop every batch: a plain bool, no call
        self._world_size = 1

    @contextlib.contextmanager
    def handle_signals(self, world_size: int) -> Iterator[None]:
        """Catch the preemption signals while the body (``fit``) runs; restore the old handlers after.

        Args:
            world_size: with one process the handler stops the loop directly; with several, the
                ranks agree at log steps (:meth:`agree`).
        """
        self.signal_number, self.stop_now, self._world_size = None, False, world_size
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for number in PREEMPTION_SIGNALS:
                current = signal.getsignal(number)
                # SIG_IGN: the process was told to ignore it (nohup, a launcher), so keep doing so.
                # None: a handler installed outside Python, which could not be put back after fit.
                if current is signal.SIG_IGN or current is None:
                    continue
                previous[number] = signal.signal(number, self._on_signal)
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _on_signal(self, number: int, frame: Any) -> None:
        # Runs between two bytecodes of the training thread: set flags, nothing else.
        if self.signal_number is None:
            self.signal_number = number
        if self._world_size == 1:
            self.stop_now = True

    def agree(self, strategy: Any) -> None:
        """At a log step with several processes: stop everywhere if any rank got a signal."""
        if self._world_size > 1 and not self.stop_now:
            self.stop_now = strategy.reduce_any(self.signal_number is not None)

    def stopping_signal(self) -> int | None:
        """The signal this process stops for: its own, SIGTERM when another rank's stopped it, or None."""
        if self.signal_number is not None:
            return int(self.signal_number)
        return int(signal.SIGTERM) if self.stop_now else None

    @property
    def reason(self) -> str:
        """Why the loop stops, for the message: "SIGTERM received", or another rank's signal."""
        if self.signal_number is None:
            return "another process received a preemption signal"
        return f"{signal.Signals(self.signal_number).name} received"

    def exit_if_stopped(self) -> None:
        """After ``fit``: end the process as the signal asked, now that the state is saved."""
        number = self.stopping_signal()
        if number is None:
            return
        self.signal_number, self.stop_now = None, False
        raise SystemExit(128 + number)


def save_for_preemption(trainer: Trainer, reason: str) -> None:
    """A preemption signal arrived (``reason``) and the accumulation window has ended: write
    last.ckpt (through the ModelCheckpoint, if any), stop the loop, say so on rank zero."""
    if trainer.checkpoint_callback is not None:
        path = trainer.checkpoint_callback.write_last(trainer)
    else:
        path = Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(path)
    trainer.should_stop = True
    if trainer.is_global_zero:
        print(f"Cadence: {reason}; stopped after global step {trainer.global_step} "
              f"(epoch {trainer.current_epoch}, batch {trainer.batch_idx}) and saved {path}. Run the same command "
              "with fit(..., ckpt_path=\"last\") to resume.", file=sys.stderr, flush=True)


def workers_ignore_preemption(worker_init_fn: Any) -> Any:
    """A DataLoader ``worker_init_fn`` that shields workers from preemption signals, then calls
    ``worker_init_fn``.

    A scheduler often signals every process of a job. PyTorch's worker handler ends a worker on
    any SIGTERM, and the loop would then crash fetching the next batch before it could save. A
    shielded worker ignores SIGUSR1, and SIGTERM unless its parent sent it (DataLoader shutdown
    and multiprocessing's exit cleanup terminate workers that way, so those still work).
    """
    if isinstance(worker_init_fn, functools.partial) and worker_init_fn.func is _shield_worker:
        return worker_init_fn
    return functools.partial(_shield_worker, worker_init_fn)


def _shield_worker(worker_init_fn: Any, worker_id: int) -> None:
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):  # Linux: only there does a waiter learn who sent a signal
        # Blocked here, SIGTERM reaches no handler; a thread takes it and tells senders apart.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), daemon=True,
                         name="cadence-worker-signals").start()
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as PyTorch's own worker handler does for its parent's SIGTERM
