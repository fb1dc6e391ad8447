"""Process-group plumbing for DDP: who launched this process, the group's store, and checks.

Kept apart from :mod:`strategies.ddp` so that the strategy reads as what the loop calls.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from callbacks.console import MisconfigurationException

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (or a scheduler exporting the same variables) started."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def connect_stores(host: str, port: int, world_size: int, hosts_here: bool,
                   timeout: datetime.timedelta) -> tuple[Any, Any]:
    """Two clients of the store at ``host:port`` (``hosts_here``: this process serves it)."""
    main = dist.TCPStore(host, port, world_size, hosts_here, timeout=timeout, wait_for_workers=False)
    return main, dist.TCPStore(host, port, None, False, timeout=timeout)


def check_gpus(wanted: int) -> None:
    """Raise a ValueError unless ``wanted`` CUDA devices are visible (NCCL trains on GPUs)."""
    if not torch.cuda.is_available():
        raise MisconfigurationException(
            f'DDP(backend="nccl") trains on CUDA GPUs, but PyTorch sees none (torch {torch.__version__}, '
            f"CUDA build: {torch.version.cuda or 'no'}). Use backend=\"gloo\" to train on the CPU, "
            "or run on a machine with NVIDIA GPUs."
        )
    count = torch.cuda.device_count()
    if wanted > count:
        visible = ", ".join(f"cuda:{index}" for index in range(count))
        raise MisconfigurationException(
            f"devices={wanted} asks for {wanted} CUDA devices; {count} is visible ({visible}). "
            f"Use devices={count} or check CUDA_VISIBLE_DEVICES."
        )


def check_port_free(host: str, port: str) -> None:
    """Raise a ValueError naming the fix when ``MASTER_PORT`` is taken on this machine."""
    try:
        number = int(port)
    except ValueError:
        raise MisconfigurationException(
            f"MASTER_PORT={port!r} is not a port number. Unset it to let Cadence pick a free port.") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, number))
        except OSError as error:
            raise MisconfigurationException(
                f"MASTER_PORT={number} is already in use on {host} ({error.strerror}), so the DDP processes "
                "cannot meet there. Unset MASTER_PORT to let Cadence pick a free port, or set it to a free one."
            ) from None


def is_communication_error(error: Exception) -> bool:
    """True for an error of the process group (a timeout, a peer gone), not of the user's code."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed", "Timed out", "timed out")
    )


def local_world_size() -> int | None:
    """Processes on this machine as the launcher says (``LOCAL_WORLD_SIZE``), or None when it does
    not say: some schedulers export only ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``, and
    ``WORLD_SIZE`` counts the processes of every machine."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def local_cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device of the process with ``local_rank`` on its machine, given that it sees
    ``visible`` devices.

    A process that sees its machine's GPUs (torchrun) takes ``cuda:LOCAL_RANK``; a process that
    sees exactly one takes ``cuda:0``: a scheduler that gives each process a GPU of its own sets
    ``CUDA_VISIBLE_DEVICES`` per process, while ``LOCAL_RANK`` still counts the processes.
    """
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    shown = ", ".join(f"cuda:{index}" for index in range(visible)) or "none"
    raise MisconfigurationException(
        f"This process has LOCAL_RANK={local_rank} but sees {visible} CUDA device(s) ({shown}), so it has no "
        "GPU of its own. Let each process see all of its machine's GPUs (it then uses cuda:LOCAL_RANK) or "
        "exactly one (CUDA_VISIBLE_DEVICES set per process); check CUDA_VISIBLE_DEVICES and LOCAL_RANK."
    )


def release_reducer(wrapped: Any | None) -> None:
    """Free a DistributedDataParallel wrapper's reducer (and the logger sharing it) while Python still holds
    the process group. Were the reducer's C++ reference the group's last, gloo's destructor would join its
    threads holding the GIL while one of them waits for the GIL to free the last collective's tensors: a
    deadlock at teardown. Torch releases the GIL only when the last reference is a Python one."""
    for name in ("logger", "reducer") if wrapped is not None else ():
        vars(wrapped).pop(name, None)


def end_process_group(abort: bool) -> None:
    """Leave the default process group; with ``abort`` (NCCL after a failure) without waiting for
    collectives that will never complete.

    ``_abort_process_group`` (private, torch >= 2.5) aborts every NCCL communicator at once. Torch
    2.4 lacks it; there ``destroy_process_group`` itself aborts the communicators (pytorch/pytorch#119250;
    torch 2.6 made it wait for pending work instead, pytorch/pytorch#141510), so it is the fallback.
    """
    abort_group = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort and abort_group is not None:
        abort_group()
    else:
        dist.destroy_process_group()
