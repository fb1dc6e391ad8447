"""Where and how many: device placement, process launch, model wrapping, collectives.

``resolve_strategy`` turns the Trainer's ``strategy=``, ``accelerator=``, ``devices=`` and
``num_nodes=`` arguments into a :class:`Strategy`; it is the one string registry of the project.
"""

from __future__ import annotations

import _cadence_shadowing

_cadence_shadowing.check_packages()  # first: a user's trainer.py or strategies.py is named, not misread

import os
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from strategies.accelerators import (
    STRATEGY_DEVICE_TYPES, check_agrees, check_num_nodes, device_count, parse_accelerator, parse_devices,
)
from strategies.base import Strategy
from strategies.mps import MPS
from strategies.single import SingleDevice, auto_device

if TYPE_CHECKING:
    from strategies.ddp import DDP
    from strategies.fsdp import FSDP

__all__ = ["DDP", "DDPStrategy", "DeepSpeedStrategy", "FSDP", "FSDPStrategy", "MPS", "ModelParallelStrategy",
           "SingleDevice", "SingleDeviceStrategy", "Strategy", "resolve_strategy"]
#: Lightning's strategy classes (strategies/lightning_strategies.py, lightning_fsdp.py), loaded when first named.
LIGHTNING_NAMES = ("DDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "SingleDeviceStrategy")

STRATEGY_NAMES = ('"auto", "cpu", "cuda", "cuda:N", "mps", "ddp" (also "ddp_spawn", "ddp_fork"), "fsdp" '
                  'or a strategies.Strategy')
#: The names that choose DDP; "ddp_fork" and "ddp_notebook" start the workers with fork.
DDP_NAMES = ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
#: Lightning's names for DDP(find_unused_parameters=...); plain "ddp" leaves it to the DDP default.
FIND_UNUSED_NAMES = {"ddp_find_unused_parameters_true": True, "ddp_find_unused_parameters_false": False}


def __getattr__(name: str) -> Any:
    # DDP and FSDP pull in torch.distributed machinery; load them when first named, not at import.
    if name == "DDP":
        from strategies.ddp import DDP

        return DDP
    if name == "FSDP":
        from strategies.fsdp import FSDP

        return FSDP
    if name == "FSDPStrategy":
        from strategies.lightning_fsdp import FSDPStrategy

        return FSDPStrategy
    if name in LIGHTNING_NAMES:
        from strategies import lightning_strategies

        return getattr(lightning_strategies, name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")


def _single_device_count(devices: Any, strategy: str) -> None:
    if devices not in ("auto", 1, None) and not (isinstance(devices, list) and len(devices) == 1):
        raise MisconfigurationException(
            f'Trainer(strategy="{strategy}", devices={devices!r}) runs one process on one device. '
            'Use devices=1 (or "auto"), or strategy="ddp" to train on several devices.'
        )


def resolve_strategy(strategy: Any, devices: Any = "auto", accelerator: Any = "auto", num_nodes: int = 1) -> Strategy:
    """Turn ``Trainer(strategy=..., devices=..., accelerator=..., num_nodes=...)`` into a Strategy, or
    raise a ValueError that says what would work.

    ``accelerator`` picks the device type (``strategies/accelerators.py``) and must agree with a
    strategy that names one (``"cuda"``, ``SingleDevice("cpu")``, ``DDP(backend="nccl")``). A
    strategy object gets the settings it leaves open (``DDP(devices="auto")``) from the Trainer's.
    """
    accelerator = parse_accelerator(accelerator)
    devices = parse_devices(devices, accelerator)
    check_num_nodes(num_nodes)
    if isinstance(strategy, Strategy):
        strategy.configure_devices(accelerator, devices, num_nodes)
        return strategy
    if not isinstance(strategy, str):
        raise MisconfigurationException(
            f"Trainer(strategy={strategy!r}) is not a strategy. Use {STRATEGY_NAMES}."
        )
    name = strategy.strip().lower()
    if name in DDP_NAMES or name in FIND_UNUSED_NAMES or name == "fsdp":
        return _ddp(name, devices, accelerator, num_nodes)
    if name == "auto":
        from strategies.process_group import launched_by_torchrun

        # Under torchrun with several processes, "auto" joins the group, as "ddp" does.
        if (device_count(devices) or 1) > 1 or num_nodes > 1 or (launched_by_torchrun() and os.environ["WORLD_SIZE"] != "1"):
            return _ddp("ddp", devices, accelerator, num_nodes)
        if accelerator == "auto" and not isinstance(devices, list):
            chosen = SingleDevice(auto_device())
            chosen.detected = True
            return chosen
        name = "cuda" if accelerator == "auto" else accelerator  # "auto" with devices=[i]: GPU i
    if name == "cuda" and isinstance(devices, list):
        name = f"cuda:{devices[0]}"
    device_type = "cuda" if name.startswith("cuda:") else STRATEGY_DEVICE_TYPES.get(name)
    if device_type is None or (name.startswith("cuda:") and not name[5:].isdigit()):
        raise MisconfigurationException(f'Trainer(strategy="{strategy}") is not a strategy. Use {STRATEGY_NAMES}.')
    check_agrees(accelerator, f'"{strategy}"', device_type)
    _single_device_count(devices, strategy)
    if num_nodes > 1:
        raise MisconfigurationException(
            f'Trainer(strategy="{strategy}", num_nodes={num_nodes}) runs one process; training on '
            'several machines needs strategy="ddp" under torchrun.')
    return MPS() if name == "mps" else SingleDevice(name)


def _ddp(name: str, devices: Any, accelerator: str, num_nodes: int) -> Strategy:
    """DDP for the DDP names, FSDP for "fsdp" (it launches as DDP does), with the Trainer's devices."""
    if name == "fsdp":
        from strategies.fsdp import FSDP

        strategy = FSDP()
    else:
        from strategies.ddp import DDP

        strategy = DDP(start_method="fork" if name in ("ddp_fork", "ddp_notebook") else "spawn",
                       find_unused_parameters=FIND_UNUSED_NAMES.get(name))
    strategy.configure_devices(accelerator, devices, num_nodes)
    return strategy
