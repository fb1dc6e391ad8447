"""The end-of-fit performance report: measured shares, and recommendations drawn from them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import AMP, Callback, PerformanceReport
from callbacks.advice import RunFacts, format_report, recommendations
from strategies import FSDP, SingleDevice
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
    # The wait is sleeping, not CPU work: the workers follow from it, not from this machine's cores.
    assert "raise the DataLoader's num_workers (now 0) to 8 so that batches are prepared" in report.text
    assert "Expected: about" in report.text and facts.wait_cpu_share < 0.5
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
    assert (Path(trainer.log_dir) / "performance_report.txt").read_text() == report.text + "\n"
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


def facts_of(**figures) -> RunFacts:
    """1000 batches on the CPU of a 2-core machine, torch on 2 threads, with ``figures`` changed."""
    defaults = dict(seconds=10.0, data_wait=0.0, training_steps=1.0, validation=0.0, checkpointing=0.0, logging=0.0,
                    batches=1000, optimizer_steps=1000, epochs=1, num_workers=0, cpus_per_process=2, torch_threads=2)
    return RunFacts(**{**defaults, **figures})


def test_an_in_memory_dataset_is_not_told_to_add_a_worker_that_would_cost_as_much_as_it_saves():
    # 0.6 ms a batch of indexing and collating, on the loop's thread (it computed all the while).
    facts = facts_of(data_wait=0.6, training_steps=0.5, loop_thread_cpu=1.1, loop_thread_wall=1.1)
    (advice,) = recommendations(facts)
    assert advice.startswith("The loop waited for the next batch 54.5% of the time (0.6 ms a batch), about what handing "
                             "a batch over from a DataLoader worker process costs, so workers would not help")
    assert "num_workers" not in advice


def test_workers_follow_from_the_measured_wait_with_the_expected_gain():
    # 8 ms a batch of waiting on a disk (the loop's thread computed only during the 1 ms steps).
    waits = facts_of(data_wait=8.0, training_steps=1.0, loop_thread_cpu=1.0, loop_thread_wall=9.0)
    assert recommendations(waits) == [
        "The loop waited for the next batch 88.9% of the time (8.0 ms a batch): raise the DataLoader's num_workers "
        "(now 0) to 8 so that batches are prepared while the model trains (8 prepare a batch per training step; if "
        "__getitem__ mostly waits (disk, network), workers beyond this process's 2 core(s) still help, if it computes, "
        "more than 1 compete with the step for cores). Expected: about 4.5x the training batches per second (111 -> 500)."]
    # The same wait spent computing, on a GPU machine with 8 cores: the cores the step leaves cap the workers.
    computes = facts_of(data_wait=8.0, training_steps=1.0, loop_thread_cpu=9.0, loop_thread_wall=9.0,
                        device_type="cuda", cpus_per_process=8, pin_memory=True, autocast=True, compiled=True)
    assert "to 7 so that batches are prepared while the model trains (preparing a batch was CPU work, so 7 is what " \
           "this process's 8 core(s) leave beside the training step). Expected: about 4.5x" in recommendations(computes)[0]
    # ... and on the CPU, where the step's threads take every core, no worker would be free.
    (crowded,) = recommendations(facts_of(data_wait=8.0, training_steps=1.0, loop_thread_cpu=9.0, loop_thread_wall=9.0))
    assert "workers would take cores from the step" in crowded


def test_an_oversubscribed_cpu_is_said_first():
    threads = recommendations(facts_of(torch_threads=8, validation=4.0))
    assert threads[0].startswith("The CPU is oversubscribed: torch runs 8 threads in each of 1 process(es), and each "
                                 "process has 2 core(s)") and "torch.set_num_threads(2)" in threads[0]
    assert threads[1].startswith("Validation took")
    (loaded,) = recommendations(facts_of(load_average=9.5))
    assert loaded.startswith("The CPU is oversubscribed: the machine's load average was 9.5 on the 2 core(s) this run "
                             "may use, about 7.5 of it from other processes")
    assert recommendations(facts_of(load_average=2.4)) == []  # this run's own two threads, and a little
    assert recommendations(facts_of(load_average=6.2, num_workers=4)) == []  # its DataLoader workers are its own


def test_a_fit_with_more_torch_threads_than_cores_is_told_so(make_trainer):
    report = PerformanceReport()
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) + 2)
    try:
        make_trainer(max_epochs=1, callbacks=[report]).fit(Net(), fast_loader())
    finally:
        torch.set_num_threads(threads)
    assert f"The CPU is oversubscribed: torch runs {len(os.sched_getaffinity(0)) + 2} threads" in report.text


def test_one_time_compilation_is_kept_apart_from_the_steady_state():
    # Compiling the evaluation graph took 3.5 s of the 4 s of validation in a 10 s fit.
    facts = facts_of(seconds=10.0, training_steps=5.0, validation=4.0, compiled=True, compile_training=1.0,
                     compile_validation=3.5)
    assert recommendations(facts) == []  # 0.5 s of validation in 5.5 s of steady fit: 9%
    text = format_report(facts)
    assert "one-time compiling (torch.compile): 1.00 s in training, 3.50 s in validation" in text
    assert "validation 0.50 s (9.1% of the fit)" in text and "training: 250.0 batches/s" in text


class HalfPrecisionStrategy(SingleDevice):
    """A strategy that computes in bfloat16 by itself, as FSDP's mixed-precision policy does."""

    def compute_dtype(self):
        return torch.bfloat16


def test_the_report_asks_the_callbacks_and_the_strategy_what_is_on(make_trainer):
    amp, by_strategy = PerformanceReport(), PerformanceReport()
    make_trainer(max_epochs=1, callbacks=[AMP("bf16"), amp]).fit(Net(), fast_loader())
    make_trainer(max_epochs=1, strategy=HalfPrecisionStrategy("cpu"), callbacks=[by_strategy]).fit(Net(), fast_loader())
    assert amp.facts.autocast and by_strategy.facts.autocast and not amp.facts.compiled
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert FSDP(devices=2, backend="gloo", mixed_precision=policy).compute_dtype() == torch.bfloat16
    assert FSDP(devices=2, backend="gloo").compute_dtype() is None


def test_a_resumed_fit_stopped_by_sigterm_counts_the_batches_it_ran(make_trainer, tmp_path):
    class SigtermAt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    make_trainer(max_epochs=1, enable_checkpointing=True).fit(Net(), fast_loader())
    report = PerformanceReport()
    trainer = make_trainer(max_epochs=3, enable_checkpointing=True, callbacks=[SigtermAt(), report])
    with pytest.raises(SystemExit):
        trainer.fit(Net(), fast_loader(), ckpt_path="last")
    assert (report.facts.batches, report.facts.optimizer_steps) == (5, 5)
    assert "Performance report (fit): 5 training batches (5 optimizer steps)" in report.text
