"""Starting DDP worker processes from a plain ``python train.py``, and collecting what they did.

:func:`spawn_workers` checks that the work can be pickled for the new processes, hosts the
process group's store in the calling process (on a free port, or ``MASTER_ADDR``/``MASTER_PORT``
when set), starts one process per device with ``torch.multiprocessing``, and returns rank zero's
result. If any rank fails, the others are stopped (they see the store's abort flag, and whatever
is left is terminated here), and the caller gets a RuntimeError carrying the failing rank's
traceback and where every rank was.

What the workers receive, and the check that it can be sent, are in :mod:`strategies.pickling`.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies import forensics
from strategies.pickling import PickledWork, check_picklable

if TYPE_CHECKING:
    from strategies.ddp import DDP

#: Seconds the other ranks get to stop on their own after one failed, before SIGTERM, then SIGKILL.
GRACE_PERIOD_S = 3.0


def spawn_workers(strategy: DDP, function: Callable[..., Any], args: tuple) -> Any:
    """Run ``function(*args)`` in ``strategy.num_processes`` new processes; return rank zero's result."""
    count, name = strategy.num_processes, type(strategy).__name__
    if strategy.start_method != "fork":
        check_picklable(function, args, count, name)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = host_store(host, int(os.environ.get("MASTER_PORT", 0)), strategy.timeout, name)
    try:
        return _run_workers(strategy, function, args, count, host, store)
    finally:
        # The store's server thread lives in this process, so the store must die here, now. An
        # error's traceback keeps the frames of this call alive; a store that outlived them would
        # be destroyed wherever the garbage collector finds it, possibly in a forked child (a
        # DataLoader worker) that has no such thread: its destructor then joins a thread that is
        # not there and the child segfaults. Only this frame holds the store.
        del store


def _run_workers(strategy: DDP, function: Callable[..., Any], args: tuple, count: int, host: str,
                 store: dist.TCPStore) -> Any:
    name = type(strategy).__name__  # DDP or FSDP, in what the user reads
    with tempfile.TemporaryDirectory(prefix="cadence-ddp-") as directory:
        result_path = str(Path(directory) / "rank0-result.pt")
        context = mp.start_processes(
            _run_worker, args=(count, host, store.port, result_path, PickledWork(strategy, function, args)),
            nprocs=count, join=False, start_method=strategy.start_method,
        )
        received: list[int] = []  # the stop signals this process got
        try:
            with _forward_stop_signals(context, received):
                died_after_work = _wait_for_workers(context, directory)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            if signal.SIGINT in received:  # Ctrl-C reached ranks that had no handler yet (still starting)
                raise KeyboardInterrupt from None
            # Spawned workers set up one stage each: their keys live under the first session's prefix.
            message = failure_message(dist.PrefixStore(forensics.session_prefix(0), store), count,
                                      _native_crash(context, error), strategy.timeout.total_seconds(),
                                      started=[_started_marker(directory, rank).exists() for rank in range(count)],
                                      name=name)
            del store  # this frame outlives the call in the error's traceback (see spawn_workers)
            raise RuntimeError(message) from None
        finally:
            _stop_leftovers(context)
        unfinished = [rank for rank in range(count) if not _done_marker(directory, rank).exists()]
        if unfinished and signal.SIGINT in received:  # a rank's KeyboardInterrupt (torch's spawn: exit code 0)
            raise KeyboardInterrupt
        if unfinished:  # every rank ended with exit code 0, yet not all of them finished
            message = _unfinished_message(dist.PrefixStore(forensics.session_prefix(0), store), count, unfinished[0],
                                          name)
            del store
            raise RuntimeError(message)
        for rank, exit_code in died_after_work:
            warnings.warn(
                f"{name} rank {rank} of {count} {_ended_how(exit_code)} while its process was exiting, after it had "
                "finished its work; the results are complete. Its output above says where (a crash in native "
                "code at interpreter exit prints every thread's Python stack).", stacklevel=5,
            )
        # Written by our own rank zero into our private directory; it holds the stage's output
        # (predictions may be any object), so it is read as a full pickle.
        return torch.load(result_path, map_location="cpu", weights_only=False)


def host_store(host: str, port: int, timeout: datetime.timedelta, name: str = "DDP") -> dist.TCPStore:
    """The process group's store, served from this process; port 0 picks a free port."""
    try:
        return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, ValueError) as error:
        raise RuntimeError(
            f"{name} could not open its meeting point on {host}:{port} ({str(error).splitlines()[0]}). "
            + ("Unset MASTER_PORT to let Cadence pick a free port, or set it to a free one."
               if port else "Set MASTER_ADDR to an address of this machine (e.g. 127.0.0.1).")
        ) from error


def _run_worker(local_rank: int, world_size: int, host: str, port: int, result_path: str, work: PickledWork) -> None:
    """The body of one spawned process (``torch.multiprocessing`` passes ``local_rank``)."""
    if not faulthandler.is_enabled():
        # A crash in native code (an abort, a segfault) then prints every thread's Python stack.
        faulthandler.enable(all_threads=True)
    _started_marker(Path(result_path).parent, local_rank).touch()  # it got past importing the script
    strategy, function, args = work.open(local_rank)
    # The usual variables, for code that reads them (and for the user's own torch.distributed calls).
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=str(port))
    strategy.set_process(rank=local_rank, local_rank=local_rank, world_size=world_size, store_address=(host, port),
                         local_world_size=world_size)
    try:
        result = function(*args)
    except Exception:
        strategy.record_failure()  # no-op when teardown already recorded it
        raise
    if local_rank == 0:
        torch.save(result, result_path)
    _done_marker(Path(result_path).parent, local_rank).touch()  # a crash from here on loses nothing


def _done_marker(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.done"


def _started_marker(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.started"


def _wait_for_workers(context: Any, directory: str) -> list[tuple[int, int]]:
    """Wait until every worker has ended; return ``(rank, exit code)`` of those that died after
    finishing their work (a crash at interpreter exit), while the others were left to finish.
    Any other failure goes to ``ProcessContext.join``, which stops the rest and raises it."""
    died_after_work = []
    running = dict(enumerate(context.processes))
    while running:
        ready = multiprocessing.connection.wait([process.sentinel for process in running.values()])
        for rank, process in list(running.items()):
            if process.sentinel not in ready:
                continue
            process.join()
            del running[rank]
            finished = _done_marker(directory, rank).exists()
            if process.exitcode != 0 and not finished:
                while not context.join(grace_period=GRACE_PERIOD_S):  # raises for this failure
                    pass
            context.sentinels.pop(process.sentinel, None)  # handled here; join must not report it
            if process.exitcode != 0:
                died_after_work.append((rank, process.exitcode))
    return died_after_work


def _unfinished_message(store: Any, count: int, rank: int, name: str = "DDP") -> str:
    first = forensics.first_failure(store, count)
    if first is not None:
        return f"{name} rank {first[0]} of {count} ended before its work was done. Its error:\n\n{first[1].rstrip()}"
    return (f"{name} rank {rank} of {count} ended with exit code 0 before its work was done: code in the worker "
            "called sys.exit() or os._exit(). Raise an exception instead, or set trainer.should_stop = True "
            "to end training early.")


def _ended_how(exit_code: int) -> str:
    if exit_code < 0:
        return f"was killed by {signal.Signals(-exit_code).name}"
    return f"ended with exit code {exit_code}"


@contextlib.contextmanager
def _forward_stop_signals(context: Any, received: list[int]) -> Iterator[None]:
    """Stop signals sent to this process reach the workers, which save and stop at a safe point
    (trainer/preemption.py); this process waits for them instead of dying first, which would take
    the workers down mid-save. Each signal received is appended to ``received``.

    Ctrl-C in a terminal sends SIGINT to the whole foreground process group, workers included: a
    second SIGINT from here would count as their second Ctrl-C (stop now, without saving), so
    SIGINT goes on as SIGTERM, which stops them the same way and reaches them also when only this
    process was signalled. The first SIGINT puts the previous handler back: a second Ctrl-C raises
    KeyboardInterrupt here, and the workers are stopped without saving.
    """
    if threading.current_thread() is not threading.main_thread():  # handlers live on the main thread
        yield
        return
    previous: dict[int, Any] = {}

    def forward(number: int, frame: Any) -> None:
        received.append(number)
        if number == signal.SIGINT:
            signal.signal(number, previous[number])
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM if number == signal.SIGINT else number)

    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) not in (signal.SIG_IGN, None):
            previous[number] = signal.signal(number, forward)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


#: Signals a process dies of when native code fails: these ranks are the cause, not their peers.
_NATIVE_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)


def _native_crash(context: Any, error: Exception) -> Exception:
    """A rank that crashed in native code breaks its peers' collectives, and a peer's error may
    reach the launcher first; the crash is what to report."""
    if isinstance(error, mp.ProcessExitedException):
        return error
    for rank, process in enumerate(context.processes):
        if process.exitcode is not None and -process.exitcode in _NATIVE_CRASH_SIGNALS:
            name = signal.Signals(-process.exitcode).name
            return mp.ProcessExitedException(f"process {rank} terminated with signal {name}", error_index=rank,
                                              error_pid=process.pid, exit_code=process.exitcode, signal_name=name)
    return error


def _stop_leftovers(context: Any) -> None:
    # After a failure ProcessContext.join has already stopped everyone; this covers an interrupt
    # (Ctrl-C) or any other error in this process while the workers run.
    alive = [process for process in context.processes if process.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(GRACE_PERIOD_S)
        if process.is_alive():
            process.kill()
            process.join()


def failure_message(store: Any, count: int, error: Any, timeout_s: float | None = None,
                    started: list[bool] | None = None, name: str = "DDP") -> str:
    """What the caller reads when a worker failed: the cause's traceback, and where ranks were.

    Args:
        store: the group's store (under the stage's prefix), where ranks recorded failures and whereabouts.
        count: the number of ranks.
        error: what ``ProcessContext.join`` raised (after :func:`_native_crash`).
        timeout_s: ``DDP(timeout=...)``: a rank that NCCL's watchdog aborted is recognised by it.
        started: per rank, whether its worker got past importing the script (None: unknown).
        name: the strategy's class name (DDP, FSDP), as the messages call the ranks.
    """
    # A rank killed by a signal (a native crash, the OOM killer) breaks the others' collectives:
    # it is the cause, unless some rank raised an error of its own.
    died = isinstance(error, mp.ProcessExitedException) and error.exit_code < 0
    first = forensics.first_failure(store, count, broken_collectives=not died)
    record = forensics.read_records(store, count).get(getattr(error, "error_index", -1))
    if first is not None:
        rank, text = first
        message = f"{name} rank {rank} of {count} failed, so every rank was stopped. Its error:\n\n{text.rstrip()}"
    elif died and -error.exit_code == signal.SIGABRT and _timed_out(record, timeout_s):
        return _timeout_message(store, count, record, timeout_s, name)
    elif isinstance(error, mp.ProcessExitedException):
        rank_started = started is None or started[error.error_index]
        message = (f"{name} rank {error.error_index} of {count} (pid {error.error_pid}) ended without reporting an "
                   f"error ({error.args[0]}). {_exit_hint(error.exit_code, record is not None, rank_started, name)}")
    else:
        message = f"{name} rank {error.error_index} of {count} failed, so every rank was stopped.{error.args[0]}"
    if "Where each rank was" in message:  # a failed collective already said it
        return message
    where = forensics.where_ranks_were(store, count)
    return f"{message}\n\n{where}" if where else message


def _timed_out(record: dict[str, Any] | None, timeout_s: float | None) -> bool:
    """The NCCL watchdog's signature: the rank died of SIGABRT while its last report had it waiting
    in a collective for about the timeout (reports come about once a second, later on a busy host)."""
    return (record is not None and timeout_s is not None and record["waiting"]
            and record["in_phase_s"] >= timeout_s - max(2.0, 0.1 * timeout_s))


def _timeout_message(store: Any, count: int, record: dict[str, Any], timeout_s: float, name: str = "DDP") -> str:
    records = forensics.read_records(store, count)
    lagging = [other for rank, other in sorted(records.items())
               if rank != record["rank"] and forensics.fell_behind(other, record)]
    if lagging:
        lagged = "; ".join(f"rank {other['rank']} lagged (in {other['phase']} at training batch {other['batch_idx']})"
                           for other in lagging)
    else:
        lagged = "no rank reported being behind it (one may be stuck in native code without reporting)"
    return (f"{name} rank {record['rank']} of {count} timed out in a collective; {lagged}. Rank {record['rank']} "
            f"waited in {record['phase']} for over {record['in_phase_s']:g} s, {name}(timeout={timeout_s:g}), and NCCL's "
            "watchdog ended its process (SIGABRT).\n\n"
            f"{forensics.where_ranks_were(store, count, me=record)}\n"
            f"If that work is legitimately slow, raise {name}(timeout=...) (now {timeout_s:g} s); otherwise look for "
            "code that only some ranks run.")


def _exit_hint(exit_code: int, reached_group: bool, started: bool = True, name: str = "DDP") -> str:
    """The likely cause of a worker that ended without a Python error."""
    if exit_code == -signal.SIGKILL:
        return "SIGKILL usually means the kernel's out-of-memory killer: use fewer devices, smaller batches or fewer workers."
    if -exit_code in _NATIVE_CRASH_SIGNALS:
        return ("It crashed in native code (a C++ error in torch or an extension, a CUDA/NCCL fault); the native "
                "message and every thread's Python stack are in its output above. Run with devices=1 to see "
                f"whether it happens without {name}. (With NCCL, a collective that waits longer than {name}(timeout=...) "
                "also ends its process this way.)")
    if reached_group:
        return ("It had joined the process group, so something in the work ended the process "
                "(sys.exit or os._exit in user code, or a signal): its output above says which.")
    if not started:
        return ("It failed while importing your script, before it could start the work: its output above says "
                'why. (A script that calls fit at import time needs `if __name__ == "__main__":` around that code.)')
    return ("It stopped before it joined the process group (sys.exit or os._exit in user code, or a signal): "
            "its output above says which.")
