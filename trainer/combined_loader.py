"""Lightning's ``CombinedLoader``: several loaders iterated together, under one of four modes.

A collection of loaders (a list, tuple, dict, or any nesting of them) is one training loader in
Lightning: each batch is that collection with a batch of each loader in its place (``{"a": batch_a,
"b": batch_b}``). Validation, test and predict run several loaders one after the other instead
(``dataloader_idx`` 0, 1, ...). The modes say when an epoch ends:

- ``"max_size_cycle"`` (training's default): with the longest loader; the shorter ones start over.
- ``"max_size"``: with the longest loader; an exhausted loader's place holds None.
- ``"min_size"`` (the class's default): with the shortest loader.
- ``"sequential"`` (evaluation's way): each loader in turn, ``(batch, batch_idx, dataloader_idx)``;
  ``fit`` refuses it, as Lightning does.

Iterating a CombinedLoader yields ``(batch, batch_idx, dataloader_idx)`` as in Lightning; the Trainer
takes the batch. ``flattened`` is the loaders in order (the Trainer shards and seeds each, then sets it
back), ``limits`` the batches to take from each (``limit_*_batches``).
"""

from __future__ import annotations

import collections.abc
import math
from collections.abc import Iterable, Iterator
from typing import Any

from callbacks.console import MisconfigurationException

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


class _Loader:
    """Marks a place in a collection's structure that holds a loader (:func:`flatten`'s structure of a
    loader on its own)."""

    def __reduce__(self) -> str:
        return "LOADER"  # unpickled (a DDP worker) as this module's one marker, which `is` compares


LOADER = _Loader()
_DONE = object()  # what next() gives an exhausted iterator


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """The loaders in ``tree`` in order, and its structure for :func:`unflatten`. Lists, tuples
    (named ones too) and mappings are walked; anything else, and a collection of plain numbers or
    strings (a list of batches, as Lightning's pytree takes it), is one loader."""
    if _is_leaf(tree):
        return [tree], LOADER
    if isinstance(tree, collections.abc.Mapping):
        keys, children = list(tree), list(tree.values())
    else:
        keys, children = None, list(tree)
    leaves: list[Any] = []
    specs = []
    for child in children:
        found, spec = flatten(child)
        leaves += found
        specs.append(spec)
    return leaves, (type(tree), keys, specs)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """The structure ``spec`` (from :func:`flatten`) with ``leaves`` in its places."""
    values = iter(leaves)
    return _rebuild(values, spec)


def _rebuild(values: Iterator[Any], spec: Any) -> Any:
    if spec is LOADER:
        return next(values)
    kind, keys, specs = spec
    children = [_rebuild(values, child) for child in specs]
    if keys is not None:
        return kind(zip(keys, children)) if kind in (dict, collections.OrderedDict) else dict(zip(keys, children))
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        return kind(*children)
    return kind(children) if kind in (list, tuple) else list(children)


def _is_leaf(tree: Any) -> bool:
    if not isinstance(tree, (list, tuple, collections.abc.Mapping)):
        return True
    children = tree.values() if isinstance(tree, collections.abc.Mapping) else tree
    return all(isinstance(child, (int, float, str)) for child in children)


def length_of(iterable: Any) -> int | float:
    """``len(iterable)``, or inf when it has none (an IterableDataset's loader, a generator)."""
    try:
        length = len(iterable)
    except (TypeError, NotImplementedError):
        return math.inf
    return math.inf if length is None else length


class CombinedLoader(Iterable):
    """Iterates the loaders in ``iterables`` (one, or a list/tuple/dict of them, nested as you like)
    together under ``mode`` (see the module's docstring); each item is ``(batch, batch_idx, dataloader_idx)``.

    Example::

        loaders = {"labeled": DataLoader(a, batch_size=8), "unlabeled": DataLoader(b, batch_size=32)}
        trainer.fit(model, CombinedLoader(loaders, "max_size_cycle"))  # batch["labeled"], batch["unlabeled"]
    """

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise MisconfigurationException(f"Unsupported mode {mode!r}, please select one of: {list(MODES)}.")
        self._iterables = iterables
        self._flattened, self._spec = flatten(iterables)
        self._mode = mode
        self._limits: list[int | float] | None = None
        self._iterator: _ModeIterator | None = None

    @property
    def iterables(self) -> Any:
        """The collection of loaders as given (or as the Trainer prepared them)."""
        return self._iterables

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def flattened(self) -> list[Any]:
        """The loaders, in order."""
        return self._flattened

    @flattened.setter
    def flattened(self, flattened: list[Any]) -> None:
        if len(flattened) != len(self._flattened):
            raise MisconfigurationException(
                f"Mismatch in flattened length ({len(flattened)}) and existing length "
                f"({len(self._flattened)}): set as many loaders as the CombinedLoader holds.")
        self._iterables = unflatten(flattened, self._spec)
        self._flattened = list(flattened)

    @property
    def sampler(self) -> Any:
        """Each loader's sampler (None where it has none), in the structure of :attr:`iterables`."""
        return unflatten([getattr(loader, "sampler", None) for loader in self._flattened], self._spec)

    @property
    def batch_sampler(self) -> Any:
        """Each loader's batch sampler (None where it has none), in the structure of :attr:`iterables`."""
        return unflatten([getattr(loader, "batch_sampler", None) for loader in self._flattened], self._spec)

    @property
    def limits(self) -> list[int | float] | None:
        """The most batches taken from each loader (None: all)."""
        return self._limits

    @limits.setter
    def limits(self, limits: int | float | list[int | float] | None) -> None:
        if isinstance(limits, (int, float)):
            limits = [limits] * len(self._flattened)
        elif isinstance(limits, list) and len(limits) != len(self._flattened):
            raise MisconfigurationException(
                f"Mismatch in number of limits ({len(limits)}) and number of iterables "
                f"({len(self._flattened)}): give one limit per loader, or one for all.")
        self._limits = limits

    def __iter__(self) -> CombinedLoader:
        self._iterator = _ITERATORS[self._mode](self._flattened, self._limits)
        return self

    def __next__(self) -> tuple[Any, int, int]:
        if self._iterator is None:
            iter(self)
        batch, batch_idx, dataloader_idx = next(self._iterator)
        if self._mode != "sequential":
            batch = unflatten(batch, self._spec)
        return batch, batch_idx, dataloader_idx

    def __len__(self) -> int:
        """The batches of one pass under the mode and :attr:`limits` (as Lightning, after ``iter``)."""
        if self._iterator is None:
            raise RuntimeError("Please call `iter(combined_loader)` first: a CombinedLoader's length is "
                               "known once it iterates.")
        return self.length()

    def length(self) -> int | float:
        """The batches of one pass under the mode and :attr:`limits`; inf when a loader has no length
        and the mode needs it."""
        lengths = [length_of(loader) for loader in self._flattened]
        limits = self._limits
        if self._mode == "min_size":
            return min(lengths + list(limits or []))
        capped = lengths if limits is None else [min(length, limit) for length, limit in zip(lengths, limits)]
        return sum(capped) if self._mode == "sequential" else max(capped)

    def reset(self) -> None:
        """Forget the running pass and end the loaders' worker processes."""
        self._iterator = None
        for loader in self._flattened:
            if getattr(loader, "_iterator", None) is not None:
                shutdown = getattr(loader._iterator, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                loader._iterator = None

    def _dataset_length(self) -> int:
        """The samples of one pass under the mode, from the loaders' datasets (those with a length)."""
        lengths = [length_of(getattr(loader, "dataset", None)) for loader in self._flattened]
        lengths = [length for length in lengths if length != math.inf]
        if not lengths:
            raise NotImplementedError("All datasets are iterable-style datasets: the CombinedLoader cannot count "
                                      "their samples.")
        return {"min_size": min, "sequential": sum}.get(self._mode, max)(lengths)

    def __getstate__(self) -> dict[str, Any]:
        # A running DataLoader iterator cannot be pickled: a pickled CombinedLoader starts a new pass.
        return {**self.__dict__, "_iterator": None}

    def __repr__(self) -> str:
        return f"CombinedLoader({self._iterables!r}, mode={self._mode!r})"


class _ModeIterator(Iterator[tuple[Any, int, int]]):
    """One pass over ``iterables``; each loader starts (its workers too) when the pass starts."""

    def __init__(self, iterables: list[Any], limits: list[int | float] | None) -> None:
        if limits is not None and len(limits) != len(iterables):
            raise MisconfigurationException(
                f"Mismatch in number of limits ({len(limits)}) and number of iterables "
                f"({len(iterables)})")
        self.iterables, self.limits = iterables, limits
        self.iterators = [iter(iterable) for iterable in iterables]
        self._idx = 0

    def _emit(self, out: Any, dataloader_idx: int = 0) -> tuple[Any, int, int]:
        index, self._idx = self._idx, self._idx + 1
        return out, index, dataloader_idx


class _MaxSizeCycle(_ModeIterator):
    def __init__(self, iterables: list[Any], limits: list[int | float] | None) -> None:
        super().__init__(iterables, limits)
        self._consumed = [False] * len(iterables)

    def __next__(self) -> tuple[Any, int, int]:
        out = []
        for index, iterator in enumerate(self.iterators):
            try:
                out.append(next(iterator))
            except StopIteration:
                self._consumed[index] = True
                if all(self._consumed):
                    raise
                self.iterators[index] = iter(self.iterables[index])  # the shorter loader starts over
                out.append(next(self.iterators[index]))
        return self._emit(out)


class _MaxSize(_ModeIterator):
    def __next__(self) -> tuple[Any, int, int]:
        out, exhausted = [], 0
        for iterator in self.iterators:
            value = next(iterator, _DONE)
            exhausted += value is _DONE
            out.append(None if value is _DONE else value)
        if exhausted == len(out):
            raise StopIteration
        return self._emit(out)


class _MinSize(_ModeIterator):
    def __next__(self) -> tuple[Any, int, int]:
        return self._emit([next(iterator) for iterator in self.iterators])


class _Sequential(_ModeIterator):
    def __init__(self, iterables: list[Any], limits: list[int | float] | None) -> None:
        self.iterables, self.limits, self._idx = iterables, limits, 0
        if limits is not None and len(limits) != len(iterables):
            raise MisconfigurationException(
                f"Mismatch in number of limits ({len(limits)}) and number of iterables "
                f"({len(iterables)})")
        self._iterator_idx = 0
        self.iterators = [iter(iterables[0])] if iterables else []  # one loader's workers at a time

    def __next__(self) -> tuple[Any, int, int]:
        while self._iterator_idx < len(self.iterables):
            limit = math.inf if self.limits is None else self.limits[self._iterator_idx]
            if self._idx < limit:
                value = next(self.iterators[0], _DONE)
                if value is not _DONE:
                    return self._emit(value, self._iterator_idx)
            self._iterator_idx, self._idx = self._iterator_idx + 1, 0
            if self._iterator_idx < len(self.iterables):
                self.iterators = [iter(self.iterables[self._iterator_idx])]
        self.iterators = []
        raise StopIteration


_ITERATORS = {"min_size": _MinSize, "max_size_cycle": _MaxSizeCycle, "max_size": _MaxSize, "sequential": _Sequential}
