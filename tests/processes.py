"""Running commands as separate processes at the same time: torchrun "machines" on the loopback,
and the examples' multi-process runs, which share the two cores instead of queueing for them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The repository these tests belong to: what the commands import (``trainer`` and the rest), not
#: the checkout that the editable install points to, which may be another worktree.
THIS_CHECKOUT = str(Path(__file__).resolve().parents[1])

def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(*arguments: str) -> list[str]:
    """The command line ``torchrun <arguments>`` with this Python."""
    return [sys.executable, "-m", "torch.distributed.run", *arguments]


def run_together(commands: list[list[str]], cwd: str | os.PathLike | None = None, env: list[dict | None] | None = None,
                 timeout: float = 300) -> list[tuple[int, str]]:
    """Start every command at once, wait for all; return each one's (exit status, output).

    Each command runs in its own process group, and its output (stdout and stderr together) goes
    to a file, not a pipe: two torchrun nodes wait for each other, so one blocked on a full pipe
    that nobody reads would hang both. A command still running at the deadline is killed with
    everything it started (torchrun's workers, spawned ranks) and its output ends with a note.

    Args:
        commands: the command lines.
        cwd: their working directory.
        env: per command, variables added to this process's environment (or None).
        timeout: seconds to wait for all of them together.
    """
    env = env or [None] * len(commands)
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        launches = [subprocess.Popen(command, cwd=cwd, env={**os.environ, "PYTHONPATH": THIS_CHECKOUT, **(extra or {})},
                                     text=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                    for command, extra, log in zip(commands, env, logs)]
        deadline = time.monotonic() + timeout
        killed = []
        try:
            for launch in launches:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    launch.wait(timeout=max(deadline - time.monotonic(), 0))
        finally:
            for launch in launches:
                killed.append(launch.poll() is None)
                if killed[-1] or launch.returncode != 0:  # what it started may be left running
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(launch.pid, signal.SIGKILL)
                    launch.wait()
        outputs = []
        for log, was_running in zip(logs, killed):
            log.seek(0)
            outputs.append(log.read() + (f"\n[killed: still running after {timeout:g} s]" if was_running else ""))
    return [(launch.returncode, output) for launch, output in zip(launches, outputs)]


# --- spawned workers without a fresh torch import ------------------------------------------------
#: What a worker spawned by the suite finds already imported: torch, and torch._dynamo, which
#: torch's DistributedDataParallel imports in its constructor (together ~4.5 s of CPU per worker).
#: Cadence's own packages are left out: the server would import them from wherever ``sys.path``
#: points when it starts (Python 3.11's forkserver ignores the caller's path), possibly another
#: checkout; each worker imports them itself, from the caller's path, as a spawned one does.
PRELOADED = ["torch", "torch._dynamo"]

#: Set to 1 to run the suite's DDP and FSDP workers with the real "spawn" start method (a test that
#: needs a real worker's exit sets it for itself: the forkserver's emulated exit below stalled the
#: crash-at-exit test now and then in the full suite, never alone).
REAL_SPAWN = "CADENCE_TEST_REAL_SPAWN"


class StandardStreams:
    """The caller's file descriptors 1 and 2, sent to the worker (the forkserver's children
    otherwise write where the server's did when it started, not where a test redirected them)."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd  # only while a worker is being started

        return StandardStreams._received, (DupFd(1), DupFd(2))

    @staticmethod
    def _received(stdout, stderr) -> StandardStreams:
        for target, source in ((1, stdout), (2, stderr)):
            descriptor = source.detach()
            os.dup2(descriptor, target)
            os.close(descriptor)
        return StandardStreams()


def _as_if_spawned(index: int, function, environment: dict, streams: StandardStreams, args: tuple) -> None:
    """In the worker: the caller's environment now (a forkserver's children get the server's,
    from when it started), then the function, as a spawned worker runs it; then the process ends
    as a spawned worker's does, through the interpreter's exit (non-daemon threads joined, atexit
    handlers, destructors, where a crash at exit shows), not the forkserver's ``os._exit``."""
    import ctypes

    os.environ.clear()
    os.environ.update(environment)
    function(index, *args)
    del function, args
    ctypes.pythonapi.Py_Exit(0)


def preloaded_start_processes(start_processes):
    """``torch.multiprocessing.start_processes``, but workers asked for with the "spawn" start
    method are forked from a server that has imported torch once (the "forkserver" method, with
    :data:`PRELOADED`): everything else is as with "spawn", a new process that unpickles what it
    runs, with the caller's environment, working directory, ``sys.path`` and standard streams."""

    def start(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        if start_method != "spawn" or os.environ.get(REAL_SPAWN) == "1":
            return start_processes(fn, args, nprocs, join, daemon, start_method)
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOADED)
        return start_processes(_as_if_spawned, (fn, dict(os.environ), StandardStreams(), args), nprocs, join, daemon,
                               "forkserver")

    return start
