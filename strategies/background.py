"""Work done off the training thread by a thread that exists only while there is work.

A thread that sleeps until the next job still costs every step of the run: once a process has a
second live thread, glibc's ``malloc``/``free`` and the interpreter's lock hand-over take their
slower, locked paths, about 8k instructions a step of the tiny benchmark (0.4% of a hand-written
step; ``cadence-lean-thread`` in ``benchmarks/workloads.py``, benchmarks/RESULTS.md round 10). A
thread that started and ended costs nothing after it ended. So :class:`BackgroundJobs` starts its
thread when a job arrives and lets it end when none is left; starting one takes tens of
microseconds, paid once per batch of jobs (once a second for the loggers, once per checkpoint for
background saves).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any


class BackgroundJobs:
    """Jobs run in the order submitted, by one thread at a time, which ends when none is left.

    A job that raises keeps its error (:attr:`error`, named by :meth:`naming`) and the jobs queued
    behind it are dropped: they follow from it (the link to a checkpoint whose write failed).

    Args:
        name: the thread's name (``cadence-...``, seen in ``py-spy dump`` and tracebacks).
        daemon: whether the interpreter may exit without waiting for a job in flight.
    """

    def __init__(self, name: str, daemon: bool = False) -> None:
        self.name, self.daemon = name, daemon
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[str, Callable[[], Any]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, what: str, job: Callable[[], Any]) -> None:
        """Run ``job`` after those submitted before it (``what`` names it in an error)."""
        with self._lock:
            self._jobs.append((what, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=self.daemon)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs or self._error is not None:
                    self._jobs.clear()
                    self._thread = None
                    return
                what, job = self._jobs.popleft()
            try:
                job()
            except BaseException as error:  # raised in the training thread, by whoever checks
                with self._lock:
                    self._error = self.naming(error, what)

    def naming(self, error: BaseException, what: str) -> BaseException:
        """The error as the training thread will raise it (``what``: the job's name)."""
        return error

    @property
    def busy(self) -> bool:
        """A job is in flight or waiting."""
        return self._thread is not None

    def in_worker(self) -> bool:
        """Called from a job (on the thread that runs them)."""
        return threading.current_thread() is self._thread

    @property
    def error(self) -> BaseException | None:
        """The error of the job that failed, until :meth:`take_error`."""
        return self._error

    def take_error(self) -> BaseException | None:
        """The error of the job that failed (once); jobs submitted from then on run again."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def wait(self) -> None:
        """Wait until every job submitted so far is done (or dropped after an error)."""
        thread = self._thread
        if thread is not None:
            thread.join()
