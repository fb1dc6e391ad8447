"""Where and how many: device placement, process launch, model wrapping, collectives.

``resolve_strategy`` turns the Trainer's ``strategy=`` and ``devices=`` arguments into a
:class:`Strategy`; it is the one string registry of the project.
"""

from __future__ import annotations

import cadence_shadowing

cadence_shadowing.check_packages()  # first: a user's trainer.py or strategies.py is named, not misread

import os
from typing import TYPE_CHECKING, Any

from strategies.base import Strategy
from strategies.mps import MPS
from strategies.single import SingleDevice, auto_device

if TYPE_CHECKING:
    from strategies.ddp import DDP

__all__ = ["DDP", "MPS", "SingleDevice", "Strategy", "resolve_strategy"]

STRATEGY_NAMES = '"auto", "cpu", "cuda", "cuda:N", "mps", "ddp" or a strategies.Strategy'


def __getattr__(name: str) -> Any:
    # DDP pulls in torch.distributed machinery; load it when first named, not at import.
    if name == "DDP":
        from strategies.ddp import DDP

        return DDP
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")


def _single_device_count(devices: Any, strategy: str) -> None:
    if devices not in ("auto", 1, None):
        raise ValueError(
            f'Trainer(strategy="{strategy}", devices={devices!r}) runs one process on one device. '
            'Use devices=1 (or "auto"), or strategy="ddp" to train on several devices.'
        )


def resolve_strategy(strategy: Any, devices: Any = "auto") -> Strategy:
    """Turn ``Trainer(strategy=..., devices=...)`` into a Strategy, or raise a ValueError that says
    what would work."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise ValueError(
            f"Trainer(strategy={strategy!r}) is not a strategy. Use {STRATEGY_NAMES}."
        )
    name = strategy.strip().lower()
    if name == "ddp":
        from strategies.ddp import DDP

        return DDP(devices=devices)
    if name == "auto":
        from strategies.process_group import launched_by_torchrun

        # Under torchrun with several processes, "auto" joins the group, as "ddp" does.
        if (isinstance(devices, int) and devices > 1) or (launched_by_torchrun() and os.environ["WORLD_SIZE"] != "1"):
            from strategies.ddp import DDP

            return DDP(devices=devices)
        _single_device_count(devices, strategy)
        chosen = SingleDevice(auto_device())
        chosen.detected = True
        return chosen
    if name == "mps":
        _single_device_count(devices, strategy)
        return MPS()
    if name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        _single_device_count(devices, strategy)
        return SingleDevice(name)
    raise ValueError(f'Trainer(strategy="{strategy}") is not a strategy. Use {STRATEGY_NAMES}.')
