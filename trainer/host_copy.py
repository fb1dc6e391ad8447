"""Metric values on their way from the device to the host, for the metric store (trainer/metrics.py).

One stacked tensor per device, copied with ``non_blocking=True`` (CUDA) and read when it has
arrived; ``sync_dist`` values reduced over the processes first, after a check that every rank logged
the same keys (a key only some ranks log would pair one rank's collective with another's next).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.stage_metrics import MetricSpec


class HostCopy:
    """Metric values on their way to the host: one stacked tensor per device, copied without blocking.

    Values logged on different devices (a CUDA loss beside a CPU tensor such as a learning rate)
    are grouped per device: CPU values are read as they are, a CUDA stack is copied into pinned
    memory with ``non_blocking=True`` and an event that says when it has arrived. No value moves
    between devices, and nothing waits for the GPU before :meth:`values`.
    """

    def __init__(self, step: int, named: dict[str, tuple[Any, MetricSpec]], reduce: Any, gather: Any) -> None:
        self.step = step
        self.specs = {key: spec for key, (_, spec) in named.items()}
        check_same_sync_keys(named, gather)
        self.numbers = {key: float(value) for key, (value, _) in named.items() if not isinstance(value, torch.Tensor)}
        tensor_keys = [key for key, (value, _) in named.items() if isinstance(value, torch.Tensor)]
        self.copies: list[tuple[list[str], Any, Any]] = []  # (keys, host tensor or CPU floats, ready event or None)
        # Reduced in sorted key order, so every rank's collectives pair up with the same key's.
        for key in sorted(self.numbers):
            if self.specs[key].sync_dist:
                self.numbers[key] = float(reduce(torch.tensor(self.numbers[key]), self.specs[key].reduce_fx))
        if not tensor_keys:
            return
        reduced = {key: reduce(_wide(named[key][0].detach().reshape(())), self.specs[key].reduce_fx)
                   for key in sorted(tensor_keys) if self.specs[key].sync_dist}
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for key in tensor_keys:
            value = reduced[key] if key in reduced else named[key][0]
            by_device.setdefault(value.device, []).append((key, value))
        for device, pairs in by_device.items():
            if device.type == "cpu":  # host values: read each now (a stack of 0-d tensors costs a view apiece)
                self.copies.append(([key for key, _ in pairs], [_wide(value).item() for _, value in pairs], None))
                continue
            stacked = torch.stack([_wide(value.detach().reshape(())) for _, value in pairs])  # float64 if any is
            ready = None
            if device.type == "cuda":
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(device))
            else:
                host = stacked.to("cpu")
            self.copies.append(([key for key, _ in pairs], host, ready))

    def values(self) -> dict[str, float]:
        """The host values; waits for the copies if they have not finished (they have, by the next log step)."""
        values = {}
        for keys, host, ready in self.copies:
            if ready is not None:
                ready.synchronize()
            values.update(zip(keys, host.tolist() if isinstance(host, torch.Tensor) else host))
        values.update(self.numbers)
        return {key: values[key] for key in self.specs}  # in the order they were logged, as Lightning's


def _wide(value: torch.Tensor) -> torch.Tensor:
    """``value`` as float32, or float64 if it is (``"64-true"``: as in Lightning, its digits reach the logs)."""
    return value if value.dtype == torch.float64 else value.float()


def gather_alone(obj: Any) -> list[Any]:
    return [obj]


def check_same_sync_keys(named: dict[str, tuple[Any, MetricSpec]], gather: Any) -> None:
    """Raise on every rank if the ranks logged different ``sync_dist`` keys.

    Each key is one collective; a key that only some ranks log would pair one rank's reduction
    with another's next collective and hang. One small gather per read (log steps, epoch ends)
    catches it first and names the key and the rank.
    """
    mine = tuple(sorted((key, isinstance(value, torch.Tensor)) for key, (value, spec) in named.items() if spec.sync_dist))
    everyone = gather(mine)
    if all(keys == mine for keys in everyone):
        return
    logged = [dict(keys) for keys in everyone]
    for key in sorted(set().union(*logged)):
        have = [rank for rank, keys in enumerate(logged) if key in keys]
        lacking = [rank for rank, keys in enumerate(logged) if key not in keys]
        if lacking:
            raise RuntimeError(
                f'self.log("{key}", ..., sync_dist=True) was called on rank(s) {have} but not on rank(s) '
                f"{lacking}. Every rank must log the same sync_dist keys at the same steps, or the "
                "reductions cannot pair up. Log it on every rank, or with sync_dist=False if it is rank-local."
            )
        kinds = {logged[rank][key] for rank in have}
        if len(kinds) > 1:
            tensors = [rank for rank in have if logged[rank][key]]
            raise RuntimeError(
                f'self.log("{key}", ..., sync_dist=True) got a tensor on rank(s) {tensors} and a Python number '
                "on the others. Log the same type on every rank."
            )
