"""What DDP (and FSDP, which launches as DDP does) checks before it starts anything.

Its arguments and how they combine with the Trainer's, the GPUs they ask for, and the topology:
that they agree with what torchrun started, or that a spawned run stays on one machine. Each check
takes values, starts nothing and raises a ValueError that names the argument and says what would
work; ``DDP.configure_devices`` and ``DDP.validate`` call them, before launch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from callbacks.console import MisconfigurationException
from strategies.accelerators import check_agrees
from strategies.process_group import check_gpus, check_port_free, launched_by_torchrun, local_cuda_index, local_world_size

BACKENDS = ("nccl", "gloo", "mpi", "ucc")
START_METHODS = ("spawn", "forkserver", "fork")


def settle_trainer_devices(accelerator: str, devices: int | str | list[int], num_nodes: int, *, backend: str | None,
                           own_devices: int | str | list[int], own_num_nodes: int) -> tuple[str | None, Any, int]:
    """``(backend, devices, num_nodes)`` of a ``DDP(backend, own_devices, own_num_nodes)`` given to
    ``Trainer(accelerator, devices, num_nodes)``: the Trainer's ``accelerator`` picks the backend the
    DDP leaves open (cpu: gloo, gpu: nccl); its ``devices`` and ``num_nodes`` fill ``"auto"`` and 1.
    Contradictions are errors."""
    if accelerator == "mps":
        raise MisconfigurationException(
            'Trainer(accelerator="mps", strategy="ddp"): DDP does not run on Apple GPUs. Use '
            'accelerator="cpu" to run DDP on the CPU cores, or strategy="mps" for one process.')
    shown = f"DDP(backend={backend!r})" if backend is not None else '"ddp"'
    check_agrees(accelerator, shown, {"nccl": "cuda", "gloo": "cpu"}.get(backend or ""))
    if backend is None and accelerator != "auto":
        backend = "gloo" if accelerator == "cpu" else "nccl"
    if devices != "auto":
        if own_devices not in ("auto", devices):
            raise MisconfigurationException(
                f"Trainer(devices={devices!r}) and DDP(devices={own_devices!r}) disagree; set "
                "devices in one place.")
        own_devices = devices
    if num_nodes != 1:
        if own_num_nodes not in (1, num_nodes):
            raise MisconfigurationException(
                f"Trainer(num_nodes={num_nodes}) and DDP(num_nodes={own_num_nodes}) disagree; set "
                "num_nodes in one place.")
        own_num_nodes = num_nodes
    return backend, own_devices, own_num_nodes


def check_arguments(name: str, devices: int | str | list[int], num_nodes: int, start_method: str, backend: str) -> None:
    """``devices``, ``num_nodes``, ``start_method`` and the ``backend`` (resolved: never None) of ``name``."""
    if not dist.is_available():
        raise MisconfigurationException(
            "strategy=\"ddp\" needs torch.distributed, which this PyTorch build lacks. Use a single device.")
    if isinstance(devices, list):
        if backend != "nccl":
            raise MisconfigurationException(
                f"{name}(devices={devices}) lists GPU indices, but the backend is "
                f'"{backend}" (CPU processes). Pass a number of processes, e.g. devices={len(devices)}.')
    elif devices != "auto" and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise MisconfigurationException(
            f'{name}(devices={devices!r}): use an int >= 1 (processes on this machine) or "auto".')
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise MisconfigurationException(f"{name}(num_nodes={num_nodes!r}): use an int >= 1 (the number of machines).")
    if start_method not in START_METHODS:
        raise MisconfigurationException(f'{name}(start_method="{start_method}"): use one of {START_METHODS}.')
    if backend not in BACKENDS:
        raise MisconfigurationException(
            f'{name}(backend="{backend}") is not a torch.distributed backend; use "nccl" (GPUs) or "gloo" (CPU).')


def check_backend_available(name: str, backend: str) -> None:
    if not dist.is_backend_available(backend):
        raise MisconfigurationException(
            f'{name}(backend="{backend}") is not available in this PyTorch build (torch {torch.__version__}). '
            + ('Use backend="gloo".' if backend != "gloo" else "Install a PyTorch build with gloo.")
        )


def check_gpus_for(devices: int | str | list[int], num_processes: int, start_method: str) -> None:
    """The GPUs an NCCL run needs are there: ``devices`` (or ``num_processes``) of them when spawning,
    this process's own under torchrun; and workers that can use CUDA."""
    if not launched_by_torchrun():
        check_gpus(max(devices) + 1 if isinstance(devices, list) else num_processes)
        if start_method == "fork":
            # Asking whether CUDA is available (above) already initialized it in this process.
            raise MisconfigurationException(
                'DDP(start_method="fork") cannot train on GPUs: a process forked after CUDA was initialized '
                'cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess"). Use start_method="spawn" '
                '(the default) or "forkserver", or launch with torchrun.'
            )
        return
    # Launched by torchrun or a scheduler: this process needs one GPU; how many the machine
    # has and how many processes it runs are the launcher's business.
    check_gpus(1)
    local_cuda_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())  # raises if it has no GPU of its own


def check_topology(name: str, devices: int | str | list[int], num_nodes: int) -> None:
    """Under torchrun, ``devices`` and ``num_nodes`` match what it started; a spawned run is one
    machine, and a ``MASTER_PORT`` it was given is free."""
    if launched_by_torchrun():
        started = local_world_size()  # None when a scheduler does not say
        nodes = int(os.environ["WORLD_SIZE"]) // started if started else None
        if num_nodes != 1 and nodes is not None and num_nodes != nodes:
            raise MisconfigurationException(
                f"num_nodes={num_nodes}, but torchrun started {nodes} machine(s) (WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']}, {started} per machine). Match --nnodes, or leave num_nodes at 1."
            )
        asked = len(devices) if isinstance(devices, list) else devices
        if started is not None and asked not in ("auto", started):
            raise MisconfigurationException(
                f"{name}(devices={devices}) but torchrun started {started} processes on this machine "
                f'(--nproc-per-node). Use devices="auto" or devices={started}.'
            )
    elif num_nodes > 1:
        raise MisconfigurationException(
            f"num_nodes={num_nodes} trains on {num_nodes} machines, which a spawned run cannot reach: "
            f"start the script on each machine with torchrun --nnodes={num_nodes} "
            "--nproc-per-node=N --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT (see docs/distributed.md)."
        )
    elif "MASTER_PORT" in os.environ:
        check_port_free(os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ["MASTER_PORT"])
