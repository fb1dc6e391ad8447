"""Seeding and RNG state: Python, NumPy, torch, every CUDA device and the Apple GPU (MPS); DataLoader
workers per worker and rank; the RNG states a checkpoint keeps, and a context that keeps them unchanged."""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler

from callbacks.console import MisconfigurationException


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device), as Lightning's function does.

    Args:
        seed: an int in [0, 2**32 - 1]. None: the ``PL_GLOBAL_SEED`` environment variable (a run
            launched by one that called this), else 0, with a warning, as in Lightning 2.6.
        workers: also seed each DataLoader worker the Trainer starts (per worker and per rank), for
            loaders without a ``worker_init_fn`` (``Trainer(seed=...)`` always does).
        verbose: say which seed was set (on stderr, ``[rank: N]`` in front under torchrun).

    Returns:
        The seed. It is also left in ``PL_GLOBAL_SEED`` (and ``workers`` in ``PL_SEED_WORKERS``),
        where processes started later read it, as in Lightning.
    """
    if seed is None:
        given = os.environ.get("PL_GLOBAL_SEED")
        if given is None:
            seed = 0
            if verbose:
                warnings.warn(f"No seed found, seed set to {seed}", stacklevel=2)
        elif given.strip().isdigit():
            seed = int(given)
        else:
            raise MisconfigurationException(
                f"Invalid seed specified via PL_GLOBAL_SEED: {given!r}. Set it to an int in "
                "[0, 2**32 - 1], or pass seed_everything(seed=...).")
    seed_generators(seed)
    if verbose:
        rank = os.environ.get("RANK", "")
        print(f"{f'[rank: {rank}] ' if rank.isdigit() else ''}Seed set to {seed}", file=sys.stderr, flush=True)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(bool(workers)))
    return seed


def seed_generators(seed: int) -> int:
    """Seed Python, NumPy and torch with ``seed`` (checked), saying nothing: ``Trainer(seed=...)``
    at the start of each stage. Returns the seed."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise MisconfigurationException(f"seed_everything(seed={seed!r}): use an int in [0, 2**32 - 1].")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    return seed


def reset_seed() -> None:
    """Seed again with the seed :func:`seed_everything` left in ``PL_GLOBAL_SEED`` (in this process or
    the one that started it); nothing if it was not called. As in Lightning, every process of a
    distributed stage calls it when the stage sets up, so each spawned rank starts from that seed."""
    seed = os.environ.get("PL_GLOBAL_SEED", "")
    if seed.strip().isdigit():
        seed_generators(int(seed))


def workers_seeded() -> bool:
    """``seed_everything(..., workers=True)`` was called in this process or the one that started it."""
    return os.environ.get("PL_SEED_WORKERS") == "1"


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that seeds Python and NumPy from the worker's torch seed.

    PyTorch gives each worker ``base_seed + worker_id`` for torch; Python and NumPy would
    otherwise repeat the same stream in every worker. The base seed comes from the loader's
    generator, which the Trainer seeds per epoch and per rank.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def seed_worker_of_rank(rank: int):
    """A picklable ``worker_init_fn`` whose workers differ by rank as well as by worker id."""
    return functools.partial(_seed_worker_with_rank, rank=rank)


_MASK64 = (1 << 64) - 1


def _seed_worker_with_rank(worker_id: int, rank: int) -> None:
    """Lightning's ``pl_worker_init_function``, so that a worker draws what it draws under Lightning: torch,
    Python and NumPy seeded from the loader's base seed (torch gives the worker ``base + worker_id``), the
    worker id and the rank, mixed by MurmurHash3's finalizer and stepped by Knuth's LCG; NumPy through its
    own ``SeedSequence`` of the three."""
    base = torch.initial_seed() - worker_id
    mixed = (base << 32) | (worker_id << 16) | rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        mixed = ((mixed ^ (mixed >> 33)) * multiplier) & _MASK64
    mixed ^= mixed >> 33
    seeds = []
    for _ in range(3):
        mixed = (mixed * 6364136223846793005 + 1) & _MASK64
        seeds.append(mixed)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    np.random.seed(np.random.SeedSequence([base, worker_id, rank]).generate_state(4))


def seeded_generator(loader: Any, seed: int) -> dict[str, Any]:
    """The DataLoader settings that give ``loader`` its own generator seeded with ``seed``: for the
    workers' base seed, and for a plain ``RandomSampler`` without one (``shuffle=True``), its order."""
    generator = torch.Generator().manual_seed(seed)
    changes: dict[str, Any] = {"generator": generator}
    sampler = loader.sampler
    if loader.batch_size is not None and type(sampler) is RandomSampler and sampler.generator is None:
        changes["sampler"] = RandomSampler(loader.dataset, replacement=sampler.replacement,
                                           num_samples=sampler.num_samples, generator=generator)
    return changes


def capture_rng_state() -> dict:
    """Every global RNG's state as plain data and tensors (loadable with ``weights_only=True``)."""
    numpy_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": numpy_state[0],
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "pos": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "torch": torch.get_rng_state(),
        # Only once CUDA is in use: asking earlier would create a context on every device.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        # The Apple GPU's generator (dropout on MPS draws from it); None without one.
        "mps": torch.mps.get_rng_state() if _mps_available() else None,
    }


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def restore_rng_state(state: dict) -> None:
    """Undo :func:`capture_rng_state`."""
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    numpy_state = state["numpy"]
    np.random.set_state((
        numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
        numpy_state["has_gauss"], numpy_state["cached_gaussian"],
    ))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            warnings.warn(
                f"The RNG states are of {len(state['cuda'])} CUDA devices, but {torch.cuda.device_count()} "
                "are visible; the devices both have are restored, so random draws on CUDA may differ "
                "from the run that saved them. Resume with the same CUDA_VISIBLE_DEVICES to continue exactly.",
                stacklevel=2,
            )
        for device, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)
    if state.get("mps") is not None and _mps_available():  # absent from checkpoints of older versions
        torch.mps.set_rng_state(state["mps"])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the body, then put every global RNG back as it was.

    The Trainer validates inside this context, so validating (whose DataLoader draws a worker
    seed from torch's RNG) changes nothing the training run draws afterwards: a run with
    validation trains the same weights as one without, and a resumed run continues exactly.
    """
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


def set_cublas_workspace_config() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG``, which deterministic cuBLAS needs, unless the user did.

    cuBLAS reads it when it first runs in a process, so ``Trainer(deterministic=True)`` sets it at
    construction, before any stage (spawned DDP workers inherit it). Set after CUDA started, it
    may be too late: a warning says so and how to set it in time.
    """
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        return
    if torch.cuda.is_initialized():
        warnings.warn(
            "Trainer(deterministic=True) sets CUBLAS_WORKSPACE_CONFIG=:4096:8, but CUDA is already in use in this "
            "process: if cuBLAS has run (a matrix product on the GPU), it keeps its nondeterministic workspace. "
            "Export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python, or build the Trainer before any GPU work.",
            stacklevel=3,
        )
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def use_deterministic_algorithms() -> None:
    """``Trainer(deterministic=True)``: deterministic kernels (an error names any op without one)."""
    set_cublas_workspace_config()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
