"""Where the time of a fit goes, by phase, read from the host clock only (no device sync).

The performance report (``callbacks/performance.py``) turns these figures into its lines and
recommendations. The training loop reads the clock twice a batch, and nothing else:

    times.data_wait += clock() - times.ready     # once the next batch arrived
    ...the step, its hooks, a log step, validation...
    times.ready = clock()                         # the loop asks for the next batch now

The rare phases (validation, checkpoint writes, log steps) time themselves with
:meth:`PhaseTimes.measure` (the :func:`measured` decorator on the Trainer's methods); what the
batch loops spent outside those phases and outside waiting for data is the training steps.
On an accelerator the host runs ahead of the device until a value is read, so these are the
times the host saw; the Profiler callback measures the device.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

PHASES = ("validation", "checkpointing", "logging")


class PhaseTimes:
    """Host seconds a Trainer spent per phase, accumulated over its fits (read :meth:`totals`)."""

    #: The host clock, bound when Cadence is imported: code that patches ``time.perf_counter`` (a test
    #: feeding a callback's clock a list of times, as Lightning's tests do) changes its own reads, not the loop's.
    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.batches = 0  # training batches the closed batch loops ran
        self.data_wait = 0.0  # waiting for the next training batch (the loop adds to it)
        self.ready = 0.0  # the clock when the loop last asked for a batch (the loop sets it)
        self.sections = dict.fromkeys(PHASES, 0.0)  # each phase's own time (nested phases taken off)
        self._in_sections = 0.0  # time inside measured sections, nested ones counted once
        self._batch_loops = 0.0  # closed batch loops: start to the end of their last batch
        self._sections_in_loops = 0.0  # section time inside those loops
        self._loop: tuple[float, float, int] | None = None  # (start, in_sections, batches seen) of the open loop

    def start_loop(self, batches_seen: int) -> None:
        """Before an epoch's batch loop asks for its first batch (``batches_seen``: the
        Trainer's count of training batches so far)."""
        self._batch_loops, self._sections_in_loops = self._closed()
        self.ready = self.clock()
        self._loop = (self.ready, self._in_sections, batches_seen)

    def end_loop(self, batches_seen: int) -> None:
        """After an epoch's batch loop, before the epoch-end work (which is not the loop's)."""
        if self._loop is not None:
            self.batches += batches_seen - self._loop[2]
        self._batch_loops, self._sections_in_loops = self._closed()
        self._loop = None

    def _closed(self) -> tuple[float, float]:
        """The batch loops' time and the section time inside them, an open loop included (one
        left by ``return`` after a preemption signal ends at its last batch)."""
        loops, in_loops = self._batch_loops, self._sections_in_loops
        if self._loop is not None:
            started, in_sections, _ = self._loop
            loops += max(0.0, self.ready - started)
            in_loops += self._in_sections - in_sections
        return loops, in_loops

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the time of the ``with`` body to ``phase``, less the time of phases nested in it."""
        started, inner_before = self.clock(), self._in_sections
        try:
            yield
        finally:
            elapsed = self.clock() - started
            self.sections[phase] += elapsed - (self._in_sections - inner_before)
            self._in_sections = inner_before + elapsed

    def totals(self) -> dict[str, float]:
        """Seconds so far: ``data_wait``, ``training_steps`` (the batch loops less waiting and
        the phases inside them), ``batch_loops``, each of :data:`PHASES`; and ``batches``."""
        loops, in_loops = self._closed()
        return {"data_wait": self.data_wait, "training_steps": max(0.0, loops - self.data_wait - in_loops),
                "batch_loops": loops, **self.sections, "batches": self.batches}


def measured(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a Trainer method so that its time counts as ``phase`` in ``trainer.phase_times``."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            with trainer.phase_times.measure(phase):
                return method(trainer, *args, **kwargs)

        return timed

    return decorate
