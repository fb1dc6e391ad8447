"""DDP on the CPU: two gloo processes, spawned by ``fit`` or started by torchrun.

Starting a worker costs seconds (each one imports torch), so one spawned ``fit`` serves several
tests: the weights against single-process training, the sharding, the scheduler, what rank zero
alone writes, and the results that come back to the caller. The failure tests spawn their own.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import csv
import io
import json
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import AutoMicrobatch, CSVLogger, ModelCheckpoint, Profiler
from linear_regression import IndexedRegression, LinearRegression, regression_samples
from strategies import DDP, DDPStrategy
from processes import REAL_SPAWN, free_port, run_together, torchrun
from trainer import DataModule, Trainer, TrainingModule, seed_everything

WORLD_SIZE = 2
SAMPLES = 64
BATCH_SIZE = 4  # per rank and micro-batch
ACCUMULATE = 2
EPOCHS = 2
STEPS = EPOCHS * SAMPLES // (WORLD_SIZE * BATCH_SIZE * ACCUMULATE)  # optimizer steps: 8


def make_optimizer(parameters):
    optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.5)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


class Recorder(TrainingModule):
    """Linear regression; each rank writes what it trained and validated on to ``rank{r}.json``.
    Rank 1 runs out of memory (as a GPU would) for batches of more than 2 samples: ``AutoMicrobatch``
    splits its batches, and not rank 0's."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.layer = nn.Linear(4, 2)
        self.seen: list = []  # [epoch, batch_idx, sample indices]
        self.validated: list = []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append([self.current_epoch, batch_idx, batch[0].tolist()])  # the whole batch, split or not

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        if self.trainer.global_rank == 1 and len(index) > 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory (the test's, for {len(index)} samples on rank 1)")
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        if not self.trainer.sanity_checking:
            self.validated += index.tolist()
        rank = torch.tensor(float(self.trainer.global_rank))
        self.log("val/rank", rank, sync_dist=True)
        self.log("val/rank_here", rank)
        if self.trainer.is_global_zero:  # with sync_dist alone, rank 1 would never join the reduction
            self.log("val/zero_only", 7.0, sync_dist=True, rank_zero_only=True)

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        return index, self.layer(x)

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self):
        record = {
            "rank": self.trainer.global_rank, "world_size": self.trainer.world_size, "seen": self.seen,
            "validated": self.validated, "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "global_step": self.trainer.global_step,
            "state_dict": {key: value.tolist() for key, value in self.state_dict().items()},
        }
        Path(self.out_dir, f"rank{self.trainer.global_rank}.json").write_text(json.dumps(record))


class PredictionData(DataModule):
    """13 samples to predict, built in setup; each rank notes when it ran prepare_data and setup."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def _note(self, hook: str) -> None:
        with open(Path(self.out_dir, "data_hooks.txt"), "a") as file:
            file.write(f"{hook} {self.trainer.global_rank} {time.monotonic()}\n")

    def prepare_data(self):
        self._note("prepare_data")
        time.sleep(0.2)  # a slow download: no rank may set up before it is done

    def setup(self, stage):
        self._note("setup")
        self.dataset = IndexedRegression(count=13)

    def predict_dataloader(self):
        return DataLoader(self.dataset, batch_size=4)


class HookCalls:
    """The state of a DDP communication hook: where each rank notes the hook's calls."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir


def counting_allreduce(state: HookCalls, bucket):
    """DDP's own averaging all-reduce, noting each call: Lightning's ddp_comm_hook= takes such a function."""
    with open(Path(state.out_dir, f"comm_hook{torch.distributed.get_rank()}.txt"), "a") as file:
        file.write(f"{bucket.buffer().numel()}\n")
    return default_hooks.allreduce_hook(None, bucket)


@contextlib.contextmanager
def stderr_into(path: Path):
    """Send file descriptor 2 (inherited by the workers) to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@pytest.fixture(scope="module")
def spawned_fit(tmp_path_factory):
    """One 2-process fit with accumulation, validation, a step scheduler, a logger, checkpoints, and
    rank 1's batches split into microbatches."""
    out = tmp_path_factory.mktemp("ddp")
    model = Recorder(str(out))
    initial = copy.deepcopy(model.state_dict())
    data = IndexedRegression()
    trainer = Trainer(  # Lightning's DDPStrategy and its arguments: a hook and DistributedDataParallel's own
        strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=HookCalls(str(out)),
                             ddp_comm_hook=counting_allreduce, broadcast_buffers=False),
        accelerator="cpu", devices=WORLD_SIZE, max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATE,
        default_root_dir=out, logger=CSVLogger(), log_every_n_steps=2, seed=0,
        max_time={"hours": 1},  # never reached: the ranks' Timer checks pair up at log steps, no hang
        callbacks=[Profiler(wait=0, warmup=1, active=1, record_shapes=False, profile_memory=False), AutoMicrobatch(),
                   ModelCheckpoint(),
                   # Always due: the ranks compare their clocks after every step and save together,
                   # rank zero in the background (each save waits for the previous one, on every rank).
                   ModelCheckpoint(dirpath=out / "timed", filename="{step}", save_top_k=-1, save_last=False,
                                   train_time_interval=timedelta(0), async_save=True)],
    )
    with stderr_into(out / "stderr.txt"):
        trainer.fit(model, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True), DataLoader(data, batch_size=8))
        records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
        csv_after_fit = (Path(trainer.log_dir) / "metrics.csv").read_text()
        validated = trainer.validate(model, DataLoader(data, batch_size=8))
        validate_metrics = dict(trainer.callback_metrics)  # each stage starts without them, as in Lightning
        predicted = trainer.predict(model, datamodule=PredictionData(str(out)))
        trainer.save_checkpoint(out / "after_fit.ckpt")  # the state the workers ended fit with
    return SimpleNamespace(trainer=trainer, model=model, initial=initial, data=data, records=records, out=out,
                           validated=validated, validate_metrics=validate_metrics, predicted=predicted,
                           csv_after_fit=csv_after_fit,
                           stderr=(out / "stderr.txt").read_text())


def test_ddp_weights_equal_single_process_training_on_the_same_global_batches(spawned_fit):
    # k micro-batches on N ranks must equal one batch k*N times larger: replay the global batches
    # the ranks saw, in one process, with a hand-written loop.
    layer = nn.Linear(4, 2)
    layer.load_state_dict({key.removeprefix("layer."): value for key, value in spawned_fit.initial.items()})
    optimizer, scheduler = make_optimizer(layer.parameters())
    seen = [record["seen"] for record in spawned_fit.records]
    for first in range(0, len(seen[0]), ACCUMULATE):
        indices = [i for micro in range(first, first + ACCUMULATE) for rank_seen in seen for i in rank_seen[micro][2]]
        x, y = spawned_fit.data.x[indices], spawned_fit.data.y[indices]
        F.mse_loss(layer(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    trained = spawned_fit.model.layer
    torch.testing.assert_close(trained.weight, layer.weight, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trained.bias, layer.bias, atol=1e-6, rtol=1e-5)


def test_lightning_ddp_strategy_registers_its_comm_hook_which_averages_every_step_on_every_rank(spawned_fit):
    # The weights equal single-process training (above) with the hook in place: it did the averaging.
    calls = [(spawned_fit.out / f"comm_hook{rank}.txt").read_text().split() for rank in range(WORLD_SIZE)]
    assert calls[0] == calls[1]  # every rank all-reduced the same buckets, as many times
    assert len(calls[0]) >= STEPS  # at least once per optimizer step
    assert set(calls[0]) == {"10"}  # one bucket: the 4x2 weights and 2 biases of the layer


def test_ranks_may_split_their_batches_differently_and_still_train_on_the_global_batch(spawned_fit):
    # The weights test above holds with rank 1's batches split in two and rank 0's whole: each rank
    # weights its microbatches by their share of its batch, and DDP averages the ranks' gradients.
    said = [line for line in spawned_fit.stderr.splitlines() if line.startswith("AutoMicrobatch")]
    assert said == ["AutoMicrobatch: rank 1: training batch 0 (epoch 0, global step 0) ran out of memory in the "
                    "forward; it and the batches after it run as 2 microbatches of up to 2 samples, gradients "
                    "accumulated within the step (the same update)."]


def test_each_rank_trains_on_its_own_shard_in_a_new_order_each_epoch(spawned_fit):
    for epoch in range(EPOCHS):
        shards = [[i for e, _, batch in record["seen"] if e == epoch for i in batch] for record in spawned_fit.records]
        assert set(shards[0]).isdisjoint(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(SAMPLES))
    first_epoch = [i for e, _, batch in spawned_fit.records[0]["seen"] if e == 0 for i in batch]
    second_epoch = [i for e, _, batch in spawned_fit.records[0]["seen"] if e == 1 for i in batch]
    assert first_epoch != second_epoch  # set_epoch reshuffled


def test_lr_scheduler_steps_once_per_optimizer_step_on_every_rank(spawned_fit):
    for record in spawned_fit.records:
        assert record["global_step"] == STEPS
        assert record["lr"] == pytest.approx(0.1 * 0.5 ** (STEPS // 3))


def test_validation_is_sharded_and_sync_dist_metrics_are_averaged_over_ranks(spawned_fit):
    validated = [set(record["validated"]) for record in spawned_fit.records]
    assert validated[0].isdisjoint(validated[1]) and validated[0] | validated[1] == set(range(SAMPLES))
    assert spawned_fit.validate_metrics["val/rank"].item() == 0.5
    assert spawned_fit.validate_metrics["val/rank_here"].item() == 0.0  # rank zero's own


def test_a_spawned_validate_returns_the_metrics_reduced_over_ranks(spawned_fit):
    assert spawned_fit.validated == [{"val/rank": 0.5, "val/rank_here": 0.0, "val/zero_only": 7.0}]


def test_a_spawned_predict_returns_every_sample_once_in_the_dataset_order(spawned_fit):
    # 13 samples over 2 ranks: blocks of 7 and 6, batches of 4, 3 | 4, 2.
    indices = torch.cat([index for index, _ in spawned_fit.predicted])
    assert indices.tolist() == list(range(13))
    assert [len(index) for index, _ in spawned_fit.predicted] == [4, 3, 4, 2]
    outputs = torch.cat([output for _, output in spawned_fit.predicted])
    with torch.no_grad():
        torch.testing.assert_close(outputs, spawned_fit.model.layer(IndexedRegression(count=13).x))


def test_prepare_data_runs_on_local_rank_zero_before_any_rank_sets_up(spawned_fit):
    # The prediction above read a DataModule: prepare_data ran once, and every setup began after it ended.
    notes = [line.split() for line in (spawned_fit.out / "data_hooks.txt").read_text().splitlines()]
    assert sorted((hook, rank) for hook, rank, _ in notes) == [("prepare_data", "0"), ("setup", "0"), ("setup", "1")]
    prepared_at = float(next(at for hook, _, at in notes if hook == "prepare_data"))
    assert all(float(at) >= prepared_at + 0.2 for hook, _, at in notes if hook == "setup")


def test_the_trained_weights_and_counters_come_back_to_the_caller(spawned_fit):
    for key, value in spawned_fit.model.state_dict().items():
        assert value.tolist() == spawned_fit.records[0]["state_dict"][key] == spawned_fit.records[1]["state_dict"][key]
    assert spawned_fit.trainer.global_step == STEPS
    assert spawned_fit.trainer.current_epoch == EPOCHS


def test_each_rank_writes_its_own_profiler_trace_and_rank_zero_prints_the_table(spawned_fit):
    traces = sorted(path.name for path in (Path(spawned_fit.trainer.log_dir) / "profiler").glob("*.pt.trace.json.gz"))
    assert traces == ["rank0-window0.pt.trace.json.gz", "rank1-window0.pt.trace.json.gz"]
    assert spawned_fit.stderr.count("Profiler, rank 0, window 0") == 1 and "Profiler, rank 1" not in spawned_fit.stderr
    assert spawned_fit.stderr.count("Performance report (fit)") == 1


def test_only_rank_zero_prints_and_writes_logs_and_checkpoints(spawned_fit):
    assert spawned_fit.stderr.count("DDPStrategy: 2 processes") == 3  # fit, validate, predict
    assert spawned_fit.stderr.count("Epoch 1/2") == 1
    versions = list((spawned_fit.out / "lightning_logs").iterdir())
    assert [path.name for path in versions] == ["version_0"]
    rows = list(csv.DictReader(io.StringIO(spawned_fit.csv_after_fit)))
    written = [(row["step"], name) for row in rows for name, value in row.items() if value and name not in ("epoch", "step")]
    assert len(written) == len(set(written)) and ("7", "train/loss") in written  # once each (one writer); step 8 at 7
    checkpoint = torch.load(versions[0] / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == {"layer.weight", "layer.bias"}  # no wrapper prefixes
    torch.testing.assert_close(checkpoint["state_dict"]["layer.weight"], spawned_fit.model.layer.weight)


def test_a_train_time_interval_under_ddp_saves_on_every_rank_at_the_same_steps_also_in_the_background(spawned_fit):
    steps = EPOCHS * SAMPLES // (WORLD_SIZE * BATCH_SIZE * ACCUMULATE)
    assert sorted(path.name for path in (spawned_fit.out / "timed").iterdir()) == sorted(
        f"step={step}.ckpt" for step in range(1, steps + 1))
    for step in range(1, steps + 1):  # written in the background, all complete when fit returned
        assert torch.load(spawned_fit.out / "timed" / f"step={step}.ckpt", weights_only=True)["global_step"] == step


def test_save_checkpoint_after_a_spawned_fit_holds_the_state_the_workers_ended_with(spawned_fit):
    # last.ckpt was written by rank zero at the end of the last epoch; the caller's
    # save_checkpoint, after validate and predict, writes the same training state from the handoff.
    last = torch.load(Path(spawned_fit.trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    after_fit = torch.load(spawned_fit.out / "after_fit.ckpt", weights_only=True)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "rng"):
        assert_same(after_fit[key], last[key], key)
    assert len(after_fit["rng"]) == WORLD_SIZE  # every rank's RNG states, for an exact continuation
    assert after_fit["optimizer_states"][0]["state"]  # SGD's momentum buffers came back from the workers


def assert_same(ours, theirs, where: str) -> None:
    """Equal nested checkpoint contents: tensors by value, the rest by ==."""
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            assert_same(mine, other, f"{where}[{index}]")
    else:
        assert ours == theirs, where


# --- faults --------------------------------------------------------------------------------------
class Misbehaves(LinearRegression):
    """At training batch 2, rank 1 raises, aborts, calls sys.exit, stalls or logs a key rank 0 does
    not; or every rank calls sys.exit; or rank 0 sends SIGTERM to the launching process (a scheduler
    preempting the job); or rank 1 aborts while its process exits after the run."""

    def __init__(self, what: str, out_dir: str) -> None:
        super().__init__()
        self.what, self.out_dir = what, out_dir
        self.launcher = os.getpid()  # made in the launching process

    def setup(self, stage):
        Path(self.out_dir, f"pid{self.trainer.global_rank}").write_text(str(os.getpid()))

    def teardown(self, stage):
        if self.what == "abort_at_exit" and self.trainer.global_rank == 1:
            atexit.register(os.abort)  # a native crash while the finished worker's interpreter exits

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        if self.what == "signal" and self.trainer.global_rank == 0 and batch_idx == 2 and self.current_epoch == 0:
            os.kill(self.launcher, signal.SIGTERM)
        if self.trainer.global_rank == 1 and batch_idx == 2:
            if self.what == "raise":
                raise ValueError("rank 1 fails at batch 2")
            if self.what == "abort":
                os.abort()  # what a fatal error in native code does
            if self.what == "exit":
                sys.exit(0)
            if self.what == "stall":
                time.sleep(60)
            if self.what == "log":
                self.log("train/only_on_rank_1", 1.0, sync_dist=True)
        if self.what == "exit_everywhere" and batch_idx == 2:
            sys.exit(0)
        return F.mse_loss(self.layer(x), y)


def fit_misbehaving(what: str, out_dir: Path, **ddp_options) -> Trainer:
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE, **ddp_options), max_epochs=1, default_root_dir=out_dir,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False, log_every_n_steps=4)
    trainer.fit(Misbehaves(what, str(out_dir)), DataLoader(IndexedRegression(), batch_size=8))
    return trainer


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_rank_that_raises_stops_every_rank_and_the_caller_gets_its_traceback(tmp_path):
    threads = native_threads()
    # "every rank was stopped": the launcher ended rank 0, which would otherwise wait in its next
    # collective until the process group's timeout (a hang would say "fell behind" instead).
    with pytest.raises(RuntimeError, match="DDP rank 1 of 2 failed, so every rank was stopped") as raised:
        fit_misbehaving("raise", tmp_path)
    message = str(raised.value)
    assert "ValueError: rank 1 fails at batch 2" in message
    assert "in training_step" in message  # the failing rank's traceback, not the others' broken pipes
    assert multiprocessing.active_children() == []
    # The launcher's store (a server thread in this process) is gone although the error, whose
    # traceback holds the launcher's frames, is kept: destroyed later in a forked DataLoader
    # worker, it segfaulted that worker.
    assert native_threads() == threads
    for rank in range(WORLD_SIZE):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_rank_that_crashes_in_native_code_is_reported_with_its_python_stack(tmp_path, capfd):
    with pytest.raises(RuntimeError, match=r"DDP rank 1 of 2 \(pid \d+\) ended without reporting an error "
                                           r"\(process 1 terminated with signal SIGABRT\)\. It crashed in native code") as raised:
        fit_misbehaving("abort", tmp_path)
    assert "rank 1 (" in str(raised.value)  # where each rank was
    output = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in output
    assert "in training_step" in output  # the crashed rank's Python stack, printed by faulthandler
    assert multiprocessing.active_children() == []


def test_a_rank_that_crashes_while_exiting_after_its_work_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(REAL_SPAWN, "1")  # a real worker's exit, where the crash happens
    with pytest.warns(UserWarning, match=r"DDP rank 1 of 2 was killed by SIGABRT while its process was exiting, "
                                         r"after it had finished its work; the results are complete"):
        trainer = fit_misbehaving("abort_at_exit", tmp_path)
    assert trainer.global_step == SAMPLES // (WORLD_SIZE * 8)  # the run's results came back
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("what", ["exit", "exit_everywhere"])
def test_sys_exit_in_a_worker_mid_run_is_an_error_with_its_traceback(tmp_path, what):
    with pytest.raises(RuntimeError, match=r"DDP rank [01] of 2 (failed, so every rank was stopped|ended before its "
                                           r"work was done)\. Its error:") as raised:
        fit_misbehaving(what, tmp_path)
    assert "SystemExit: 0" in str(raised.value) and "in training_step" in str(raised.value)
    assert multiprocessing.active_children() == []


def test_a_collective_timeout_names_the_rank_that_fell_behind_and_where(tmp_path):
    # The 3-second collective timeout fired (the stalled rank sleeps far longer), and named the laggard.
    with pytest.raises(RuntimeError, match="Rank 1 fell behind: it was in training_step at training batch 2"):
        fit_misbehaving("stall", tmp_path, timeout=3)
    assert multiprocessing.active_children() == []


def test_a_sync_dist_key_logged_on_one_rank_only_is_an_error_naming_key_and_rank(tmp_path):
    with pytest.raises(RuntimeError, match=r'"train/only_on_rank_1", ..., sync_dist=True\) was called on '
                                           r"rank\(s\) \[1\] but not on rank\(s\) \[0\]"):
        fit_misbehaving("log", tmp_path)


def test_a_sigterm_to_the_launching_process_lets_every_rank_save_and_stop(tmp_path):
    # The launcher passes the signal on to the workers; they agree at the next log step (4), write
    # last.ckpt and stop; fit then exits with 128 + SIGTERM, as trainer/preemption.py promises.
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE), max_epochs=3, default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False, log_every_n_steps=4)
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Misbehaves("signal", str(tmp_path)), DataLoader(IndexedRegression(), batch_size=8))
    assert exited.value.code == 128 + signal.SIGTERM
    assert trainer.global_step == 4  # of 12
    assert (Path(trainer.log_dir) / "checkpoints" / "last.ckpt").is_file()
    assert multiprocessing.active_children() == []


class LocalDataset(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.zeros(4), torch.zeros(2)


def _unpicklable(kind: str):
    model, loader = Misbehaves("nothing", "."), DataLoader(IndexedRegression(), batch_size=8)
    if kind == "model":
        model.transform = lambda x: x
    elif kind == "dataset":
        class Local(LocalDataset):
            pass

        loader = DataLoader(Local(), batch_size=8)
    else:
        loader = DataLoader(IndexedRegression(), batch_size=8, collate_fn=lambda items: items)
    return model, loader


@pytest.mark.parametrize(("kind", "culprit"), [("model", "module.transform"), ("dataset", "data.train_dataloaders.dataset"),
                                               ("collate_fn", "data.train_dataloaders.collate_fn")])
def test_an_unpicklable_model_or_loader_is_named_before_any_process_starts(tmp_path, kind, culprit):
    model, loader = _unpicklable(kind)
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE), max_epochs=1, default_root_dir=tmp_path, logger=False)
    with pytest.raises(ValueError, match=rf"`{culprit}` cannot be pickled .* module level .* torchrun"):
        trainer.fit(model, loader)
    assert multiprocessing.active_children() == []


# --- torchrun ------------------------------------------------------------------------------------
TORCHRUN_SCRIPT = '''
import json, sys
from pathlib import Path
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer, TrainingModule

class Regression(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)
    def test_step(self, batch, batch_idx):
        self.log("test/rank", torch.tensor(float(self.trainer.global_rank)), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 2, generator=generator))
    model = Regression()
    trainer = Trainer(strategy="ddp", max_epochs=2, default_root_dir=out, enable_progress_bar=False, seed=7)
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    tested = trainer.test(model, DataLoader(data, batch_size=8))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "world_size": trainer.world_size, "log_dir": str(trainer.log_dir), "tested": tested,
        "global_step": trainer.global_step, "weight": model.layer.weight.tolist()}))
'''


def test_the_same_script_joins_a_two_node_torchrun_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    node = torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                    "--rdzv-id=cadence-test", str(script), str(tmp_path))
    nodes = run_together([node, node], timeout=150)
    outputs = [output for _, output in nodes]
    assert [status for status, _ in nodes] == [0, 0], "\n".join(outputs)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [record["world_size"] for record in records] == [2, 2]
    assert records[0]["weight"] == records[1]["weight"]
    assert records[0]["global_step"] == 8  # 64 samples / (2 ranks * 8) * 2 epochs
    assert records[0]["log_dir"] == records[1]["log_dir"]  # rank zero's, broadcast
    assert records[0]["tested"] == records[1]["tested"] == [{"test/rank": 0.5}]  # a second stage re-joins
    assert "".join(outputs).count("DDP: 2 processes on 2 machine(s), joined from torchrun") == 1  # once per Trainer (fit, then test)


# --- manual optimization -------------------------------------------------------------------------
class TwoOptimizers(TrainingModule):
    """A GAN-shaped manual step, as Lightning's GAN example writes it: two optimizers, each toggled,
    a ``manual_backward`` for each, ``training_step(batch)`` without ``batch_idx``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(4, 3), nn.Linear(3, 2)

    def training_step(self, batch):
        _, x, y = batch
        first_optimizer, second_optimizer = self.optimizers()
        for optimizer, loss in ((first_optimizer, lambda: F.mse_loss(self.second(self.first(x)), y)),
                                (second_optimizer, lambda: F.mse_loss(self.second(self.first(x).detach()), y))):
            self.toggle_optimizer(optimizer)
            optimizer.zero_grad()
            self.manual_backward(loss())
            optimizer.step()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.first.parameters(), lr=0.1), torch.optim.SGD(self.second.parameters(), lr=0.1)


def test_manual_optimization_under_ddp_all_reduces_every_manual_backward(tmp_path):
    # Before: DDP prepared its all-reduce after the forward, which in manual optimization holds the
    # backwards, so the second step failed ("initialize_buckets must NOT be called during autograd").
    torch.manual_seed(0)
    model, data = TwoOptimizers(), IndexedRegression(count=32)
    reference = copy.deepcopy(model)
    Trainer(strategy=DDP(devices=WORLD_SIZE), max_epochs=2, default_root_dir=tmp_path, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, report=False,
            enable_model_summary=False).fit(model, DataLoader(data, batch_size=4))
    # Each rank's 4 samples per step, averaged over 2 ranks: one process with 8 (the shards
    # interleave, so the global batch is 8 consecutive samples).
    optimizers = (torch.optim.SGD(reference.first.parameters(), lr=0.1), torch.optim.SGD(reference.second.parameters(), lr=0.1))
    for _ in range(2):
        for start in range(0, 32, 8):
            x, y = data.x[start:start + 8], data.y[start:start + 8]
            for optimizer, loss in ((optimizers[0], lambda: F.mse_loss(reference.second(reference.first(x)), y)),
                                    (optimizers[1], lambda: F.mse_loss(reference.second(reference.first(x).detach()), y))):
                optimizer.zero_grad()
                loss().backward()
                optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-6, rtol=1e-5, msg=name)


class WithAnUnusedLayer(TrainingModule):
    """The SWA pattern of Lightning's CIFAR-10 tutorial: a trained copy (``spare``) the loss never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_parameters_the_loss_never_uses_get_the_cadence_way_to_find_unused_parameters(tmp_path):
    trainer = Trainer(strategy="ddp", devices=WORLD_SIZE, max_epochs=1, default_root_dir=tmp_path, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, report=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r'did not receive grad(.|\n)*In Cadence, pass Trainer\(strategy='
                                           r'"ddp_find_unused_parameters_true"\) or strategies.DDP\('
                                           r'find_unused_parameters=True\)'):
        trainer.fit(WithAnUnusedLayer(), DataLoader(IndexedRegression(count=32), batch_size=4))


class DrawsAtSetup(LinearRegression):
    """Writes the first numbers its rank draws from torch's RNG in ``setup`` to ``draws{rank}.json``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def setup(self, stage):
        Path(self.out_dir, f"draws{self.trainer.global_rank}.json").write_text(json.dumps(torch.rand(3).tolist()))


def test_seed_everything_before_a_spawned_stage_seeds_every_rank_as_in_lightning(tmp_path, monkeypatch):
    # Lightning's DDP setup calls reset_seed() on every rank: seed_everything's seed, from PL_GLOBAL_SEED.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # seed_everything sets it; put it back afterwards
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    seed_everything(123)
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE), default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, report=False)
    trainer.validate(DrawsAtSetup(str(tmp_path)), DataLoader(TensorDataset(*regression_samples(8)), batch_size=4), verbose=False)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(123)).tolist()
    assert [json.loads((tmp_path / f"draws{rank}.json").read_text()) for rank in range(WORLD_SIZE)] == [expected] * 2
