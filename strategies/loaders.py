"""DataLoaders for several processes: rebuild a loader with one setting changed, and shard one.

``shard_dataloader`` gives each rank its own share of a map-style dataset by putting a
``DistributedSampler`` where the loader's sampler was, and keeps everything else the user chose
(batch size, shuffle, drop_last, workers, collate_fn, pin_memory, worker_init_fn, generator).
For prediction it gives each rank one contiguous block instead (:class:`ContiguousShard`), so the
ranks' outputs put end to end are the dataset in order, each sample once.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

from collections.abc import Iterator

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler


def rebuild_dataloader(loader: DataLoader, **changes: Any) -> DataLoader:
    """A new DataLoader over the same dataset with the same settings except ``changes``.

    ``changes`` may set ``sampler`` or ``batch_sampler``; the batch size, shuffle and drop_last
    of the original then live in the new sampler, as DataLoader requires.
    """
    settings = dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
    )
    if loader.num_workers == 0:
        settings.pop("prefetch_factor")
        settings.pop("persistent_workers")
    if isinstance(loader.dataset, IterableDataset):  # DataLoader refuses a sampler for one (it makes its own)
        settings.pop("sampler")
    user_batch_sampler = loader.batch_size is None and loader.batch_sampler is not None
    if "batch_sampler" in changes or user_batch_sampler:
        # DataLoader refuses batch_size, shuffle, sampler and drop_last beside a batch_sampler.
        settings.pop("batch_size")
        settings.pop("drop_last")
        settings.pop("sampler", None)
        if "batch_sampler" not in changes:
            settings["batch_sampler"] = loader.batch_sampler
    # batch_size=None without a batch_sampler turns automatic batching off; it is kept as None.
    settings.update(changes)
    return DataLoader(loader.dataset, **settings)


def with_worker_init_fn(loader: DataLoader, worker_init_fn: Any) -> DataLoader:
    """``loader`` with ``worker_init_fn`` in place of its own (see :func:`_copied`)."""
    copied = _copied(loader)
    copied.worker_init_fn = worker_init_fn
    return copied


def with_batch_sampler(loader: DataLoader, batch_sampler: Any) -> DataLoader:
    """``loader`` reading its batches of indices from ``batch_sampler``, a wrapper of its own batch
    sampler that yields the same batches (see :func:`_copied`). Its ``sampler``, ``batch_size`` and
    ``drop_last`` stay those of the batches it reads."""
    copied = _copied(loader)
    # DataLoader refuses to set batch_sampler after __init__ because a new one could disagree with
    # batch_size and drop_last; a wrapper of the same batch sampler cannot.
    object.__setattr__(copied, "batch_sampler", batch_sampler)
    return copied


def _copied(loader: DataLoader) -> DataLoader:
    """A shallow copy of ``loader``, not a rebuild: a rebuild would be a plain DataLoader, so a
    subclass's ``__iter__`` and attributes would be lost (Lightning keeps the user's loader), and
    torch's ``__init__`` checks would run again (its worker-count warning shown twice). The user's
    object is left as it was."""
    copied = copy.copy(loader)
    copied._iterator = None  # persistent workers started by the original stay the original's
    return copied


def has_distributed_sampler(loader: Any) -> bool:
    """True when the user already gave ``loader`` a DistributedSampler (it is then kept)."""
    samplers = (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    return any(isinstance(sampler, DistributedSampler) for sampler in samplers)


class ContiguousShard(Sampler[int]):
    """Rank ``rank``'s block of ``range(length)``: the first ranks take one more sample when the
    length does not divide evenly; nothing is repeated, and a rank may get no sample at all."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        size, extra = divmod(length, world_size)
        self.start = rank * size + min(rank, extra)
        self.stop = self.start + size + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def shard_dataloader(loader: Any, *, rank: int, world_size: int, shuffle: bool, seed: int = 0,
                     warn: bool = True, contiguous: bool = False) -> Any:
    """Return a loader that yields only rank ``rank``'s share of ``loader``'s samples.

    Every rank gets the same number of batches: the ``DistributedSampler`` repeats a few samples
    when the dataset does not divide evenly, so that no rank waits at a collective for another.
    With ``contiguous`` (prediction, where no step waits for another rank) each rank gets one
    block of the dataset in order, without repeats, and ranks may get different numbers of batches.

    Args:
        loader: the user's loader. Anything other than a DataLoader over a map-style dataset with
            a standard sampler is returned unchanged, with a warning that every rank sees all of it.
        rank: this process's rank; ``world_size``: the number of processes.
        shuffle: shuffle, if the loader shuffled (a ``RandomSampler``); False for evaluation.
        seed: the shuffle seed, the same on every rank (``set_epoch`` varies it per epoch).
        warn: emit the warnings (rank zero passes True so each warning appears once).
        contiguous: a :class:`ContiguousShard` per rank instead (``shuffle`` must be False).
    """
    if not isinstance(loader, DataLoader) or has_distributed_sampler(loader):
        if warn and not isinstance(loader, DataLoader):
            _warn_unsharded(loader, f"it is a {type(loader).__name__}, not a torch DataLoader")
        return loader
    if isinstance(loader.dataset, IterableDataset):
        if warn:
            _warn_unsharded(loader, "its dataset is an IterableDataset, which has no sampler to replace")
        return loader
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler if loader.batch_size is not None else getattr(batch_sampler, "sampler", None)
    if type(batch_sampler) is not BatchSampler or not isinstance(sampler, (RandomSampler, SequentialSampler)):
        if warn:
            what = type(batch_sampler).__name__ if type(batch_sampler) is not BatchSampler else type(sampler).__name__
            _warn_unsharded(loader, f"it uses a custom {what}")
        return loader
    if contiguous:
        distributed = ContiguousShard(len(loader.dataset), rank, world_size)
    else:
        distributed = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank,
            shuffle=shuffle and isinstance(sampler, RandomSampler), seed=seed,
        )
    if loader.batch_size is not None:
        return rebuild_dataloader(loader, sampler=distributed)
    return rebuild_dataloader(
        loader, batch_sampler=BatchSampler(distributed, batch_sampler.batch_size, batch_sampler.drop_last)
    )


def _warn_unsharded(loader: Any, why: str) -> None:
    warnings.warn(
        f"DDP cannot give each rank its own share of this loader: {why}. Every rank iterates all "
        "of it. Pass a DataLoader over a map-style dataset, or shard it yourself "
        "(DistributedSampler(dataset), or trainer.global_rank / trainer.world_size in the dataset).",
        stacklevel=3,
    )


def remaining_batches(batch_sampler: Any, offset: int) -> list[list[int]] | None:
    """This rank's batches of what is left of the epoch once its first ``offset`` samples are
    trained, for a run resumed on another number of processes than the one that trained them.

    A ``DistributedSampler`` draws one order of the whole dataset per epoch, the same for any
    number of processes (its seed plus the epoch), and deals it out: after ``k`` batches of ``B``
    on each of ``W`` processes, exactly the first ``k * B * W`` samples of that order are trained.
    The rest is dealt out among this run's processes as the sampler deals a whole epoch (padded
    with repeats so that every rank gets as many, unless its ``drop_last``), and batched as
    ``batch_sampler`` batches. None when ``batch_sampler`` does not batch a DistributedSampler.
    """
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or not hasattr(batch_sampler, "batch_size"):
        return None
    whole = DistributedSampler(sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed)
    whole.set_epoch(sampler.epoch)
    rest, replicas = list(whole)[offset:], sampler.num_replicas
    if sampler.drop_last:
        rest = rest[:len(rest) - len(rest) % replicas]
    elif rest and len(rest) % replicas:
        padding = replicas - len(rest) % replicas
        rest += (rest * math.ceil(padding / len(rest)))[:padding]
    mine, size = rest[sampler.rank::replicas], batch_sampler.batch_size
    batches = [mine[start:start + size] for start in range(0, len(mine), size)]
    if batches and getattr(batch_sampler, "drop_last", False) and len(batches[-1]) < size:
        batches.pop()
    return batches


class SeenBatchIndices:
    """A batch sampler that records the dataset indices of each batch it yields, in
    ``seen_batch_indices`` (Lightning's name): predict's loaders carry one, so that a
    ``BasePredictionWriter`` is told which samples each batch held (under DDP too: the indices are
    the dataset's). It reads ahead of the loop as the DataLoader's workers prefetch; batch ``k``'s
    indices are ``seen_batch_indices[k]``."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.seen_batch_indices: list[list[int]] = []

    def __iter__(self) -> Iterator[Any]:
        self.seen_batch_indices = []
        for batch in self.batch_sampler:
            self.seen_batch_indices.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler: the wrapped sampler's
        if name == "batch_sampler":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def recording_batch_indices(loader: Any) -> Any:
    """``loader`` copied to record its batches' indices (:class:`SeenBatchIndices`), or as it is where it
    has no batch sampler (an IterableDataset's, or ``batch_size=None``) or is not a DataLoader."""
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        return loader
    return with_batch_sampler(loader, SeenBatchIndices(loader.batch_sampler))
