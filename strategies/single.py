"""One process on one device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, and ``"auto"`` detection.

``"auto"`` picks CUDA, then MPS, then the CPU, and :func:`describe_devices` says what it found, so
that a run on the wrong hardware is visible in the first lines of its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from callbacks.console import MisconfigurationException
from strategies.base import Strategy
from strategies.prefetch import check_prefetch
from strategies.transfer import pinned_loader, return_to_host


def cuda_device_lines() -> list[str]:
    """Name, memory and compute capability of every visible CUDA device."""
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            f"cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"compute capability {props.major}.{props.minor}"
        )
    return lines


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def auto_device() -> torch.device:
    """The best device of this machine: CUDA, then MPS, then the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def check_cuda_index(index: int, argument: str) -> None:
    """Raise a ValueError naming what exists when ``cuda:index`` does not."""
    if not torch.cuda.is_available():
        raise MisconfigurationException(
            f"{argument} asks for a CUDA device, but PyTorch sees none "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
            'Use strategy="cpu" or "auto", or install a CUDA build of PyTorch.'
        )
    count = torch.cuda.device_count()
    if index >= count:
        visible = ", ".join(f"cuda:{i}" for i in range(count))
        raise MisconfigurationException(
            f"{argument} asks for cuda:{index}; {count} CUDA device(s) visible ({visible}). "
            "Use one of those or check CUDA_VISIBLE_DEVICES."
        )


class SingleDevice(Strategy):
    """Train in this process on one device.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``.
        prefetch: copy the next batch to the GPU on a side stream while the current one computes
            (:mod:`strategies.prefetch`). None (the default) is on for CUDA, off elsewhere.

    On CUDA a DataLoader that does not pin its batches is rebuilt to pin their CPU tensors
    (:func:`strategies.transfer.pinned_loader`).

    Example::

        Trainer(strategy=SingleDevice("cuda:1"))
        Trainer(strategy=SingleDevice("cuda", prefetch=False))  # copy each batch when the step needs it
    """

    def __init__(self, device: str | torch.device = "cpu", prefetch: bool | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        self.prefetch = prefetch
        self.detected = False  # set by "auto": the report then says the device was chosen
        self._placed: nn.Module | None = None  # the module setup_module moved, until teardown

    def validate(self) -> None:
        check_prefetch(self.prefetch, self.device.type, type(self).__name__)
        if self.device.type == "cuda":
            check_cuda_index(self.device.index, f'strategy="{self.device}"')
        elif self.device.type == "mps" and not mps_available():
            raise MisconfigurationException(
                'strategy="mps" asks for an Apple GPU, but torch.backends.mps.is_available() is '
                'False. Use strategy="auto" or "cpu", or a PyTorch build with MPS on macOS 12.3+.'
            )

    def setup_environment(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def setup_dataloader(self, dataloader: Any, *, shuffle: bool, contiguous: bool = False) -> Any:
        return pinned_loader(dataloader) if self.device.type == "cuda" else dataloader

    def describe(self) -> str:
        how = "detected" if self.detected else "chosen"
        if self.device.type == "cuda":
            lines = cuda_device_lines()
            text = f"Training on {self.device} ({how}). CUDA devices: {'; '.join(lines)}"
            if len(lines) > 1:  # Lightning's Trainer() would take them all; say how
                text += f' This run uses one; Trainer(devices={len(lines)}) or strategy="ddp" trains on all of them.'
            return text
        if self.device.type == "mps":
            return f"Training on the Apple GPU (mps, {how})."
        note = "" if not self.detected else " No CUDA or MPS device was found: training will be slow."
        return f"Training on the CPU ({how}, {torch.get_num_threads()} threads).{note}"

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._placed = module
        return module.to(self.device)

    def teardown(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """The module and its optimizers' states go back to the CPU and the GPU's cache is emptied
        (as in Lightning)."""
        placed, self._placed = self._placed, None
        if placed is not None:
            return_to_host(placed, self.device, optimizers)
