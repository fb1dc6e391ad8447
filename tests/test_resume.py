"""Exact resume: a run killed at any instant and resumed ends with bit-identical weights.

The kill tests run ``tests/run_resumable.py`` in a child process and SIGKILL it (no cleanup of
any kind runs), then resume here with the same code; the uninterrupted run is the reference. The
in-process tests cover what the child does not: a loader with its own generator, persistent
workers, and that the batches already trained are skipped without being fetched.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import run_resumable
from processes import free_port, run_together, torchrun
from callbacks import Callback
from strategies import DDP
from trainer import Trainer, TrainingModule, seed_everything

SCRIPT = Path(run_resumable.__file__)


@pytest.fixture
def uninterrupted(resumable_reference) -> dict[str, torch.Tensor]:
    return resumable_reference


def run_child(root: Path, *options: str) -> int:
    """Run the script in its own process group; once it dies, SIGKILL its DataLoader workers too
    (as losing the node would). Returns the child's exit status."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "child.log", "w") as log:
        child = subprocess.Popen([sys.executable, str(SCRIPT), str(root), *options], stdout=log, stderr=log,
                                 start_new_session=True)
        status = child.wait(timeout=120)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    return status


def assert_same_weights(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key


def test_a_run_killed_after_a_checkpoint_resumes_to_bit_identical_weights(tmp_path, uninterrupted):
    assert run_child(tmp_path, "--kill-at-step", "14") == -signal.SIGKILL  # after step 12's checkpoint, mid-epoch 2
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["loops"]["global_step"] == 12
    metrics = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    with open(metrics, newline="") as file:
        header, *rows = list(csv.reader(file))
    assert {"epoch", "step"} <= set(header) and all(len(row) == len(header) for row in rows)  # valid after SIGKILL
    resumed = run_resumable.train(tmp_path)  # the same code again: fit(ckpt_path="last")
    assert_same_weights(resumed, uninterrupted)
    assert [path.name for path in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]  # one run, one directory
    with open(metrics, newline="") as file:
        rows = list(csv.DictReader(file))
    steps = [int(row["step"]) for row in rows if row["train/loss"]]
    assert steps == sorted(steps) and steps[-1] == 14  # continued in order, to step 15's row (Lightning's 14)


def test_a_float16_amp_run_killed_after_a_checkpoint_resumes_to_bit_identical_weights(tmp_path):
    # The first steps overflow float16 and are skipped while the scale backs off; a resumed run
    # that started again from the initial scale would skip steps the uninterrupted one took.
    uninterrupted_fp16 = run_resumable.train(tmp_path / "uninterrupted", [run_resumable.fp16_amp()]).state_dict()
    assert run_child(tmp_path / "killed", "--kill-at-step", "14", "--fp16") == -signal.SIGKILL
    resumed = run_resumable.train(tmp_path / "killed", [run_resumable.fp16_amp()])
    assert_same_weights(resumed, uninterrupted_fp16)


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, uninterrupted):
    assert run_child(tmp_path, "--kill-while-saving-step", "12") == -signal.SIGKILL
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["loops"]["global_step"] == 8  # whole
    assert len(list(checkpoints.glob(".*.tmp"))) == 1  # the half-written file never replaced it
    resumed = run_resumable.train(tmp_path)
    assert_same_weights(resumed, uninterrupted)
    assert list(checkpoints.glob(".*.tmp")) == []  # removed by the next write


class Counted(Dataset):
    """64 regression samples that count how often each is read."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(64, 4, generator=generator)
        self.y = self.x @ torch.randn(4, 2, generator=generator)
        self.reads = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index):
        self.reads += 1
        return self.x[index], self.y[index]


class Dropout(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class SaveAtStep(Callback):
    """``trainer.save_checkpoint`` after the batch that makes optimizer step ``step``."""

    def __init__(self, path: Path, step: int, window: int = 1) -> None:
        self.path, self.step, self.window = path, step, window

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and (batch_idx + 1) % self.window == 0:
            trainer.save_checkpoint(self.path)


def fresh_model() -> Dropout:
    seed_everything(0)
    return Dropout()


LOADERS = {
    "own generator": lambda data: DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)),
    "persistent workers": lambda data: DataLoader(data, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True),
}


@pytest.mark.parametrize("loader", LOADERS)
def test_fit_from_a_mid_epoch_checkpoint_continues_exactly(make_trainer, tmp_path, loader):
    path = tmp_path / "step11.ckpt"  # epoch 1, after batch 2: the shuffle has advanced once
    reference = fresh_model()
    make_trainer(max_epochs=3, seed=5, callbacks=[SaveAtStep(path, 11)]).fit(reference, LOADERS[loader](Counted()))
    resumed = fresh_model()
    make_trainer(max_epochs=3, seed=5).fit(resumed, LOADERS[loader](Counted()), ckpt_path=path)
    assert_same_weights(resumed, reference.state_dict())


def test_resuming_skips_the_trained_batches_without_reading_them(make_trainer, tmp_path):
    path = tmp_path / "step3.ckpt"
    make_trainer(max_epochs=1, callbacks=[SaveAtStep(path, 3)]).fit(fresh_model(), DataLoader(Counted(), batch_size=8, shuffle=True))
    data = Counted()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(fresh_model(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=path)
    assert trainer.global_step == 8
    assert data.reads == 64 - 3 * 8  # the first three batches were skipped as indices


class Stream(IterableDataset):
    def __iter__(self):
        data = Counted()
        return iter(zip(data.x, data.y))


def test_an_iterable_dataset_resumes_by_reading_and_dropping_the_trained_batches(make_trainer, tmp_path):
    path = tmp_path / "step3.ckpt"
    make_trainer(max_epochs=1, callbacks=[SaveAtStep(path, 3)]).fit(fresh_model(), DataLoader(Stream(), batch_size=8))
    trainer = make_trainer(max_epochs=1)
    # Lightning 2.6.5's words first: "You're resuming from a checkpoint that ended before the epoch ended and ..."
    with pytest.warns(UserWarning, match=r"^You're resuming from a checkpoint that ended before the epoch ended and your "
                                         r"dataloader is not resumable\. Resuming mid-epoch on a DataLoader without a "
                                         r"batch sampler .* the 3 batches "
                                         r"already trained are fetched and dropped"):
        trainer.fit(fresh_model(), DataLoader(Stream(), batch_size=8), ckpt_path=path)
    assert trainer.global_step == 8


class StatefulStream:
    """An iterable that keeps its place (Lightning's stateful loader protocol: state_dict/load_state_dict)."""

    def __init__(self) -> None:
        self.position, self.loaded = 0, None
        data = Counted()
        self.batches = [(data.x[i:i + 8], data.y[i:i + 8]) for i in range(0, 64, 8)]

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.loaded, self.position = dict(state), state["position"]


def test_a_stateful_iterable_resumes_from_its_own_state_without_refetching(make_trainer, tmp_path, recwarn):
    path = tmp_path / "step3.ckpt"
    make_trainer(max_epochs=1, callbacks=[SaveAtStep(path, 3)]).fit(fresh_model(), StatefulStream())
    data, trainer = StatefulStream(), make_trainer(max_epochs=1)
    trainer.fit(fresh_model(), data, ckpt_path=path)
    # As Lightning 2.6.5: the checkpoint's state is loaded and the iterable goes on from it; no batch is fetched
    # again to be dropped, and no "not resumable" warning.
    assert data.loaded == {"position": 3}
    assert trainer.global_step == 8
    assert not [w for w in recwarn if "not resumable" in str(w.message)]


def test_a_ddp_run_resumes_mid_epoch_exactly_with_each_ranks_rng(tmp_path):
    # Two gloo ranks, each with its own shard of the shuffle and its own dropout masks.
    def fit(callbacks=(), ckpt_path=None) -> Dropout:
        model = fresh_model()
        trainer = Trainer(strategy=DDP(devices=2), max_epochs=2, accumulate_grad_batches=2, seed=3,
                          default_root_dir=tmp_path, enable_progress_bar=False, logger=False,
                          enable_checkpointing=False, callbacks=list(callbacks))
        trainer.fit(model, DataLoader(Counted(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
        return model

    path = tmp_path / "step6.ckpt"  # epoch 1, after batch 3 of 8 on each rank
    reference = fit([SaveAtStep(path, 6, window=2)])
    assert len(torch.load(path, weights_only=True)["rng"]) == 2
    assert_same_weights(fit(ckpt_path=path), reference.state_dict())


def test_a_torchrun_job_whose_rank_is_killed_is_restarted_and_resumes_by_itself_to_the_same_weights(tmp_path):
    # The same script on every attempt, without ckpt_path: rank 1 SIGKILLs itself after step 6 on
    # the first attempt (after step 4's checkpoint); torchrun restarts both ranks, which resume.
    elastic = str(SCRIPT.parent / "run_elastic.py")

    def job(root: Path, *options: str) -> list[str]:
        return torchrun("--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{free_port()}", elastic, str(root), *options)

    (restarted, restarted_output), (uninterrupted, _) = run_together(
        [job(tmp_path / "killed", "--kill-rank", "1", "--kill-at-step", "6"), job(tmp_path / "uninterrupted")],
        timeout=240)
    assert (restarted, uninterrupted) == (0, 0), restarted_output
    checkpoint = tmp_path / "killed" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert ("Cadence: torchrun restarted the job (restart 1 of at most 1) and fit got no ckpt_path, so it resumes "
            f"from {checkpoint}.") in restarted_output
    assert f"Cadence: resuming from {checkpoint} at epoch 1, global step 4" in restarted_output
    if "failed on rank 0" in restarted_output:  # rank 0's collective broke before torchrun stopped it (a race)
        assert re.search(r"Rank 1 died: its process \(pid \d+\) is gone, without a Python error \(killed: SIGKILL, "
                         r"the out-of-memory killer\)\. It was last seen in .+, while rank 0 waited in",  # its last report
                         restarted_output) and "fell behind" not in restarted_output
    assert [path.name for path in (tmp_path / "killed" / "lightning_logs").iterdir()] == ["version_0"]  # logs continue
    final, reference = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("killed", "uninterrupted"))
    assert final.keys() == reference.keys() and all(torch.equal(final[key], reference[key]) for key in reference)


class ValidatedDropout(Dropout):
    """Dropout with a validation loader that draws from the global RNG (no Trainer seed): counts its validations."""

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def on_validation_end(self):
        self.validations += 1


def test_a_checkpoint_written_before_its_batchs_validation_replays_that_validation_on_resume(make_trainer, tmp_path):
    # Validation draws from the global RNG as in Lightning (iter() of its loader draws a base seed),
    # so a run resumed from step 4's checkpoint, written before that batch's validation, matches
    # the uninterrupted run only if it validates first, as that run did next.
    def fit(callbacks=(), ckpt_path=None) -> ValidatedDropout:
        seed_everything(0)
        model = ValidatedDropout()
        trainer = make_trainer(max_epochs=2, val_check_interval=4, num_sanity_val_steps=0, callbacks=list(callbacks))
        trainer.fit(model, DataLoader(Counted(), batch_size=8, shuffle=True), DataLoader(Counted(), batch_size=16),
                    ckpt_path=ckpt_path)
        return model

    path = tmp_path / "step4.ckpt"  # epoch 0, after batch 3; the validation at batch 3 runs after it is written
    reference = fit([SaveAtStep(path, 4)])
    assert torch.load(path, weights_only=True)["loops"]["validation_pending"] is True
    resumed = fit(ckpt_path=path)
    assert_same_weights(resumed, reference.state_dict())
    assert (reference.validations, resumed.validations) == (4, 4)  # at batches 3 and 7 of each epoch; step 4's again


class PlateauOnValidation(ValidatedDropout):
    """A "step" ReduceLROnPlateau watching the validation's loss, due where validation runs (every 4 batches)."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return [optimizer], [{"scheduler": plateau, "interval": "step", "frequency": 4, "monitor": "val/loss"}]


class SaveAtValidationEnd(Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_validation_end(self, trainer, module):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("written_in", ["on_train_batch_end", "on_validation_end"])
def test_a_checkpoint_written_before_its_batchs_step_plateau_stepped_steps_it_on_resume(make_trainer, tmp_path,
                                                                                        written_in):
    # As Lightning, the "step" ReduceLROnPlateau steps after the batch's validation (it watches val/loss), so a
    # checkpoint written in that batch's end holds it before its step: the resumed run steps it first, as the run
    # that wrote it did next (Lightning's own resume skips that step).
    def fit(callbacks=(), ckpt_path=None) -> tuple[PlateauOnValidation, Trainer]:
        seed_everything(0)
        model = PlateauOnValidation()
        trainer = make_trainer(max_epochs=2, val_check_interval=4, num_sanity_val_steps=0, callbacks=list(callbacks))
        trainer.fit(model, DataLoader(Counted(), batch_size=8, shuffle=True), DataLoader(Counted(), batch_size=16),
                    ckpt_path=ckpt_path)
        return model, trainer

    path = tmp_path / "step12.ckpt"  # epoch 1, after batch 3: the plateau has stepped twice, the third is due
    save = SaveAtStep(path, 12) if written_in == "on_train_batch_end" else SaveAtValidationEnd(path, 12)
    reference, reference_trainer = fit([save])
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["loops"]["plateau_pending"] is True and checkpoint["lr_schedulers"][0]["last_epoch"] == 2
    resumed, resumed_trainer = fit(ckpt_path=path)
    assert_same_weights(resumed, reference.state_dict())
    schedulers = [trainer.lr_scheduler_configs[0].scheduler.state_dict() for trainer in (reference_trainer, resumed_trainer)]
    assert schedulers[0] == schedulers[1] and schedulers[0]["last_epoch"] == 4


@pytest.mark.parametrize("samples, batch_size, drop_last", [(64, 4, False), (10, 4, False), (10, 3, True)])
def test_the_rest_of_an_epoch_one_process_began_is_dealt_out_to_two_each_sample_once(samples, batch_size, drop_last):
    # What torchrun --nnodes=1:2 resuming a one-process checkpoint on two gets: DistributedSampler's
    # order of the epoch is the same for any number of processes, so the first k batches of one
    # process are its first k * batch_size samples, and the two ranks share the rest.
    from torch.utils.data import BatchSampler
    from torch.utils.data.distributed import DistributedSampler

    from strategies.loaders import remaining_batches

    def batch_sampler(rank: int, world_size: int) -> BatchSampler:
        sampler = DistributedSampler(range(samples), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(5)
        return BatchSampler(sampler, batch_size, drop_last)

    one = list(batch_sampler(0, 1))
    done = 1
    trained = [index for batch in one[:done] for index in batch]
    rest = [remaining_batches(batch_sampler(rank, 2), done * batch_size) for rank in (0, 1)]
    assert len(rest[0]) == len(rest[1])  # every rank takes as many steps
    dealt = [index for batches in rest for batch in batches for index in batch]
    if drop_last:  # whole batches only: what does not fill one is left, as drop_last leaves it
        assert not set(dealt) & set(trained) and len(set(dealt)) == len(dealt)
        assert all(len(batch) == batch_size for batches in rest for batch in batches)
    else:  # every sample once; a rank short of one takes a repeat, as DistributedSampler pads
        assert set(trained) | set(dealt) == set(range(samples)) and not set(dealt) & set(trained)
        assert len(dealt) - len(set(dealt)) == (samples - len(trained)) % 2
