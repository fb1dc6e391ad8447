"""On CUDA: the next batch is copied to the GPU on a side stream while the current one computes.

Without it, a batch's host-to-device copy is queued on the compute stream behind the previous
step's kernels, so the GPU copies, then computes, then copies. With it, the copy of batch k+1 is
queued on a second stream before step k is, and the copy engine runs it while the kernels of step
k run. Three things keep that correct:

- **Stream order.** The compute stream waits for batch k's copy (an event recorded on the side
  stream after that copy) before step k's first kernel, and for nothing else: not for the copy of
  batch k+1 queued after it.
- **The caching allocator.** Batch k's device memory is allocated on the side stream. When the
  loop drops the batch, the allocator would hand that memory to the next allocation on the side
  stream (the copy of batch k+2) while the compute stream may still be reading it. ``record_stream``
  tells the allocator the compute stream uses it, so the memory is reused only after the kernels
  queued on the compute stream by then have run.
- **The host source.** The loader pins its batches (the CUDA strategies rebuild it to, ``pinned_loader``),
  and PyTorch's caching host allocator keeps a pinned block from being reused until the copies
  that read it have run, however early the loop drops the CPU batch.

The loader is read one batch ahead: batch k+1 is fetched, and its copy queued, before step k is
queued; a loop that stops early (``max_steps``, ``should_stop``) has read one batch it does not
train on. An ``itertools.islice`` over the batches (how the loop applies ``limit_train_batches``)
stops without fetching past its limit. Random numbers a dataset draws in the main process
(``num_workers=0``) are drawn one step earlier than without prefetching; with DataLoader workers
nothing changes.

The CUDA calls are the methods of :class:`CudaCopyStream`; the logic here takes any object with
the same methods, so it runs on a CPU with a fake one that records the calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from callbacks.console import MisconfigurationException
from strategies.transfer import tensors_in


class CudaCopyStream:
    """The side stream the prefetcher copies on, and the CUDA calls it makes.

    Args:
        device: the CUDA device the batches go to; its current stream is the compute stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copying(self) -> contextlib.AbstractContextManager:
        """A context in which ``.to(device)`` allocates and copies on the side stream."""
        return torch.cuda.stream(self.stream)

    def record_copied(self) -> torch.cuda.Event:
        """An event that completes when the copies queued on the side stream so far have run."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_for(self, copied: torch.cuda.Event) -> None:
        """Make the compute stream's next kernels wait for ``copied`` (the host does not wait)."""
        torch.cuda.current_stream(self.device).wait_event(copied)

    def used_by_compute(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that the compute stream uses ``tensor``'s memory."""
        tensor.record_stream(torch.cuda.current_stream(self.device))


def prefetch_to_device(batches: Iterable[tuple[int, Any]], move: Callable[[Any], Any],
                       copy_stream: CudaCopyStream) -> Iterator[tuple[int, Any]]:
    """Yield ``batches``' ``(batch_idx, batch)`` pairs with each batch moved by ``move``, the next
    one's copy queued on ``copy_stream`` before the current one is handed out.

    Args:
        batches: the loop's ``(batch_idx, batch)`` pairs, batches on the host.
        move: moves one batch (``strategy.batch_to_device``: non-blocking copies).
        copy_stream: a :class:`CudaCopyStream`, or an object with the same methods.
    """
    iterator = iter(batches)
    ahead = _start_copy(iterator, move, copy_stream)
    while ahead is not None:
        batch_idx, batch, copied = ahead
        ahead = _start_copy(iterator, move, copy_stream)  # queued before this batch's step: they overlap
        copy_stream.wait_for(copied)  # this batch's own copy, not the one just queued
        yield batch_idx, batch


def _start_copy(iterator: Iterator[tuple[int, Any]], move: Callable[[Any], Any],
                copy_stream: CudaCopyStream) -> tuple[int, Any, Any] | None:
    """Fetch the next batch (on the compute stream, as without prefetching: a dataset's own GPU
    work stays in order) and queue its copy on the side stream."""
    item = next(iterator, None)
    if item is None:
        return None
    batch_idx, batch = item
    with copy_stream.copying():
        moved = move(batch)
    copied = copy_stream.record_copied()
    for tensor in tensors_in(moved):
        copy_stream.used_by_compute(tensor)
    return batch_idx, moved, copied


def check_prefetch(prefetch: Any, device_type: str, owner: str) -> None:
    """Raise a ValueError unless ``prefetch`` is None, False, or True on a CUDA device.

    Args:
        prefetch: the strategy's ``prefetch`` argument.
        device_type: the device type the strategy trains on.
        owner: the strategy's class name, for the message.
    """
    if prefetch is not None and not isinstance(prefetch, bool):
        raise MisconfigurationException(
            f"{owner}(prefetch={prefetch!r}): use True, False or None (on for CUDA, off elsewhere).")
    if prefetch and device_type != "cuda":
        raise MisconfigurationException(
            f"{owner}(prefetch=True) copies the next batch to the GPU on a CUDA side stream, but this strategy "
            f"trains on {device_type}. Remove prefetch=True (batches there move as they are), or train on CUDA."
        )
