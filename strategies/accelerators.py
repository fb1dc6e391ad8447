"""Lightning's ``accelerator``, ``devices`` and ``num_nodes`` arguments, read into what a strategy needs.

``accelerator`` is the device type (``"auto" | "cpu" | "gpu" | "cuda" | "mps"``); ``devices`` how
many of them, or which (an int, ``-1`` for all, ``"auto"``, a list of indices, or Lightning's
strings ``"2"`` and ``"0,1"``); ``num_nodes`` how many machines. :func:`resolve_strategy` in
``strategies/__init__.py`` combines them with ``strategy=``; a contradiction between them is an
error naming both.
"""

from __future__ import annotations

from typing import Any

import torch

from callbacks.console import MisconfigurationException

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")

#: The device type each strategy name implies (None: any).
STRATEGY_DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "mps": "mps"}


def parse_accelerator(accelerator: Any) -> str:
    """``"auto"``, ``"cpu"``, ``"cuda"`` (also for Lightning's ``"gpu"``) or ``"mps"``."""
    name = accelerator.strip().lower() if isinstance(accelerator, str) else accelerator
    if name not in ACCELERATORS:
        hint = ' Cadence runs on CPUs, CUDA GPUs and Apple GPUs; TPUs and HPUs are not supported.' \
            if name in ("tpu", "hpu", "xla", "ipu") else ""
        raise MisconfigurationException(
            f'Trainer(accelerator={accelerator!r}) is not a device type. Use "auto", "cpu", "gpu" '
            f'(or "cuda") or "mps".{hint}')
    if name in ("gpu", "cuda") and not torch.cuda.is_available():  # in the user's words, before any strategy
        raise MisconfigurationException(
            f"Trainer(accelerator={accelerator!r}) asks for a CUDA GPU, but PyTorch sees none (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Use accelerator=\"cpu\" "
            "or \"auto\", or install a CUDA build of PyTorch.")
    return "cuda" if name == "gpu" else name


def parse_devices(devices: Any, accelerator: str) -> int | str | list[int]:
    """``devices`` as ``"auto"``, a count, or a list of device indices (GPUs only).

    Lightning's spellings are read too: ``-1`` (every GPU), ``"2"`` (a count), ``"0,1"`` (indices).
    """
    given = devices
    if devices is None:  # Cadence took it for "auto" before Lightning's names came; Lightning's tutorials pass it
        return "auto"
    if isinstance(devices, str) and devices.strip() != "auto":
        text = devices.strip()
        try:
            devices = [int(part) for part in text.split(",") if part.strip()] if "," in text else int(text)
        except ValueError:
            raise MisconfigurationException(
                f"Trainer(devices={given!r}): use an int, -1 (every GPU), \"auto\" or a list of "
                "device indices such as [0, 1].") from None
    elif isinstance(devices, str):
        return "auto"
    if isinstance(devices, tuple):
        devices = list(devices)
    if isinstance(devices, list):
        if not devices or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices) \
                or len(set(devices)) != len(devices):
            raise MisconfigurationException(
                f"Trainer(devices={given!r}): a list of devices holds distinct indices >= 0, e.g. [0, 1].")
        if accelerator == "cpu":
            raise MisconfigurationException(
                f'Trainer(accelerator="cpu", devices={given!r}): CPU processes have no device indices; '
                "pass how many processes, e.g. devices=2.")
        if accelerator == "mps":
            if devices != [0]:
                raise MisconfigurationException(
                    f'Trainer(accelerator="mps", devices={given!r}): a Mac has one Apple GPU, [0].')
            return 1
        return devices
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < -1 or devices == 0:
        raise MisconfigurationException(
            f"Trainer(devices={given!r}): use an int >= 1, -1 (every GPU), \"auto\" or a list of "
            "device indices such as [0, 1].")
    if devices == -1:
        if accelerator in ("cpu", "mps"):
            raise MisconfigurationException(
                f'Trainer(accelerator="{accelerator}", devices=-1): -1 means every GPU; pass how many '
                "processes, e.g. devices=2.")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise MisconfigurationException(
                "Trainer(devices=-1) asks for every GPU, and PyTorch sees none. Use devices=1 (or an int "
                'with accelerator="cpu") to train on the CPU.')
        return count
    return devices


def device_count(devices: int | str | list[int]) -> int | None:
    """How many devices ``devices`` asks for; None for ``"auto"``."""
    if devices == "auto":
        return None
    return len(devices) if isinstance(devices, list) else devices


def check_num_nodes(num_nodes: Any) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise MisconfigurationException(f"Trainer(num_nodes={num_nodes!r}): use an int >= 1 (the number of machines).")


def check_agrees(accelerator: str, strategy_name: str, device_type: str | None) -> None:
    """Raise when ``accelerator`` and a strategy that implies ``device_type`` contradict each other."""
    if accelerator == "auto" or device_type is None or device_type == accelerator:
        return
    shown = {"cuda": '"gpu" (or "cuda")'}.get(device_type, f'"{device_type}"')
    raise MisconfigurationException(
        f'Trainer(accelerator="{accelerator}", strategy={strategy_name}) contradict each other: the '
        f'strategy runs on {device_type}. Drop one of them, or use accelerator={shown}.')
