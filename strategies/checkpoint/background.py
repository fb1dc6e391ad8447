"""Checkpoints written in the background: training waits only for a snapshot of the state.

``ModelCheckpoint(async_save=True)`` holds one :class:`BackgroundWriter`. A save then takes a
snapshot of the state on the host (:func:`~strategies.checkpoint.files.snapshot` with
``to_host=True``; on CUDA into pinned buffers kept across saves, copied without blocking, one
synchronization at the end), and hands the write (serialize, fsync, atomic rename) to a thread,
followed in order by what must happen only once the file is complete: ``last.ckpt``'s link and
the removal of the checkpoint that left the top k. So a kill at any instant leaves the previous
checkpoints complete and ``last`` pointing at a complete one.

The next save first waits for the previous one (at most one snapshot in memory); the end of fit,
an exception and teardown wait for the last. An error in the background (a full disk) skips what
was to follow it and is raised by the next :meth:`BackgroundWriter.check` or
:meth:`BackgroundWriter.wait`, naming the file. The thread is not a daemon: an interpreter that
exits waits for it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch


class BackgroundWriter:
    """Runs checkpoint writes, and what follows each, in order, in one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[str, Callable[[], Any]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.host_buffers = HostBuffers()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with its ModelCheckpoint into spawned processes (or deep-copied): a new, idle writer there.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def submit(self, what: str, job: Callable[[], Any]) -> None:
        """Run ``job`` after those submitted before it (``what`` names it in an error)."""
        with self._lock:
            if self._error is not None:  # it follows a write that failed: dropped until the error is raised
                return
            self._jobs.append((what, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cadence-checkpoint-writer")
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
            except BaseException as error:  # raised in the training thread, at its next check
                with self._lock:  # what was queued behind it goes now: a check may take the error before this
                    self._error = _naming(error, what)  # thread looks again (a link, the previous file's removal)
                    self._jobs.clear()

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._thread is not None

    def check(self) -> None:
        """Raise the error of a background write that failed (once); never blocks."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Wait until every write submitted is done, then raise the error of one that failed."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self.check()

    def wait_everywhere(self, reduce_any: Callable[[bool], bool]) -> None:
        """:meth:`wait` in every process (rank zero writes), raising there if it failed anywhere
        (``reduce_any``: the strategy's), so that no process is left waiting at a collective."""
        error = None
        try:
            self.wait()
        except Exception as failure:
            error = failure
        if reduce_any(error is not None):
            raise error or OSError("Rank zero's background checkpoint write failed; see its error.")

    def wait_and_warn(self, warn: Callable[[str], Any]) -> None:
        """:meth:`wait`, and report a failure with ``warn`` (the run's own error, if any, is raised)."""
        try:
            self.wait()
        except Exception as failure:
            warn(str(failure))


def _naming(error: BaseException, what: str) -> BaseException:
    """``error`` as raised in the training thread: it says that it happened in the background."""
    if isinstance(error, OSError):  # write_file's errors name the file and say what is intact
        return OSError(error.errno, f"The background save failed: {error.strerror or error}")
    return RuntimeError(f"The background save of {what} failed: {type(error).__name__}: {error}")


class HostBuffers:
    """Host memory to snapshot tensors into, kept across saves (allocating, and on CUDA pinning,
    gigabytes at each save costs more than the copy), one buffer per tensor of the state (by its
    storage address, shape, strides and dtype). A buffer is reused only once the write that read it
    is done: the next save waits for the previous one."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._on_cuda = False
        self._stager: Any = None

    @property
    def stager(self) -> Any:
        """The same for shards (FSDP): ``torch.distributed.checkpoint``'s stager, which keeps its
        host copy of each tensor across saves (pinned when CUDA is at hand)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=False))
        return self._stager

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` in its buffer; from CUDA into pinned memory without blocking
        (:meth:`synchronize` waits for those copies)."""
        tensor = tensor.detach()
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=tensor.device.type == "cuda")
        on_cuda = tensor.device.type == "cuda"
        self._on_cuda |= on_cuda
        buffer.copy_(tensor, non_blocking=on_cuda)
        return buffer

    def synchronize(self) -> None:
        """Wait for the copies from CUDA that :meth:`copy` started."""
        if self._on_cuda:
            torch.cuda.synchronize()
            self._on_cuda = False
