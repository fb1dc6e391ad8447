"""Stop signals: Ctrl-C, SIGTERM or SIGUSR1 stop the run at a safe point, save it, and end the process.

A cluster that takes a node back sends SIGTERM and, a grace period later, SIGKILL; SLURM sends
SIGUSR1 ahead of a time limit when asked (``#SBATCH --signal=USR1@120``); a person presses Ctrl-C
(SIGINT). During ``fit`` the Trainer installs handlers (main thread only; the previous handlers
return after ``fit``) that only set a flag. The loop reads that plain bool at the end of every
batch; once set, it finishes the accumulation window it is in, writes ``last.ckpt``, flushes the
logs, stops, and ``fit`` then raises ``SystemExit(128 + signal number)`` (130 for Ctrl-C, 143 for
SIGTERM), the exit status of a process ended by that signal, so a scheduler sees the job as
terminated rather than finished and the user's code after ``fit`` (a test run, an export) does
not run on half-trained weights. Running the same command again with ``fit(..., ckpt_path="last")``
resumes. Under DDP the ranks vote at log steps (``strategy.reduce_any``, no collective per step),
so every rank stops after the same batch.

The first Ctrl-C puts the previous SIGINT handler back (Python's raises KeyboardInterrupt), so a
second one stops at once without saving. A KeyboardInterrupt that leaves a stage (that second
Ctrl-C, or one raised where no handler of ours ran) ends the process with status 130 and one line
instead of a traceback (:meth:`Preemption.interruptible`); as in Lightning, the stage's callbacks
get ``on_exception`` first and ``trainer.interrupted`` says so (SystemExit does not end IPython).

DataLoader workers are shielded from these signals (:func:`workers_ignore_preemption`): a
scheduler often signals every process of the job, and Ctrl-C reaches the whole foreground process
group, and a worker that died of the signal would crash the loop before it reached the end of the
step. Workers start with the signals blocked (:func:`iterate_shielded`) until their init function
has taken them over, so a signal sent while a worker is still starting cannot kill it either.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.trainer import Trainer

#: The signals that ask for a graceful stop (SIGUSR1 does not exist on Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))


class Preemption:
    """The stop flag of one Trainer, and the signal handlers that set it."""

    def __init__(self) -> None:
        self.signal_number: int | None = None  # the first stop signal received during fit
        self.stop_now = False  # read by the loop every batch: a plain bool, no call
        self.interrupted = False  # Lightning's trainer.interrupted: the last stage ended by an error or a signal
        self._world_size = 1
        self._announce = False  # this process says that Ctrl-C was heard (rank zero)
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def handle_signals(self, world_size: int, announce: bool = True) -> Iterator[None]:
        """Catch the stop signals while the body (``fit``) runs; restore the old handlers after.

        Args:
            world_size: with one process the handler stops the loop directly; with several, the
                ranks agree at log steps (:meth:`agree`).
            announce: say on stderr when Ctrl-C is heard (rank zero).
        """
        self.signal_number, self.stop_now, self._world_size, self._announce = None, False, world_size, announce
        self._pid, self._previous = os.getpid(), {}
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            for number in STOP_SIGNALS:
                current = signal.getsignal(number)
                # SIG_IGN: the process was told to ignore it (nohup, a background job), so keep doing so.
                # None: a handler installed outside Python, which could not be put back after fit.
                if current is signal.SIG_IGN or current is None:
                    continue
                self._previous[number] = signal.signal(number, self._on_signal)
        try:
            yield
        finally:
            for number, handler in self._previous.items():
                signal.signal(number, handler)
            self._previous = {}

    def _on_signal(self, number: int, frame: Any) -> None:
        # Runs between two bytecodes of the training thread: set flags, nothing that could block.
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker before its init function ran: the main process handles it
        if number == signal.SIGINT:
            # The next Ctrl-C goes to the handler from before fit (Python's raises KeyboardInterrupt).
            signal.signal(number, self._previous.get(number, signal.default_int_handler))
            if self._announce:  # os.write: a print here could re-enter a print the signal interrupted
                os.write(2, b"\nCadence: Ctrl-C: stopping after this step to save last.ckpt; press Ctrl-C again "
                            b"to stop now without saving.\n")
        # A launcher passes a Ctrl-C on to its ranks as SIGTERM (strategies/spawn.py), which may come
        # before the terminal's own SIGINT: the Ctrl-C is the reason either way (status 130).
        if self.signal_number is None or (number == signal.SIGINT and self.signal_number == signal.SIGTERM):
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
            return "another process received a stop signal"
        if self.signal_number == signal.SIGINT:
            return "Ctrl-C (SIGINT) received"
        return f"{signal.Signals(self.signal_number).name} received"

    @contextlib.contextmanager
    def interruptible(self, stage: str, say: bool) -> Iterator[None]:
        """Around a whole stage in the calling process: ``interrupted`` (as Lightning's: the stage
        ended by an error or a signal), and a KeyboardInterrupt made ``SystemExit(130)`` with one
        line (``say``: rank zero) instead of a traceback through the loop."""
        self.interrupted = False
        try:
            yield
        except KeyboardInterrupt:
            self.interrupted = True
            if say:
                unsaved = "; nothing was saved at this point" if stage == "fit" else ""
                print(f"\nCadence: {stage} stopped at once by Ctrl-C (KeyboardInterrupt){unsaved}.", file=sys.stderr,
                      flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        except BaseException:
            self.interrupted = True
            raise

    def exit_if_stopped(self) -> None:
        """After ``fit``: end the process as the signal asked, now that the state is saved."""
        number = self.stopping_signal()
        if number is None:
            return
        self.signal_number, self.stop_now, self.interrupted = None, False, True
        raise SystemExit(128 + number)


def save_for_preemption(trainer: Trainer, reason: str) -> None:
    """A stop signal arrived (``reason``) and the accumulation window has ended: write last.ckpt
    (through the ModelCheckpoint, if any), stop the loop, say so on rank zero in one line."""
    writer = next((c for c in trainer.checkpoint_callbacks if hasattr(c, "write_last")), None)  # a ModelCheckpoint
    if writer is not None:  # (not a user's own Checkpoint, nor an OnExceptionCheckpoint)
        path = writer.write_last(trainer)
    else:
        path = Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(path)
    trainer.should_stop = True
    if trainer.is_global_zero:
        print(f"Cadence: {reason}; stopped after global step {trainer.global_step} "
              f"(epoch {trainer.current_epoch}, batch {trainer.batch_idx}) and saved {path}. To resume, run the same "
              f"command{_command()} with fit(..., ckpt_path=\"last\").", file=sys.stderr, flush=True)


def _command() -> str:
    """`` (python train.py --args)`` when this process runs a script, else nothing (a notebook)."""
    script = sys.argv[0] if sys.argv else ""
    if not script.endswith(".py") or not os.path.isfile(script):
        return ""
    return f" ({shlex.join(['python', *sys.argv])})"


def workers_ignore_preemption(worker_init_fn: Any) -> Any:
    """A DataLoader ``worker_init_fn`` that shields workers from stop signals, then calls
    ``worker_init_fn``.

    A scheduler often signals every process of a job, and Ctrl-C reaches every process of the
    terminal's foreground job. PyTorch's worker handler ends a worker on any SIGTERM (and its loop
    on KeyboardInterrupt), and the main loop would then crash fetching the next batch before it
    could save. A shielded worker ignores SIGINT and SIGUSR1, and SIGTERM unless its parent sent it
    (DataLoader shutdown and multiprocessing's exit cleanup terminate workers that way, so those
    still work).
    """
    if is_shielded(worker_init_fn):
        return worker_init_fn
    return functools.partial(_shield_worker, worker_init_fn)


def is_shielded(worker_init_fn: Any) -> bool:
    """Whether ``worker_init_fn`` came from :func:`workers_ignore_preemption`."""
    return isinstance(worker_init_fn, functools.partial) and worker_init_fn.func is _shield_worker


def iterate_shielded(loader: Any, make_iterator: Any = iter) -> Iterator[Any]:
    """``make_iterator(loader)`` (``iter``: the DataLoader starts its workers there) with the stop
    signals blocked in this thread while it runs, when the loader's workers are shielded.

    A child process inherits the blocked mask (fork; spawn keeps it through exec), so a signal sent
    to the whole job while a worker starts (under spawn, it imports torch for seconds) stays pending
    in the worker until :func:`workers_ignore_preemption` has taken the signals over, instead of
    killing it; this process gets its own copy when the mask is restored. (A forkserver started
    earlier hands out its own mask: there the window stays open.)
    """
    if not (getattr(loader, "num_workers", 0) and is_shielded(getattr(loader, "worker_init_fn", None))
            and hasattr(signal, "pthread_sigmask")):
        return make_iterator(loader)
    method = (loader.multiprocessing_context or multiprocessing.get_context()).get_start_method()
    if method != "fork":
        # The loader's queues register with multiprocessing's resource tracker, and the call that
        # starts the tracker unblocks SIGINT and SIGTERM in this thread when it is done: started now,
        # before the block, it leaves the mask alone.
        resource_tracker.ensure_running()
    if method == "forkserver":  # started inside the block, it would pass the block to every later child
        forkserver.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return make_iterator(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _shield_worker(worker_init_fn: Any, worker_id: int) -> None:
    ignored = [getattr(signal, name) for name in ("SIGINT", "SIGUSR1") if hasattr(signal, name)]
    for number in ignored:  # a pending one (sent while the worker started) is discarded
        signal.signal(number, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since birth by iterate_shielded: ignored now instead
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
    if hasattr(signal, "sigwaitinfo"):  # Linux: only there does a waiter learn who sent a signal
        # Blocked here, SIGTERM reaches no handler; a thread takes it (also one sent while the worker
        # started, pending since) and tells senders apart.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_on_parents_sigterm, args=(os.getppid(),), daemon=True,
                         name="cadence-worker-signals").start()
    elif hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as PyTorch's own worker handler does for its parent's SIGTERM
