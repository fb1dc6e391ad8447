"""FSDP on the CPU: two gloo processes, each holding half of every parameter.

Starting processes costs seconds, so one launch of ``tests/run_fsdp.py`` (two processes started
as torchrun starts them) runs several fits whose results many tests share: weights against
single-process training, the bytes each rank holds, evaluation on the sharded model, sharded
checkpoints and an exact resume, meta-device initialization, mixed precision, and a run killed
with SIGKILL. One spawned ``fit`` resumes that killed run. Everything else (one-process resume
from two ranks' shards, conversion to one file, damaged checkpoints, bad options) runs in this
process.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from callbacks import AMP, ModelCheckpoint
from strategies import DDP, FSDP
from strategies.checkpoint.sharded import check_complete
from trainer import Trainer
from trainer.cli import main as cadence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_regression import IndexedRegression  # noqa: E402
from run_fsdp import BATCH_SIZE, CLIP, Blocks, make_optimizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("plain", "accumulate_clip", "resume", "resume_file", "hsdp", "meta", "bf16")
SHARD_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two processes of tests/run_fsdp.py with torchrun's variables, and what rank zero recorded."""
    out = tmp_path_factory.mktemp("fsdp")
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    environment.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "run_fsdp.py"), str(out)],
                              env=dict(environment, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        output = "".join(rank.communicate(timeout=300)[0] for rank in ranks)
    finally:
        for rank in ranks:
            rank.kill()
    records = {name: torch.load(out / f"{name}.pt", weights_only=True) for name in RUNS if (out / f"{name}.pt").exists()}
    evaluated = torch.load(out / "evaluated.pt", weights_only=True) if (out / "evaluated.pt").exists() else None
    return SimpleNamespace(out=out, codes=[rank.returncode for rank in ranks], output=output, records=records,
                           evaluated=evaluated)


@pytest.fixture(scope="module")
def records(launched):
    assert set(launched.records) == set(RUNS), launched.output
    return launched.records


def replay(record: dict, accumulate: int = 1, clip: float | None = None) -> tuple[Blocks, list[float]]:
    """Train in one process on the global batches the two ranks saw (both ranks' samples of each
    micro-batch together) from the run's starting weights; return the model and the gradient norms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on a busy machine two threads spin-wait for each other (10 s vs 0.1 s)
    try:
        return _replay(record, accumulate, clip)
    finally:
        torch.set_num_threads(threads)


def _replay(record: dict, accumulate: int, clip: float | None) -> tuple[Blocks, list[float]]:
    data = IndexedRegression()
    model = Blocks()
    model.load_state_dict(record["initial"])
    configured = make_optimizer(model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    seen, norms = record["seen"], []
    for first in range(0, len(seen[0]), accumulate):
        for micro in range(first, first + accumulate):
            indices = [index for rank in seen for index in rank[micro][1]]
            (F.mse_loss(model(data.x[indices]), data.y[indices]) / accumulate).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, norms


def assert_weights_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


# --- training ----------------------------------------------------------------------------------
def test_both_ranks_ran_every_fit_and_died_of_sigkill_in_the_last(launched, records):
    assert launched.codes == [-9, -9], launched.output
    assert "FSDP: 2 processes on 1 machine(s), joined from torchrun" in launched.output


def test_fsdp_weights_equal_single_process_training_on_the_same_global_batches(records):
    plain = records["plain"]
    assert [len(rank) for rank in plain["seen"]] == [16, 16]  # 2 epochs of 32 samples a rank, in batches of 4
    reference, _ = replay(plain)
    assert_weights_close(plain["final"], reference.state_dict())
    assert plain["global_step"] == 16 and plain["lr"] == pytest.approx(0.1 * 0.5 ** 5)


def test_accumulation_and_clipping_by_the_norm_over_all_shards_equal_single_process_training(records):
    run = records["accumulate_clip"]
    reference, norms = replay(run, accumulate=2, clip=CLIP)
    assert min(norms) > CLIP  # clipping acted at every step: a norm of one rank's shard would clip differently
    assert_weights_close(run["final"], reference.state_dict())
    assert run["global_step"] == 8


def test_hybrid_sharding_replicating_across_the_mesh_equals_single_process_training(records):
    reference, _ = replay(records["hsdp"])
    assert_weights_close(records["hsdp"]["final"], reference.state_dict())


def test_each_rank_holds_half_the_parameter_gradient_and_optimizer_bytes_of_ddp(records):
    # What DDP keeps on every rank: the whole model, its gradients and the momentum buffers.
    whole = sum(p.numel() * p.element_size() for p in Blocks().parameters())
    for rank_bytes in records["accumulate_clip"]["bytes"]:
        assert rank_bytes == {"parameters": whole // 2, "gradients": whole // 2, "optimizer": whole // 2}


def test_the_sharded_model_validates_and_tests_after_fit_with_sync_dist_metrics(launched, records):
    model = Blocks()
    model.load_state_dict(records["plain"]["final"])
    data = IndexedRegression()
    with torch.no_grad():
        expected = F.mse_loss(model(data.x), data.y).item()  # equal batches: the mean of batch means
    for stage, metric in (("validate", "val"), ("test", "test")):
        values = launched.evaluated[stage][0]
        assert values[f"{metric}/rank"] == 0.5  # the mean of ranks 0 and 1
        assert values[f"{metric}/loss"] == pytest.approx(expected, abs=1e-6)


def test_a_model_built_on_the_meta_device_starts_as_one_process_would_build_it(records):
    torch.manual_seed(7)  # Trainer(seed=7) seeds before configure_model builds the blocks
    assert_weights_close(records["meta"]["initial"], Blocks().state_dict(), atol=0)
    assert not torch.equal(records["meta"]["final"]["head.weight"], records["meta"]["initial"]["head.weight"])


def test_a_bf16_mixed_precision_policy_computes_in_bf16_and_keeps_float32_shards(records):
    run = records["bf16"]
    assert run["dtypes"] == ["torch.bfloat16"]
    assert {value.dtype for value in run["final"].values()} == {torch.float32}
    reference, _ = replay(run)
    assert_weights_close(run["final"], reference.state_dict(), atol=2e-2)  # bf16 forward: 3 significant digits


# --- sharded checkpoints -----------------------------------------------------------------------
def test_checkpoints_are_directories_of_each_ranks_shards_pruned_and_linked_by_model_checkpoint(records, launched):
    steps, epochs = launched.out / "steps", launched.out / "epochs"
    assert sorted(path.name for path in steps.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]  # step 3 pruned
    assert sorted(path.name for path in epochs.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    for directory in (steps / "epoch=1-step=6.ckpt", steps / "last.ckpt", epochs / "last.ckpt"):
        assert sorted(path.name for path in directory.iterdir()) == SHARD_FILES
    for name in SHARD_FILES:  # last.ckpt of the same moment is the same files, hard-linked: one write, not two
        assert (epochs / "last.ckpt" / name).stat().st_ino == (epochs / "epoch=1-step=8.ckpt" / name).stat().st_ino
    # The step trigger last fired at step 6; last.ckpt was written again when training ended, at step 8.
    assert torch.load(steps / "last.ckpt" / "state.pt", weights_only=True)["loops"]["global_step"] == 8
    umask = os.umask(0)
    os.umask(umask)
    assert (steps / "last.ckpt" / "state.pt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_weights_only_sharded_checkpoint_loads_its_weights_and_holds_no_training_state(records, launched):
    [directory] = (launched.out / "weights_only").iterdir()  # monitor=None, save_top_k=1: the newest
    assert directory.name == "epoch=1-step=16.ckpt" and (directory / ".metadata").exists()  # no accumulation here
    state = torch.load(directory / "state.pt", weights_only=True)
    assert state["weights_only"] and "optimizer_states" not in state and "loops" not in state
    model = Blocks.load_from_checkpoint(directory)  # the shards, gathered
    assert_weights_close(model.state_dict(), records["plain"]["final"], atol=0)


def test_the_command_lines_last_and_best_find_sharded_checkpoint_directories(launched):
    from trainer.cli.runs import checkpoint_for

    steps = launched.out / "steps"
    same_as_the_run = ModelCheckpoint(dirpath=steps, every_n_train_steps=3, every_n_epochs=None, save_top_k=1,
                                      monitor=None, mode="max")  # run_fsdp's "steps" callback: its state key
    trainer = Trainer(strategy="cpu", logger=False, enable_progress_bar=False, callbacks=[same_as_the_run])
    assert Path(checkpoint_for("last", "test", trainer, "run_fsdp.Blocks")) == steps / "last.ckpt"
    assert Path(checkpoint_for("best", "test", trainer, "run_fsdp.Blocks")).resolve() == (steps / "epoch=1-step=6.ckpt").resolve()


def test_a_sharded_checkpoint_resumes_mid_epoch_to_the_same_weights(records):
    assert records["resume"]["global_step"] == 8
    assert_weights_close(records["resume"]["final"], records["accumulate_clip"]["final"], atol=0)


def test_validate_with_a_sharded_checkpoint_loads_its_weights_into_the_sharded_model(records, launched):
    model = Blocks()
    model.load_state_dict(records["accumulate_clip"]["at_step"][6]["weights"])
    data = IndexedRegression()
    with torch.no_grad():
        expected = F.mse_loss(model(data.x), data.y).item()
    assert launched.evaluated["validate_step6"][0]["val/loss"] == pytest.approx(expected, abs=1e-6)


def test_a_one_file_checkpoint_resumes_under_fsdp_each_rank_keeping_its_shard(records):
    assert records["resume_file"]["global_step"] == 8
    assert_weights_close(records["resume_file"]["initial"], records["accumulate_clip"]["at_step"][6]["weights"], atol=0)
    assert_weights_close(records["resume_file"]["final"], records["accumulate_clip"]["final"], atol=0)


def test_a_run_killed_during_a_background_save_leaves_only_complete_checkpoints(launched):
    killed = launched.out / "killed"
    in_flight = (killed / "killed_during_write").read_text().split()  # staging directories when the kill came
    left = sorted(path.name for path in killed.rglob(".*.tmp"))
    assert set(left) <= set(in_flight), (left, in_flight)  # a write the kill cut short is a staging directory only
    for checkpoint in killed.glob("*/*.ckpt"):  # every checkpoint a reader can see is whole
        check_complete(checkpoint)
    assert (killed / "steps" / "last.ckpt").is_dir() and (killed / "epochs" / "last.ckpt").is_dir()
    if any(name.startswith(".epoch=1-step=6.ckpt.") for name in left):  # step 6's write was cut short
        assert not (killed / "steps" / "epoch=1-step=6.ckpt").exists()
        # save_top_k=1 drops step 3 only once step 6 is complete; last.ckpt still holds step 3's state
        assert (killed / "steps" / "epoch=0-step=3.ckpt").is_dir()
        assert torch.load(killed / "steps" / "last.ckpt" / "state.pt", weights_only=True)["loops"]["global_step"] == 3


def test_a_run_killed_with_sigkill_resumes_exactly_on_two_spawned_processes(records, launched, tmp_path):
    killed = launched.out / "killed"
    model = Blocks(on_meta=True)  # layers built in configure_model: the caller's copy gets them too
    trainer = Trainer(strategy=FSDP(devices=2), max_epochs=2, seed=7, accumulate_grad_batches=2, gradient_clip_val=CLIP,
                      default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                      callbacks=[ModelCheckpoint(dirpath=killed / "epochs", save_top_k=-1, monitor=None),
                                 ModelCheckpoint(dirpath=killed / "steps", every_n_train_steps=3, every_n_epochs=None,
                                                 save_top_k=1, monitor=None, mode="max")])
    trainer.fit(model, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE, shuffle=True), DataLoader(IndexedRegression(), batch_size=8),
                ckpt_path="last")
    assert trainer.global_step == 8
    # gloo reduces in a fixed order on one machine: the same sums, so the same bits.
    assert_weights_close(model.state_dict(), records["accumulate_clip"]["final"], atol=0)


def test_a_two_rank_checkpoint_resumes_in_one_process_and_says_so(records, launched, tmp_path):
    checkpoint = launched.out / "epochs" / "epoch=0-step=4.ckpt"
    model = Blocks()
    trainer = Trainer(strategy="cpu", max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match=rf"Checkpoint {checkpoint} was written by 2 processes and resumes on 1: the "
                                         r"weights and optimizer states load whole; random draws and the rest of "
                                         r"the epoch's data order will differ"):  # a strategy without DistributedSampler
        trainer.fit(model, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE), ckpt_path=checkpoint)
    saved = records["accumulate_clip"]["at_step"][4]
    assert trainer.global_step == 4 and trainer.current_epoch == 1  # epoch 0 was done: nothing left to train
    assert_weights_close(model.state_dict(), saved["weights"], atol=0)
    momentum = {name: trainer.optimizers[0].state[p]["momentum_buffer"] for name, p in model.named_parameters()}
    assert_weights_close(momentum, saved["momentum"], atol=0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)  # StepLR stepped at step 3


def test_a_mid_epoch_checkpoint_of_two_ranks_resumes_on_one_dealing_out_exactly_the_samples_not_yet_trained(
        records, launched, tmp_path, monkeypatch, capsys):
    # torchrun --nnodes=1:2 restarted with one process: DDP joins a group of one, in this process.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    checkpoint = launched.out / "steps" / "epoch=1-step=6.ckpt"  # 4 of the 8 batches of epoch 1 on each rank
    model = Blocks()
    trainer = Trainer(strategy=DDP(), max_epochs=2, seed=7, accumulate_grad_batches=2, default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="resumes on 1: the weights and optimizer states load whole; the samples of "
                                         "the epoch no process trained yet are dealt out"):
        trainer.fit(model, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE, shuffle=True), ckpt_path=checkpoint)
    assert (f"resuming from {checkpoint} at epoch 1, global step 6, after batch 3 of the epoch on each of 2 processes; "
            "its untrained samples dealt out among 1") in capsys.readouterr().err
    trained_before = [index for rank in records["accumulate_clip"]["seen"] for _, indices in rank[8:12] for index in indices]
    trained_after = [index for _, indices in model.seen for index in indices]
    assert len(trained_before) == 32 and sorted(trained_before + trained_after) == list(range(64))  # each sample once
    # The epoch's last batch keeps its index (8 batches a rank on 2 processes, 16 on one): 4 optimizer steps more.
    assert [batch_idx for batch_idx, _ in model.seen] == list(range(8, 16)) and trainer.global_step == 10


def test_convert_checkpoint_writes_one_plain_file_that_loads_into_the_module(records, launched, tmp_path, capsys):
    checkpoint, converted = launched.out / "steps" / "epoch=1-step=6.ckpt", tmp_path / "model.ckpt"
    assert cadence(["convert-checkpoint", str(checkpoint), str(converted)]) == 0
    assert f"Wrote {converted}" in capsys.readouterr().err
    state = torch.load(converted, weights_only=True)
    model = Blocks()
    model.load_state_dict(state["state_dict"])  # strict: every key, whole tensors
    assert_weights_close(model.state_dict(), records["accumulate_clip"]["at_step"][6]["weights"], atol=0)
    assert state["loops"]["global_step"] == 6 and len(state["rng"]) == 2 and state["format"] == 1

    def resumed(ckpt_path) -> dict:
        module = Blocks()
        with pytest.warns(UserWarning, match="was written by 2 processes and resumes on 1"):
            Trainer(strategy="cpu", max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                    enable_checkpointing=False, accumulate_grad_batches=2, seed=1).fit(
                module, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE, shuffle=True), ckpt_path=ckpt_path)
        return module.state_dict()

    assert_weights_close(resumed(converted), resumed(checkpoint), atol=0)  # the file holds the whole state


def test_a_checkpoint_whose_swap_was_interrupted_is_found_by_last(launched, tmp_path):
    # A kill between the two renames of a directory swap leaves last.ckpt aside as .last.ckpt.*.old.
    shutil.copytree(launched.out / "steps" / "last.ckpt", tmp_path / ".last.ckpt.d34d.old")
    trainer = Trainer(strategy="cpu", max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=False, save_top_k=0)])
    with pytest.warns(UserWarning, match="resumes on 1"):
        trainer.fit(Blocks(), DataLoader(IndexedRegression(), batch_size=BATCH_SIZE), ckpt_path="last")
    assert trainer.global_step == 8 and (tmp_path / "last.ckpt").is_dir()  # where the copied last.ckpt ended


# --- damaged checkpoints -----------------------------------------------------------------------
@pytest.fixture
def damaged(launched, tmp_path):
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(launched.out / "steps" / "epoch=1-step=6.ckpt", copy)
    return copy


def fit_from(path: Path, strategy, tmp_path: Path) -> None:
    Trainer(strategy=strategy, max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
            enable_checkpointing=False).fit(Blocks(), DataLoader(IndexedRegression(), batch_size=BATCH_SIZE), ckpt_path=path)


def test_a_truncated_shard_is_refused_naming_it_before_any_process_starts(damaged, tmp_path):
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"Checkpoint {damaged} is incomplete: its shard __1_0.distcp has 100 bytes "
                                         r"where the index needs \d+"):
        fit_from(damaged, FSDP(devices=2), tmp_path)


def test_a_directory_without_its_index_or_state_is_refused_as_incomplete(damaged, tmp_path):
    (damaged / ".metadata").unlink()
    with pytest.raises(ValueError, match=rf"Checkpoint {damaged} is incomplete: it has no .metadata\. A sharded "
                                         r"checkpoint is renamed into place only after every rank wrote its shards"):
        fit_from(damaged, FSDP(devices=2), tmp_path)


def test_a_corrupted_shard_fails_naming_the_checkpoint_not_a_bare_checkpoint_exception(damaged, tmp_path):
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(bytes(len(shard.read_bytes())))  # the right size, all zeros
    with pytest.raises(ValueError, match=rf"Checkpoint {damaged} is truncated or corrupted \(.+\)\. Use an earlier "
                                         r"checkpoint"):
        fit_from(damaged, "cpu", tmp_path)


def test_an_index_that_would_run_code_when_loaded_is_refused(damaged, tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ("this must never print",))

    (damaged / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(ValueError, match=rf"Refusing to load checkpoint {damaged}: the index refers to builtins.print"):
        fit_from(damaged, "cpu", tmp_path)


def test_a_sharded_checkpoint_of_another_model_names_the_keys_that_differ(damaged, tmp_path):
    class Wider(Blocks):
        def build(self):
            super().build()
            self.head = torch.nn.Linear(32, 3)
            self.scale = torch.nn.Parameter(torch.ones(3))

    with pytest.raises(ValueError, match=r"does not fit Wider: shapes differ for \[scale: checkpoint \(2,\), model \(3,\), "
                                         r"head.weight: checkpoint \(2, 32\), model \(3, 32\)"):
        Trainer(strategy="cpu", max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                enable_checkpointing=False).fit(Wider(), DataLoader(IndexedRegression(), batch_size=BATCH_SIZE), ckpt_path=damaged)


# --- options -----------------------------------------------------------------------------------
def test_strategy_fsdp_with_devices_is_an_fsdp_strategy():
    trainer = Trainer(strategy="fsdp", devices=2, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, FSDP) and trainer.strategy.num_processes == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"auto_wrap": 3}, r"FSDP\(auto_wrap=3\): use None \(every direct child with parameters\), a module class"),
    ({"reshard_after_forward": 1}, r"FSDP\(reshard_after_forward=1\): use True, False, or an int >= 2"),
    ({"mixed_precision": "bf16"}, r"FSDP\(mixed_precision='bf16'\): use a torch.distributed.fsdp.MixedPrecisionPolicy"),
    ({"cpu_offload": True}, r"FSDP\(cpu_offload=True\) keeps the shards on the CPU while GPUs compute; this run trains "
                            r"on the CPU already"),
    ({"device_mesh": (3, 1)}, r"FSDP\(device_mesh=\(3, 1\)\) needs 3 processes \(3 replicas of 1 shards\), but this run "
                              r"has 2"),
    ({"device_mesh": [2]}, r"FSDP\(device_mesh=\[2\]\): use None, a pair \(replicas, shard_size\)"),
    ({"devices": 0}, r"FSDP\(devices=0\): use an int >= 1"),
])
def test_a_bad_option_fails_when_the_trainer_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        Trainer(strategy=FSDP(**{"devices": 2, **options}))


def test_cpu_offload_gives_the_process_group_gloo_for_the_cpu_gradient_shards_beside_nccl():
    # Clipping's norm over offloaded (CPU) gradient shards is an all-reduce NCCL refuses.
    backend = FSDP(devices=2, backend="nccl", cpu_offload=True).process_group_backend()
    assert backend == "cuda:nccl,cpu:gloo"
    config = torch.distributed.distributed_c10d.BackendConfig(torch.distributed.Backend(backend))
    assert config.get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}  # as init_process_group reads it
    assert FSDP(devices=2, backend="nccl").process_group_backend() == "nccl"
    assert FSDP(devices=2, backend="gloo").process_group_backend() == "gloo"


def test_precision_maps_onto_the_mixed_precision_policy_and_float16_is_refused():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strategy = FSDP(devices=2)
    assert strategy.mixed_precision(torch.bfloat16) is True
    assert strategy.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"float16 under FSDP needs loss scaling that agrees across shards"):
        FSDP(devices=2).mixed_precision(torch.float16)
    chosen = FSDP(devices=2, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32))
    with pytest.raises(ValueError, match=r"asks for torch.bfloat16, but FSDP\(mixed_precision=...\) computes in "
                                         r"torch.float32"):
        chosen.mixed_precision(torch.bfloat16)


def test_trainer_precision_under_fsdp_sets_the_policy_instead_of_adding_autocast():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    trainer = Trainer(strategy=FSDP(devices=2), precision="bf16-mixed", logger=False, enable_checkpointing=False)
    assert not any(isinstance(callback, AMP) for callback in trainer.callbacks)
    assert trainer.strategy.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"float16 under FSDP needs loss scaling"):
        Trainer(strategy="fsdp", devices=2, precision="16-mixed")


def test_an_unpicklable_model_is_named_with_fsdp_in_the_message_before_any_process_starts(tmp_path):
    model = Blocks()
    model.transform = lambda x: x
    trainer = Trainer(strategy=FSDP(devices=2), max_epochs=1, default_root_dir=tmp_path, logger=False)
    with pytest.raises(ValueError, match=r"^FSDP starts 2 new processes and must pickle the work for them, but "
                                         r"`module.transform` cannot be pickled"):
        trainer.fit(model, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE))


def test_a_meta_device_layer_without_reset_parameters_is_named():
    from strategies.fsdp import materialize

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        block = torch.nn.Sequential(torch.nn.Linear(2, 3), Scale())
    with pytest.raises(RuntimeError, match=r"blocks.0.1 \(Scale\) was built on the meta device, and FSDP materializes "
                                           r"such blocks one at a time, but it has no reset_parameters\(\)"):
        materialize(block, torch.device("cpu"), "blocks.0")
