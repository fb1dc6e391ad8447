"""Exact mid-epoch resume: where the data of an epoch comes from, and how to continue it.

The order of an epoch's batches is drawn when its sampler starts iterating (a ``RandomSampler``
draws a seed from torch's RNG, or from its own generator). :class:`ResumableBatchSampler` wraps
the training loader's batch sampler, records the RNG state at that instant every epoch, and on
resume replays the draw from the recorded state and skips the batches already trained as lists
of indices: resuming costs O(batches skipped) index arithmetic, never a fetched or collated batch.
It then sets the global RNG to the checkpoint's, so dropout and in-process augmentation continue
exactly where the killed run stopped.

Not covered: randomness inside DataLoader *worker* processes (augmentation in ``__getitem__`` with
``num_workers > 0``). Workers receive batches round-robin, so after a skip each worker sees
different samples than it would have, and its RNG stream differs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from strategies.loaders import remaining_batches, with_batch_sampler
from trainer.data import loader_length
from trainer.seed import capture_rng_state, restore_rng_state
from callbacks.console import PossibleUserWarning, warn


class ResumableBatchSampler:
    """A batch sampler that records the RNG its epoch starts from and can replay an epoch.

    Args:
        batch_sampler: the loader's batch sampler (a ``BatchSampler`` or the user's own).
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.epoch_start_rng: dict | None = None  # recorded when an epoch's iteration begins
        self._replay: tuple[dict, int, dict] | None = None

    @property
    def sampler(self) -> Any:
        """The wrapped sampler's sampler, so ``set_epoch`` reaches a ``DistributedSampler``."""
        return getattr(self.batch_sampler, "sampler", None)

    def generator_states(self) -> list[torch.Tensor]:
        """The states of the sampler's own generators now (a checkpoint keeps them: the next
        epoch's order is drawn from them)."""
        return [generator.get_state() for generator in _generators(self.batch_sampler)]

    def set_generator_states(self, states: list[torch.Tensor]) -> None:
        """Undo :meth:`generator_states` (a checkpoint without them, or with other generators, changes nothing)."""
        _set_generators(self.batch_sampler, states)

    def replay(self, epoch_start_rng: dict, skip: int, rng_after: dict, batches: list | None = None) -> None:
        """Make the next epoch redraw its order from ``epoch_start_rng``, drop its first ``skip``
        batches (or, given ``batches``, yield those instead: :func:`resharded`), then set the
        global RNG to ``rng_after`` (the checkpoint's)."""
        self._replay = (epoch_start_rng, skip, rng_after, batches)

    def __iter__(self) -> Iterator[Any]:
        # The RNG is recorded (or replayed) when the first batch is asked for, not at iter(): a loader
        # with workers calls iter() twice and draws its base seed in between; recording at iter()
        # would make the replayed order differ. Hot loop: then the batches come through C iterators.
        if self._replay is None:
            return itertools.chain(self._record(), self.batch_sampler)
        return self._replayed()

    def _record(self) -> Iterator[Any]:
        self.epoch_start_rng = _capture(self.batch_sampler)
        yield from ()

    def _replayed(self) -> Iterator[Any]:
        epoch_start_rng, skip, rng_after, batches = self._replay
        self._replay = None
        _restore(self.batch_sampler, epoch_start_rng)
        self.epoch_start_rng = epoch_start_rng
        iterator = iter(self.batch_sampler) if batches is None else iter(batches)
        for _ in range(skip if batches is None else 0):  # indices only: no sample is read
            if next(iterator, None) is None:
                break
        # Runs when the loader asks for its first batch of indices, so the loader's own draws at
        # iter() (a worker seed) and the epoch-start hooks are overwritten too.
        restore_rng_state(rng_after)
        yield from iterator

    def __len__(self) -> int:
        return len(self.batch_sampler)


def resumable(loader: Any) -> tuple[Any, ResumableBatchSampler | None]:
    """``loader`` with its batch sampler wrapped in a :class:`ResumableBatchSampler`, and the wrapper.

    Loaders that have no batch sampler (an IterableDataset, ``batch_size=None``, or not a
    DataLoader) come back unchanged with None; resuming them fetches and drops batches.
    """
    if (not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None):
        return loader, None
    if isinstance(loader.batch_sampler, ResumableBatchSampler):
        return loader, loader.batch_sampler
    sampler = ResumableBatchSampler(loader.batch_sampler)
    return with_batch_sampler(loader, sampler), sampler


def resharded(sampler: ResumableBatchSampler | None, skip: int, written_by: int, length: int | None,
              ) -> tuple[int, list | None]:
    """Where an epoch resumes when the checkpoint was written by ``written_by`` processes, each
    ``skip`` batches into it, and this run has another number (``torchrun --nnodes=MIN:MAX``):
    the samples trained so far carry over, not the batch count. Under DDP's ``DistributedSampler``
    they are exactly the first ``skip * batch_size * written_by`` of the epoch's order, and the rest
    is dealt out among this run's processes (:func:`strategies.loaders.remaining_batches`).

    Returns ``(first, batches)``: this rank's batches still to train, and the index of the first
    (so that the epoch's last batch keeps its index ``length - 1``). ``(skip, None)`` when the
    numbers of processes agree, or the loader is not dealt out by a DistributedSampler.
    """
    inner = sampler.sampler if sampler is not None else None
    if not isinstance(inner, DistributedSampler) or inner.num_replicas == written_by:
        return skip, None
    batches = remaining_batches(sampler.batch_sampler, skip * sampler.batch_sampler.batch_size * written_by)
    if batches is None:
        return skip, None
    return max(0, (length if length is not None else len(batches)) - len(batches)), batches


def loader_states(loader: Any, read_ahead: bool) -> list[Any] | None:
    """The ``state_dict()`` of each iterable of the training ``loader`` that has ``state_dict`` and
    ``load_state_dict`` (a stateful iterable, torchdata's StatefulDataLoader), None for the others; None
    when none has one. A checkpoint keeps them: a resumed run loads them instead of fetching and dropping
    the batches already trained, as Lightning does. None too when the loop has ``read_ahead`` (the CUDA
    copy of the next batch, a loader without a length): the states would be a batch past the step."""
    if loader is None or read_ahead or loader_length(loader) is None:
        return None
    states = [each.state_dict() if callable(getattr(each, "state_dict", None)) and callable(
        getattr(each, "load_state_dict", None)) else None for each in _iterables(loader)]
    return states if any(state is not None for state in states) else None


def _iterables(loader: Any) -> list[Any]:
    return list(loader.flattened) if type(loader).__name__ == "CombinedLoader" else [loader]


def resume_iterator(loader: Any, sampler: ResumableBatchSampler | None, skip: int, rng: dict,
                    batches: list | None = None) -> Iterator[Any]:
    """An iterator over ``loader`` that starts after its first ``skip`` batches of the epoch.

    Args:
        loader: the training loader (as returned by :func:`resumable`).
        sampler: its wrapper, or None when it has none.
        skip: the batches of this epoch already trained.
        rng: this rank's ``{"now": ..., "epoch_start": ...}`` RNG states from the checkpoint.
        batches: the batches of indices still to train, from :func:`resharded` (``skip`` unused).
    """
    if sampler is not None and rng.get("epoch_start") is not None:
        sampler.replay(rng["epoch_start"], skip, rng["now"], batches)
        return iter(loader)
    states, iterables = rng.get("loaders"), _iterables(loader)
    if states is not None and len(states) == len(iterables) and None not in states:
        for iterable, state in zip(iterables, states):  # as Lightning: each continues where its state says
            iterable.load_state_dict(state)
        iterator = iter(loader)
        restore_rng_state(rng["now"])
        return iterator
    what = ("several loaders combined (a CombinedLoader)" if type(loader).__name__ == "CombinedLoader" else
            f"a {type(loader).__name__} without a batch sampler (an IterableDataset, batch_size=None, or not a "
            "DataLoader)")
    if all(callable(getattr(each, "load_state_dict", None)) for each in iterables):  # stateful, but no state saved
        what += (" whose checkpoint holds no state of it (written from a loader without state_dict, or while the "
                 "loop read a batch ahead)")
    warn(f"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable. "
         f"Resuming mid-epoch on {what}: the {skip} batches already trained are fetched and dropped, and a loader "
         "that shuffles may not repeat the killed run's order.", PossibleUserWarning)
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator, None)
    restore_rng_state(rng["now"])
    return iterator


# A sampler may draw from its own generator instead of the global RNG (RandomSampler(generator=g),
# DataLoader(shuffle=True, generator=g)); those states are recorded with the global ones.
def _generators(batch_sampler: Any) -> list[torch.Generator]:
    found: dict[int, torch.Generator] = {}
    for owner in (batch_sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            found.setdefault(id(generator), generator)
    return list(found.values())


def _capture(batch_sampler: Any) -> dict:
    return {**capture_rng_state(), "generators": [generator.get_state() for generator in _generators(batch_sampler)]}


def _restore(batch_sampler: Any, state: dict) -> None:
    restore_rng_state(state)
    _set_generators(batch_sampler, state.get("generators", []))


def _set_generators(batch_sampler: Any, states: list[torch.Tensor]) -> None:
    generators = _generators(batch_sampler)
    if len(generators) == len(states):
        for generator, state in zip(generators, states):
            generator.set_state(state)


def failed_before_batch_end(error: BaseException | None) -> bool:
    """Whether ``error``, being handled, came out of a training batch before the batch was trained:
    out of its ``on_train_batch_start`` hooks or its step (forward, backward, optimizer step), as
    the epoch loop called them. A checkpoint written while handling it (``OnExceptionCheckpoint``,
    ``ModelCheckpoint(save_on_exception=True)``) then records the batch as not done, and the
    resumed run trains it again, as Lightning's batch progress does (``ready`` and ``started``
    go back to ``completed``). Read from the traceback, so that the loop pays nothing per batch."""
    frame = error.__traceback__ if error is not None else None
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "_run_train_epoch" and frame.tb_next is not None:
            return frame.tb_next.tb_frame.f_code.co_name in ("_training_step", "on_train_batch_start")
        frame = frame.tb_next
    return False
