"""Lightning's strategy classes under their own names and signatures.

``DDPStrategy(...)`` builds Cadence's :class:`strategies.DDP` from Lightning's arguments, so that
``Trainer(strategy=DDPStrategy(find_unused_parameters=True))`` runs with only the import changed:
``process_group_backend`` is DDP's ``backend``, the keyword arguments Lightning passes on to
``torch.nn.parallel.DistributedDataParallel`` (``broadcast_buffers``, ``bucket_cap_mb``, ...) are passed
on here too, and ``ddp_comm_hook`` (with its state and wrapper) is registered on the wrapped model.
Lightning's plugin objects (accelerator, cluster environment, checkpoint IO, precision plugin) have
Trainer arguments in Cadence; passing one is refused with the Trainer argument to use.
``SingleDeviceStrategy(device)`` is :class:`strategies.SingleDevice`; ``FSDPStrategy`` is in
``strategies/lightning_fsdp.py``. ``DeepSpeedStrategy`` and ``ModelParallelStrategy`` are refused when
built, naming the Cadence way.
"""

from __future__ import annotations

import datetime
import difflib
import inspect
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from callbacks.console import MisconfigurationException
from strategies.ddp import DDP, DEFAULT_TIMEOUT_S
from strategies.single import SingleDevice

#: Lightning's plugin arguments and what Cadence asks for instead.
PLUGINS = {
    "accelerator": 'Trainer(accelerator="cpu" | "gpu" | "cuda" | "mps")',
    "parallel_devices": "Trainer(devices=N or a list of GPU indices)",
    "cluster_environment": "torchrun (its environment variables are read), or Trainer(num_nodes=...)",
    "checkpoint_io": "ModelCheckpoint (atomic files, async_save=True for background writes)",
    "precision_plugin": 'Trainer(precision="bf16-mixed" | "16-mixed" | "32-true" | "64-true" | "bf16-true" | "16-true")',
}
#: DistributedDataParallel arguments the strategy sets itself.
DECIDED = {"module": "the Trainer wraps your module", "device_ids": "Trainer(devices=...)",
           "output_device": "Trainer(devices=...)", "process_group": "the strategy's own process group",
           "device_mesh": "the strategy's own process group", "dim": "the distributed sampler (batches split by samples)"}
#: Lightning's start methods: "popen" re-runs the script once per device; Cadence spawns instead.
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def refuse_plugins(owner: str, **given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            raise MisconfigurationException(
                f"{owner}({name}=...) is one of Lightning's plugin objects; Cadence has none. "
                f"Use {PLUGINS[name]}.")


class DDPStrategy(DDP):
    """Lightning's ``DDPStrategy``: its arguments, Cadence's DDP underneath.

    Differences, on purpose: ``start_method="popen"`` (Lightning's default: re-run the script once per
    device) spawns the workers as ``"spawn"`` does, so the model and data must be picklable (an error names
    what is not); ``gradient_as_bucket_view`` defaults to True (a copy of the gradients saved); the
    communication hook is registered on every device type (Lightning registers it on CUDA only).
    ``model_averaging_period`` (post-local SGD) is refused.
    """

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, ddp_comm_state: object | None = None,
                 ddp_comm_hook: Callable | None = None, ddp_comm_wrapper: Callable | None = None,
                 model_averaging_period: int | None = None, process_group_backend: str | None = None,
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S, start_method: str = "popen",
                 **kwargs: Any) -> None:
        refuse_plugins("DDPStrategy", accelerator=accelerator, parallel_devices=parallel_devices,
                       cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                       precision_plugin=precision_plugin)
        if model_averaging_period is not None:
            raise MisconfigurationException(
                "DDPStrategy(model_averaging_period=...) (post-local SGD) is not in Cadence. "
                "Leave it out: every step all-reduces the gradients.")
        if ddp_comm_hook is None and (ddp_comm_state is not None or ddp_comm_wrapper is not None):
            raise MisconfigurationException(
                "DDPStrategy(ddp_comm_state=/ddp_comm_wrapper=) act on a communication hook: "
                "pass ddp_comm_hook= too (e.g. torch.distributed.algorithms.ddp_comm_hooks."
                "default_hooks.fp16_compress_hook).")
        if ddp_comm_hook is not None and not callable(ddp_comm_hook):
            raise MisconfigurationException(
                f"DDPStrategy(ddp_comm_hook={ddp_comm_hook!r}) is not callable: pass a function "
                "hook(state, bucket) -> torch.futures.Future, as DistributedDataParallel."
                "register_comm_hook takes.")
        if start_method not in START_METHODS:
            raise MisconfigurationException(f"DDPStrategy(start_method={start_method!r}): use one of {START_METHODS}.")
        own = {name: kwargs.pop(name) for name in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")
               if name in kwargs}
        check_ddp_arguments(kwargs)
        super().__init__(backend=process_group_backend, start_method="spawn" if start_method == "popen" else start_method,
                         timeout=timeout, **own)
        self.ddp_arguments = kwargs
        self.comm_hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper) if ddp_comm_hook is not None else None


def check_ddp_arguments(arguments: dict[str, Any]) -> None:
    """Refuse keyword arguments ``DistributedDataParallel`` would not take, before any process starts."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
    for name in arguments:
        if name in DECIDED:
            raise MisconfigurationException(
                f"DDPStrategy({name}=...): {DECIDED[name]} decides it in Cadence; leave it out.")
        if name not in accepted:
            close = difflib.get_close_matches(name, sorted(accepted - set(DECIDED)), n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise MisconfigurationException(
                f"DDPStrategy({name}=...) is neither a DDPStrategy argument nor one of "
                f"torch.nn.parallel.DistributedDataParallel's, where Lightning passes the rest. {hint}"
                f"Those are: {', '.join(sorted(accepted - set(DECIDED)))}.")


class DeepSpeedStrategy:
    """Refused: DeepSpeed is not a dependency of Cadence."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "DeepSpeedStrategy is Lightning's; Cadence does not have it (DeepSpeed is not a dependency). "
            'Instead: Trainer(strategy="fsdp") shards parameters, gradients and optimizer states as ZeRO-3 does '
            '(FSDP(reshard_after_forward=False) for ZeRO-2), with precision="bf16-mixed" and FSDP(cpu_offload=True) '
            "for what DeepSpeed's offload does.")


class ModelParallelStrategy:
    """Refused: tensor parallelism is not in Cadence."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "ModelParallelStrategy is Lightning's; Cadence has no tensor-parallel strategy. Instead: "
            'Trainer(strategy="fsdp") shards the model over the processes (FSDP(device_mesh=...) for a 2-D mesh '
            "of replicas and shards).")


class SingleDeviceStrategy(SingleDevice):
    """Lightning's ``SingleDeviceStrategy(device)``: one process on one device (``"cpu"``, ``"cuda:1"``,
    ``torch.device("mps")``, a GPU index), Cadence's :class:`strategies.SingleDevice`. Lightning's plugin
    objects are refused with the Trainer argument to use."""

    def __init__(self, device: str | int | torch.device = "cpu", accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None) -> None:
        refuse_plugins("SingleDeviceStrategy", accelerator=accelerator, checkpoint_io=checkpoint_io,
                       precision_plugin=precision_plugin)
        super().__init__(torch.device("cuda", device) if isinstance(device, int) else device)
