"""A communication check to run before a long multi-process or multi-node job.

``check_communication`` runs ``all_reduce`` over a range of tensor sizes across the group,
verifies every element of the result on every rank, and measures latency and bus bandwidth per
size. It spawns ``devices`` processes from a plain ``python`` (or ``cadence diagnose comm``), or
joins the group under torchrun, which is how it checks the links between machines::

    cadence diagnose comm --devices 2
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        -m trainer diagnose comm

Bus bandwidth follows nccl-tests: an all-reduce of S bytes over n ranks that takes t seconds moves
``S / t * 2 (n - 1) / n`` bytes per second through each rank's link, which is comparable across
world sizes and with the link's rated speed.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from callbacks.console import MisconfigurationException

#: Default sizes in bytes: 4 KiB (latency) up to 64 MiB (bandwidth).
DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20, 64 * 2**20)
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536. Units: B, K/KiB, M/MiB, G/GiB (powers of two)."""
    cleaned = text.strip().upper()
    digits = cleaned.rstrip("BKMGI")
    unit = cleaned[len(digits):]
    if not digits.isdigit() or unit not in _UNITS or int(digits) <= 0:
        raise MisconfigurationException(
            f"size {text!r}: use a positive number of bytes with an optional unit, like 4096, 64K or 16M.")
    return int(digits) * _UNITS[unit]


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second through each rank's link for an all-reduce (nccl-tests' busbw)."""
    return size_bytes / seconds * 2 * (world_size - 1) / world_size if seconds > 0 else 0.0


@dataclass
class SizeResult:
    """One tensor size: mean time of one all_reduce (slowest rank), bandwidth, correctness."""

    size_bytes: int
    latency_s: float
    bus_bandwidth: float  # bytes per second
    wrong_ranks: list[int]


@dataclass
class CommunicationReport:
    """What :func:`check_communication` found; ``str(report)`` is the printed table and verdict."""

    world_size: int
    backend: str
    device: str
    hosts: list[str]
    results: list[SizeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not result.wrong_ranks for result in self.results)

    @property
    def verdict(self) -> str:
        if not self.ok:
            wrong = sorted({rank for result in self.results for rank in result.wrong_ranks})
            sizes = [format_size(result.size_bytes) for result in self.results if result.wrong_ranks]
            return (f"FAIL: all_reduce returned wrong numbers on rank(s) {wrong} at {', '.join(sizes)}. Do not "
                    "train on this group: check the GPUs, drivers and NCCL version of those ranks' machines.")
        best = max(self.results, key=lambda result: result.bus_bandwidth)
        smallest = min(self.results, key=lambda result: result.size_bytes)
        text = (f"OK: {self.world_size} ranks on {len(set(self.hosts))} machine(s) agree on every all_reduce; "
                f"peak bus bandwidth {best.bus_bandwidth / 1e9:.2f} GB/s at {format_size(best.size_bytes)}, "
                f"latency {smallest.latency_s * 1e6:.0f} us at {format_size(smallest.size_bytes)}.")
        if self.backend == "nccl" and len(set(self.hosts)) > 1 and best.bus_bandwidth < 1e9:
            text += (" The link between machines is slow for NCCL (under 1 GB/s): check NCCL_SOCKET_IFNAME "
                     "and that InfiniBand/EFA is in use (NCCL_DEBUG=INFO says which transport it chose).")
        if self.backend == "gloo":
            text += " (gloo on the CPU: GPU training uses NCCL, whose numbers differ.)"
        return text

    def __str__(self) -> str:
        lines = [f"all_reduce over {self.world_size} ranks ({self.backend}, {self.device}) on {', '.join(sorted(set(self.hosts)))}",
                 f"{'size':>10}  {'latency':>12}  {'bus bandwidth':>14}  result"]
        for result in self.results:
            status = "ok" if not result.wrong_ranks else f"WRONG on ranks {result.wrong_ranks}"
            lines.append(f"{format_size(result.size_bytes):>10}  {result.latency_s * 1e6:>9.1f} us  "
                         f"{result.bus_bandwidth / 1e9:>9.3f} GB/s  {status}")
        lines.append(self.verdict)
        return "\n".join(lines)


def check_communication(devices: int | str = "auto", sizes: tuple[int, ...] = DEFAULT_SIZES, backend: str | None = None,
                        iterations: int | None = None, timeout: float = 120.0) -> CommunicationReport:
    """Run all_reduce over ``sizes`` on ``devices`` processes (or the torchrun group); return rank
    zero's report (under torchrun, every rank returns one).

    Args:
        devices: processes to spawn on this machine; ignored under torchrun ("auto" or the same count).
        sizes: tensor sizes in bytes.
        backend: "nccl" or "gloo"; default NCCL when CUDA is available.
        iterations: timed all_reduces per size; default: more for small sizes, fewer for large.
        timeout: seconds any collective may wait before the check fails and says which rank was missing.
    """
    from strategies.ddp import DDP

    if not sizes or any(isinstance(size, bool) or not isinstance(size, int) or size <= 0 for size in sizes):
        raise MisconfigurationException(f"check_communication(sizes={sizes!r}): use positive sizes in bytes.")
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1):
        raise MisconfigurationException(f"check_communication(iterations={iterations!r}): use an int >= 1 or None.")
    strategy = DDP(devices=devices, backend=backend, timeout=timeout)
    strategy.validate()
    return strategy.launch(_measure, strategy, tuple(sizes), iterations)


def _measure(strategy: Any, sizes: tuple[int, ...], iterations: int | None) -> CommunicationReport:
    strategy.setup_environment()
    try:
        world_size, rank, device = strategy.world_size, strategy.global_rank, strategy.device
        report = CommunicationReport(world_size, strategy.resolved_backend, str(device),
                                     strategy.all_gather_object(socket.gethostname()))
        for size in sizes:
            report.results.append(_measure_size(strategy, size, iterations, world_size, rank, device))
        return report
    finally:
        strategy.teardown()


def _measure_size(strategy: Any, size: int, iterations: int | None, world_size: int, rank: int,
                  device: torch.device) -> SizeResult:
    numel = max(1, size // 4)
    # Correctness first: rank r contributes r + 1, so every element must be n (n + 1) / 2.
    tensor = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(tensor)
    correct = bool((tensor == world_size * (world_size + 1) / 2).all())
    count = iterations or max(5, min(100, (256 * 2**20) // (size * max(1, world_size))))
    tensor.zero_()  # timed on zeros: values never overflow, and the time does not depend on them
    dist.all_reduce(tensor)  # warm-up (connection setup, NCCL channels)
    _synchronize(device)
    strategy.barrier("diagnose")
    start = time.perf_counter()
    for _ in range(count):
        dist.all_reduce(tensor)
    _synchronize(device)
    seconds = (time.perf_counter() - start) / count
    slowest = float(strategy.all_reduce(torch.tensor(seconds, dtype=torch.float64), "max"))
    wrong = [r for r, ok in enumerate(strategy.all_gather_object(correct)) if not ok]
    return SizeResult(numel * 4, slowest, bus_bandwidth(numel * 4, slowest, world_size), wrong)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
