"""Lightning's ``FSDPStrategy`` under its own name and signature, Cadence's FSDP2 underneath.

Lightning's ``FSDPStrategy`` drives FSDP1 (``FullyShardedDataParallel``); Cadence shards with FSDP2
(``fully_shard`` on a ``DeviceMesh``, :class:`strategies.FSDP`). Each of Lightning's arguments is
translated to FSDP2's equivalent where one exists, or refused with the Cadence way:

- ``auto_wrap_policy``: a set (or list) of block classes, a ``ModuleWrapPolicy`` or a
  ``partial(transformer_auto_wrap_policy, transformer_layer_cls=...)`` becomes ``auto_wrap``; a policy
  function deciding by size is refused (FSDP1 applies it bottom-up, by unwrapped parameter count);
- ``sharding_strategy``: ``"FULL_SHARD"`` reshards after forward, ``"SHARD_GRAD_OP"`` keeps the gathered
  parameters for the backward, ``"HYBRID_SHARD"`` (``"_HYBRID_SHARD_ZERO2"``) shards within groups
  given by ``device_mesh=(replicas, shard_size)``; ``"NO_SHARD"`` is refused (that is DDPStrategy);
- ``mixed_precision``: FSDP1's ``MixedPrecision`` becomes a ``MixedPrecisionPolicy`` (FSDP2 does not cast
  buffers: a ``buffer_dtype`` is not applied, and a warning says so);
- ``cpu_offload``: True or ``CPUOffload(offload_params=True)``;
- ``activation_checkpointing(_policy)``: refused, naming ``callbacks.GradientCheckpointing``;
- ``state_dict_type``: ``"full"`` (Lightning's default) and ``"sharded"`` both write Cadence's sharded
  checkpoint directory (every rank writes its shards; ``strategies.checkpoint.convert_checkpoint`` makes
  one file of it), a difference listed in docs/lightning.md;
- the keyword arguments Lightning passes on to FSDP1 are refused (``use_orig_params=True`` is accepted:
  FSDP2 always trains the original parameters).
"""

from __future__ import annotations

import datetime
import functools
import warnings
from typing import Any

from callbacks.console import MisconfigurationException
from strategies.ddp import DEFAULT_TIMEOUT_S
from strategies.fsdp import FSDP
from strategies.lightning_strategies import refuse_plugins

#: Lightning's sharding strategies and FSDP2's reshard_after_forward; the hybrid ones need a 2-D mesh.
SHARDING = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "_HYBRID_SHARD_ZERO2": False}


class FSDPStrategy(FSDP):
    """Lightning's ``FSDPStrategy``: its arguments and defaults, Cadence's :class:`strategies.FSDP` (FSDP2)
    underneath. ``Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}), devices=4)`` runs with only
    the import changed; see the module docstring for how each argument is read."""

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: float | datetime.timedelta | None = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
                 cpu_offload: Any = None, mixed_precision: Any = None, auto_wrap_policy: Any = None,
                 activation_checkpointing: Any = None, activation_checkpointing_policy: Any = None,
                 sharding_strategy: Any = "FULL_SHARD", state_dict_type: str = "full", device_mesh: Any = None,
                 **kwargs: Any) -> None:
        refuse_plugins("FSDPStrategy", accelerator=accelerator, parallel_devices=parallel_devices,
                       cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                       precision_plugin=precision_plugin)
        for name, value in (("activation_checkpointing", activation_checkpointing),
                            ("activation_checkpointing_policy", activation_checkpointing_policy)):
            if value is not None:
                raise MisconfigurationException(
                    f"FSDPStrategy({name}=...): in Cadence activation checkpointing is a callback, "
                    "composed with any strategy: Trainer(callbacks=[callbacks.GradientCheckpointing("
                    "modules=Block)]) with your block class (or classes, or submodule names).")
        if state_dict_type not in ("full", "sharded"):
            raise MisconfigurationException(
                f"FSDPStrategy(state_dict_type={state_dict_type!r}): use 'full' or 'sharded' (Cadence "
                "writes a sharded checkpoint directory either way).")
        if kwargs.pop("use_orig_params", True) is not True:
            _refuse_kwarg("use_orig_params", False)
        for name, value in kwargs.items():
            _refuse_kwarg(name, value)
        reshard, mesh = _sharding(sharding_strategy, device_mesh)
        super().__init__(auto_wrap=_auto_wrap(auto_wrap_policy), reshard_after_forward=reshard,
                         mixed_precision=_mixed_precision(mixed_precision), cpu_offload=_cpu_offload(cpu_offload),
                         device_mesh=mesh, backend=process_group_backend,
                         timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout)
        self.sharding_strategy, self.state_dict_type = sharding_strategy, state_dict_type


def _refuse_kwarg(name: str, value: Any) -> None:
    raise MisconfigurationException(
        f"FSDPStrategy({name}={value!r}) is passed on to FSDP1's FullyShardedDataParallel in Lightning; "
        "Cadence shards with FSDP2 (torch.distributed.fsdp.fully_shard), which does not take it. Leave it "
        "out; FSDPStrategy's own arguments (auto_wrap_policy, sharding_strategy, mixed_precision, "
        "cpu_offload, device_mesh) carry over.")


def _sharding(strategy: Any, device_mesh: Any) -> tuple[bool, Any]:
    """(reshard_after_forward, device_mesh) for Lightning's ``sharding_strategy`` (a name or the enum)."""
    name = strategy.upper() if isinstance(strategy, str) else getattr(strategy, "name", strategy)  # or the enum
    if name == "NO_SHARD":
        raise MisconfigurationException(
            "FSDPStrategy(sharding_strategy='NO_SHARD') keeps a whole copy on every process: that is "
            "data parallel training. Use strategies.DDPStrategy() (or strategy=\"ddp\").")
    if name not in SHARDING:
        raise MisconfigurationException(
            f"FSDPStrategy(sharding_strategy={strategy!r}): use one of {sorted(SHARDING)} or 'NO_SHARD' "
            "(or torch.distributed.fsdp.ShardingStrategy's members).")
    if "HYBRID" in name and device_mesh is None:
        raise MisconfigurationException(
            f"FSDPStrategy(sharding_strategy={name!r}) shards within groups of processes and replicates "
            "across them: pass the groups, device_mesh=(replicas, shard_size), e.g. (num_nodes, "
            "devices per node).")
    return SHARDING[name], device_mesh


def _auto_wrap(policy: Any) -> Any:
    """Cadence's ``auto_wrap`` (block classes) for Lightning's ``auto_wrap_policy``."""
    if policy is None or isinstance(policy, type):
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(item, type) for item in policy):
        return tuple(policy)
    classes = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if classes is None and isinstance(policy, functools.partial):  # partial(transformer_auto_wrap_policy, ...)
        classes = policy.keywords.get("transformer_layer_cls")
    if classes is not None:
        return tuple(classes)
    raise MisconfigurationException(
        f"FSDPStrategy(auto_wrap_policy={policy!r}): Cadence wraps blocks by class, not by an FSDP1 "
        "policy function (those decide bottom-up by parameter count). Pass the block classes, "
        "auto_wrap_policy={Block}, or use strategies.FSDP(auto_wrap=...) with submodule names or a "
        "predicate (name, module) -> bool.")


def _mixed_precision(policy: Any) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for FSDP1's ``MixedPrecision`` (one given already passes)."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if not isinstance(policy, MixedPrecision):
        raise MisconfigurationException(
            f"FSDPStrategy(mixed_precision={policy!r}): use torch.distributed.fsdp.MixedPrecision (as in "
            'Lightning) or MixedPrecisionPolicy, or leave it out and pass Trainer(precision="bf16-mixed").')
    if policy.keep_low_precision_grads:
        raise MisconfigurationException(
            "FSDPStrategy(mixed_precision=MixedPrecision(keep_low_precision_grads=True)): FSDP2 keeps "
            "gradients in reduce_dtype; set reduce_dtype=param_dtype for low-precision gradients instead.")
    if policy.buffer_dtype is not None:
        warnings.warn(f"FSDPStrategy(mixed_precision=MixedPrecision(buffer_dtype={policy.buffer_dtype})): FSDP2 does "
                      "not cast buffers, so they stay in their own dtype (as a BatchNorm's statistics usually "
                      "should); cast them in configure_model if you need to.", stacklevel=3)
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                cast_forward_inputs=policy.cast_forward_inputs or policy.cast_root_forward_inputs)


def _cpu_offload(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    offload = getattr(value, "offload_params", None)  # FSDP1's CPUOffload
    if isinstance(offload, bool):
        return offload
    raise MisconfigurationException(
        f"FSDPStrategy(cpu_offload={value!r}): use True, False or "
        "torch.distributed.fsdp.CPUOffload(offload_params=...).")
