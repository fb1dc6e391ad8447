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
