"""The end-of-fit performance report: measured shares, and recommendations drawn from them."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import PerformanceReport
from callbacks.performance import RunFacts, recommendations
from trainer import TrainingModule


class Net(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowDataset(Dataset):
    """Each sample takes 5 ms to read, as a decoding dataset might."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index):
        time.sleep(0.005)
        return torch.ones(8) * index, torch.ones(1)


def fast_loader(batches: int = 8) -> DataLoader:
    x = torch.randn(batches * 4, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


class Prebatched(Dataset):
    """Batches made once, in memory: reading one is a list lookup, the fastest a loader gets."""

    def __init__(self, batches: int) -> None:
        x = torch.randn(batches * 4, 8, generator=torch.Generator().manual_seed(0))
        self.batches = list(zip(x.split(4), x[:, :1].split(4)))

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def test_a_slow_dataset_gets_the_num_workers_recommendation_with_its_measured_share(make_trainer, capsys):
    report = PerformanceReport()
    make_trainer(max_epochs=1, callbacks=[report]).fit(Net(), DataLoader(SlowDataset(), batch_size=4))
    facts = report.facts
    assert facts.batches == 8 and facts.optimizer_steps == 8 and facts.samples_per_batch == 4
    assert facts.data_wait >= 8 * 4 * 0.005 and facts.data_wait_share > 0.5  # at least the sleeps
    share = f"{facts.data_wait_share:.1%}"
    assert f"waited for the next batch {share} of the time" in report.text
    assert "raise the DataLoader's num_workers (now 0) to" in report.text
    assert report.text in capsys.readouterr().err


def test_a_fast_in_memory_dataset_gets_no_data_recommendation(make_trainer):
    class Wider(Net):  # a step that computes something (~1 ms), as a real model's does
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))

    report = PerformanceReport()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a loaded 2-core machine make every matmul wait for a core
    try:  # many batches: a stall of the shared machine does not look like a slow loader
        make_trainer(max_epochs=2, callbacks=[report]).fit(Wider(), DataLoader(Prebatched(60), batch_size=None))
    finally:
        torch.set_num_threads(threads)
    assert report.facts.batches == 120 and report.facts.epochs == 2
    assert "waiting for the next batch" in report.text and "num_workers" not in report.text
    assert report.facts.data_wait_share < 0.2
    assert report.facts.data_wait + report.facts.training_steps <= report.facts.seconds


def test_the_report_is_saved_in_the_run_directory_and_report_false_turns_it_off(make_trainer, capsys):
    trainer = make_trainer(max_epochs=1, report=True, logger=True)
    trainer.fit(Net(), fast_loader())
    report = next(callback for callback in trainer.callbacks if isinstance(callback, PerformanceReport))
    assert (trainer.log_dir / "performance_report.txt").read_text() == report.text + "\n"
    assert "Performance report (fit): 8 training batches (8 optimizer steps)" in capsys.readouterr().err
    quiet = make_trainer(max_epochs=1, report=False)
    quiet.fit(Net(), fast_loader())
    assert "Performance report" not in capsys.readouterr().err
    assert not any(isinstance(callback, PerformanceReport) for callback in quiet.callbacks)


def test_on_a_gpu_the_report_recommends_pinned_memory_mixed_precision_and_compile():
    facts = RunFacts(seconds=10.0, data_wait=0.5, training_steps=8.0, validation=0.5, checkpointing=0.1, logging=0.1,
                     batches=1000, optimizer_steps=1000, epochs=1, device_type="cuda", device_capability=(8, 0),
                     num_workers=4, pin_memory=False, persistent_workers=True, cpus_per_process=8)
    advice = "\n".join(recommendations(facts))
    assert "pin_memory=True" in advice and 'callbacks.AMP("bf16")' in advice
    assert "callbacks.Compile(): a training step takes 8.0 ms" in advice
    assert "num_workers" not in advice  # 5.9% waiting: not worth more workers
    older = RunFacts(**{**facts.__dict__, "device_capability": (7, 5), "autocast": True, "compiled": True,
                        "pin_memory": True})
    assert recommendations(older) == []


def test_phases_that_take_a_large_share_of_the_fit_are_named():
    facts = RunFacts(seconds=10.0, data_wait=0.2, training_steps=3.0, validation=4.0, checkpointing=1.5, logging=0.8,
                     batches=100, optimizer_steps=100, epochs=4, num_workers=2, persistent_workers=False,
                     log_every_n_steps=1)
    advice = recommendations(facts)
    assert [line.split(":")[0] for line in advice] == [
        "Log steps took 8.0% of the fit", "Validation took 40.0% of the fit", "Writing checkpoints took 15.0% of the fit"]
    assert "raise Trainer(log_every_n_steps=1)" in advice[0]


def test_a_resumed_fit_reports_only_the_batches_it_trained(make_trainer, tmp_path):
    make_trainer(max_epochs=1, enable_checkpointing=True).fit(Net(), fast_loader())
    report = PerformanceReport()
    make_trainer(max_epochs=3, enable_checkpointing=True, callbacks=[report]).fit(Net(), fast_loader(), ckpt_path="last")
    assert (report.facts.batches, report.facts.optimizer_steps, report.facts.epochs) == (16, 16, 2)
