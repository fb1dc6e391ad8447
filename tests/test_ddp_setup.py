"""DDP before any process starts: choosing it, refusing what cannot work, and sharding loaders.

Nothing here spawns a process. Where a check needs GPUs this machine lacks, the test mocks the
``torch.cuda`` queries, never Cadence's own code.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import signal
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from strategies import (
    DDP, DDPStrategy, DeepSpeedStrategy, FSDP, FSDPStrategy, ModelParallelStrategy, SingleDevice, SingleDeviceStrategy,
    resolve_strategy,
)
from strategies.loaders import shard_dataloader
from strategies.spawn import failure_message, host_store
from trainer.host_copy import check_same_sync_keys
from trainer.stage_metrics import MetricSpec
from trainer import Trainer

TORCHRUN_ENVIRONMENT = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.fixture
def plain_process(monkeypatch):
    """A process that torchrun did not start (the test runner may itself run under one)."""
    for name in TORCHRUN_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def test_ddp_and_several_devices_choose_the_ddp_strategy(plain_process):
    assert isinstance(resolve_strategy("ddp", devices=2), DDP)
    assert isinstance(resolve_strategy("auto", devices=2), DDP)
    trainer = Trainer(strategy="ddp", devices=2, logger=False)
    assert trainer.world_size == 2 and trainer.global_rank == 0 and trainer.is_global_zero
    assert trainer.strategy.launches_subprocesses


@pytest.mark.parametrize("name, find_unused", [("ddp_find_unused_parameters_true", True),
                                               ("ddp_find_unused_parameters_false", False), ("ddp", None)])
def test_lightnings_find_unused_parameters_strategy_names_set_ddps_option(plain_process, name, find_unused):
    strategy = Trainer(strategy=name, devices=2, logger=False).strategy
    assert isinstance(strategy, DDP) and strategy.find_unused_parameters is find_unused


def test_lightnings_ddp_strategy_takes_its_arguments_and_the_trainers_devices(plain_process):
    strategy = DDPStrategy(find_unused_parameters=True, static_graph=False, process_group_backend="gloo",
                           bucket_cap_mb=5, broadcast_buffers=False, timeout=datetime.timedelta(minutes=3))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy is strategy and trainer.world_size == 2 and strategy.launches_subprocesses
    assert strategy.find_unused_parameters is True and strategy.backend == "gloo"
    assert strategy.timeout == datetime.timedelta(minutes=3)
    assert strategy.ddp_arguments == {"bucket_cap_mb": 5, "broadcast_buffers": False}  # for DistributedDataParallel
    assert strategy.start_method == "spawn"  # Lightning's "popen" re-runs the script; Cadence spawns


@pytest.mark.parametrize("arguments, message", [
    ({"accelerator": "gpu"}, r"DDPStrategy\(accelerator=...\) is one of Lightning's plugin objects.*Trainer\(accelerator="),
    ({"precision_plugin": object()}, r"Use Trainer\(precision="),
    ({"bukcet_cap_mb": 5}, r"DDPStrategy\(bukcet_cap_mb=...\) is neither.*Did you mean 'bucket_cap_mb'\?"),
    ({"device_ids": [0]}, r"DDPStrategy\(device_ids=...\): Trainer\(devices=...\) decides it"),
    ({"ddp_comm_state": object()}, r"pass ddp_comm_hook= too"),
    ({"ddp_comm_hook": "fp16"}, r"DDPStrategy\(ddp_comm_hook='fp16'\) is not callable"),
    ({"model_averaging_period": 4}, r"post-local SGD\) is not in Cadence"),
    ({"start_method": "thread"}, r"start_method='thread'\): use one of"),
])
def test_lightnings_ddp_strategy_refuses_what_cadence_cannot_honour_with_the_cadence_way(arguments, message):
    with pytest.raises(ValueError, match=message):
        DDPStrategy(**arguments)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)


def test_lightnings_fsdp_strategy_reads_its_fsdp1_arguments_as_fsdp2_settings(plain_process):
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

    strategy = FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP", process_group_backend="gloo",
                            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                            timeout=datetime.timedelta(minutes=3), use_orig_params=True)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP) and trainer.world_size == 2 and strategy.backend == "gloo"
    assert strategy.auto_wrap == (Block,) and strategy.reshard_after_forward is False  # ZeRO-2: kept for backward
    assert isinstance(strategy.mp_policy, MixedPrecisionPolicy) and strategy.mp_policy.param_dtype == torch.bfloat16
    assert trainer.precision == "bf16-mixed" and strategy.timeout == datetime.timedelta(minutes=3)
    default = FSDPStrategy()  # Lightning's defaults: FULL_SHARD, every child wrapped, no offload
    assert default.reshard_after_forward is True and default.auto_wrap is None and default.cpu_offload is False
    assert FSDPStrategy(sharding_strategy=ShardingStrategy.FULL_SHARD).reshard_after_forward is True
    hybrid = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4))
    assert hybrid.device_mesh == (2, 4) and hybrid.reshard_after_forward is True


def test_lightnings_fsdp_wrap_policies_become_block_classes():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    assert FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({Block})).auto_wrap == (Block,)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert FSDPStrategy(auto_wrap_policy=policy).auto_wrap == (Block,)


@pytest.mark.parametrize("arguments, message", [
    ({"cluster_environment": object()}, r"FSDPStrategy\(cluster_environment=...\) is one of Lightning's plugin.*torchrun"),
    ({"activation_checkpointing_policy": {Block}}, r"callbacks.GradientCheckpointing\(modules=Block\)"),
    ({"sharding_strategy": "NO_SHARD"}, r"that is data parallel training. Use strategies.DDPStrategy"),
    ({"sharding_strategy": "HYBRID_SHARD"}, r"pass the groups, device_mesh=\(replicas, shard_size\)"),
    ({"auto_wrap_policy": lambda module, recurse, nonwrapped_numel: True}, r"Pass the block classes"),
    ({"limit_all_gathers": True}, r"limit_all_gathers=True\) is passed on to FSDP1's FullyShardedDataParallel"),
    ({"use_orig_params": False}, r"use_orig_params=False\)"),
    ({"state_dict_type": "local"}, r"use 'full' or 'sharded'"),
])
def test_lightnings_fsdp_strategy_refuses_what_fsdp2_does_not_do_with_the_cadence_way(arguments, message):
    with pytest.raises(ValueError, match=message):
        FSDPStrategy(**arguments)


def test_lightnings_single_device_strategy_runs_on_its_device():
    strategy = SingleDeviceStrategy("cpu")
    trainer = Trainer(strategy=strategy, logger=False)
    assert trainer.strategy is strategy and isinstance(strategy, SingleDevice) and strategy.device == torch.device("cpu")
    assert SingleDeviceStrategy().device == torch.device("cpu")  # Lightning's default device
    assert SingleDeviceStrategy(1).device == torch.device("cuda", 1)  # an index is a GPU, as torch.device(1)
    with pytest.raises(ValueError, match=r"SingleDeviceStrategy\(precision_plugin=...\).*Trainer\(precision="):
        SingleDeviceStrategy("cpu", precision_plugin=object())


def test_deepspeed_and_model_parallel_strategies_are_refused_naming_fsdp():
    with pytest.raises(NotImplementedError, match=r"DeepSpeed is not a dependency.*strategy=\"fsdp\""):
        DeepSpeedStrategy(stage=3)
    with pytest.raises(NotImplementedError, match=r"no tensor-parallel strategy.*strategy=\"fsdp\""):
        ModelParallelStrategy()


def test_under_torchrun_ddp_joins_instead_of_spawning(monkeypatch):
    for name, value in TORCHRUN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    strategy = DDP()
    strategy.validate()
    assert not strategy.launches_subprocesses
    assert strategy.world_size == 2 and strategy.num_processes == 2


def test_auto_under_torchrun_joins_the_group(monkeypatch):
    for name, value in TORCHRUN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    assert isinstance(Trainer(logger=False).strategy, DDP)


def test_torchrun_and_devices_that_disagree_is_an_error(monkeypatch):
    for name, value in TORCHRUN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"DDP\(devices=4\) but torchrun started 2 processes on this machine"):
        Trainer(strategy=DDP(devices=4))


def test_nccl_without_gpus_is_an_error_before_anything_starts(plain_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r'backend="nccl"\) trains on CUDA GPUs, but PyTorch sees none.*backend="gloo"'):
        Trainer(strategy=DDP(devices=2, backend="nccl"))


def test_more_gpus_than_the_machine_has_is_an_error_naming_the_visible_ones(plain_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"devices=4 asks for 4 CUDA devices; 1 is visible \(cuda:0\)"):
        Trainer(strategy=DDP(devices=4))


def test_a_master_port_in_use_is_an_error_before_any_worker_starts(plain_process, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(ValueError, match=rf"MASTER_PORT={port} is already in use on 127.0.0.1.*Unset MASTER_PORT"):
            Trainer(strategy=DDP(devices=2))


def test_a_master_port_that_is_not_a_number_is_an_error(plain_process, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "twenty")
    with pytest.raises(ValueError, match=r"MASTER_PORT='twenty' is not a port number"):
        Trainer(strategy=DDP(devices=2))


@pytest.mark.parametrize(("options", "message"), [
    ({"devices": 0}, r"DDP\(devices=0\): use an int >= 1"),
    ({"devices": "all"}, r"DDP\(devices='all'\): use an int >= 1"),
    ({"backend": "tcp"}, r'DDP\(backend="tcp"\) is not a torch.distributed backend'),
    ({"start_method": "thread"}, r'DDP\(start_method="thread"\): use one of'),
])
def test_bad_ddp_arguments_are_named_with_what_would_work(plain_process, options, message):
    with pytest.raises(ValueError, match=message):
        Trainer(strategy=DDP(**options))


def test_a_timeout_that_is_not_positive_is_an_error():
    with pytest.raises(ValueError, match=r"DDP\(timeout=0\): use a number of seconds > 0"):
        DDP(timeout=0)


def test_a_script_that_trains_at_import_time_is_told_to_guard_it(plain_process, monkeypatch):
    # What a spawned worker sees while it imports a script without `if __name__ == "__main__":`.
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r'importing your script called fit again.*if __name__ == "__main__":'):
        DDP(devices=2).launch(print)


def test_a_worker_killed_without_a_python_error_is_reported_with_a_likely_cause():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    killed = mp.ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=4321,
                                       exit_code=-signal.SIGKILL, signal_name="SIGKILL")
    message = failure_message(store, 2, killed)
    assert message.startswith("DDP rank 1 of 2 (pid 4321) ended without reporting an error")
    assert "out-of-memory killer" in message


def test_a_port_taken_between_the_check_and_the_launch_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"could not open its meeting point on 127.0.0.1:{port}.*Unset MASTER_PORT"):
            host_store("127.0.0.1", port, datetime.timedelta(seconds=5))


def test_collectives_outside_a_running_stage_say_so():
    with pytest.raises(RuntimeError, match=r"DDP.barrier was called outside a running stage"):
        DDP().barrier()
    with pytest.raises(ValueError, match=r'all_reduce\(op="avg"\): use "mean", "sum", "max" or "min"'):
        DDP().all_reduce(torch.ones(1), op="avg")


def test_a_sync_dist_key_logged_as_a_tensor_on_one_rank_and_a_number_on_another_is_an_error():
    spec = MetricSpec(prog_bar=False, on_step=True, on_epoch=False, sync_dist=True, reduce_fx="mean")
    on_rank_1 = (("val/acc", False),)  # rank 1 logged a Python float
    with pytest.raises(RuntimeError, match=r'"val/acc", ..., sync_dist=True\) got a tensor on rank\(s\) \[0\] and a Python number'):
        check_same_sync_keys({"val/acc": (torch.tensor(0.5), spec)}, lambda mine: [mine, on_rank_1])


# --- sharding loaders ------------------------------------------------------------------------------
def _collate(items):
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _seed_worker(worker_id):
    pass


def test_sharding_keeps_the_loaders_settings_and_gives_ranks_disjoint_samples():
    data = TensorDataset(torch.arange(20.0).unsqueeze(1), torch.zeros(20, 1))
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(data, batch_size=3, shuffle=True, drop_last=True, num_workers=1, collate_fn=_collate,
                        pin_memory=False, worker_init_fn=_seed_worker, generator=generator, persistent_workers=True)
    shards = [shard_dataloader(loader, rank=rank, world_size=2, shuffle=True, seed=5) for rank in range(2)]
    for shard in shards:
        assert isinstance(shard.sampler, DistributedSampler) and shard.sampler.shuffle
        assert (shard.batch_size, shard.drop_last, shard.num_workers) == (3, True, 1)
        assert shard.collate_fn is _collate and shard.worker_init_fn is _seed_worker
        assert shard.generator is generator and shard.persistent_workers
        assert len(shard) == 3  # 10 samples each, in whole batches of 3
    indices = [list(shard.sampler) for shard in shards]
    assert set(indices[0]).isdisjoint(indices[1]) and len(indices[0]) == len(indices[1]) == 10


def test_sharding_an_evaluation_loader_keeps_its_order():
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    shard = shard_dataloader(loader, rank=1, world_size=2, shuffle=False)
    assert list(shard.sampler) == [1, 3, 5, 7]


def test_sharding_a_loader_built_from_a_batch_sampler_keeps_its_batch_size():
    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=2, drop_last=False))
    shard = shard_dataloader(loader, rank=0, world_size=2, shuffle=True)
    assert isinstance(shard.batch_sampler.sampler, DistributedSampler)
    assert shard.batch_sampler.batch_size == 2 and len(shard) == 2


def test_a_loader_with_its_own_distributed_sampler_is_kept():
    data = TensorDataset(torch.arange(8.0))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1), batch_size=2)
    assert shard_dataloader(loader, rank=1, world_size=2, shuffle=True) is loader


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_a_loader_that_cannot_be_sharded_warns_that_every_rank_sees_all_of_it():
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match="DDP cannot give each rank its own share of this loader: its dataset is an IterableDataset"):
        assert shard_dataloader(loader, rank=0, world_size=2, shuffle=True) is loader
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # other ranks stay quiet
        shard_dataloader(loader, rank=1, world_size=2, shuffle=True, warn=False)
