"""The Profiler callback: bounded Chrome traces per scheduled window, a table and a verdict; and
what Trainer(profiler=..., report=...) turns into."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import PerformanceReport, ProfiledHooks, Profiler
from trainer import Trainer, TrainingModule


class Net(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(batches: int) -> DataLoader:
    x = torch.randn(batches * 4, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


def read_trace(path) -> list[dict]:
    with gzip.open(path, "rt") as file:
        return json.load(file)["traceEvents"]


def test_each_window_becomes_one_gzipped_chrome_trace_of_the_models_operators(make_trainer, capsys):
    profiler = Profiler(wait=1, warmup=1, active=2, repeat=2, profile_memory=False)
    trainer = make_trainer(max_epochs=1, callbacks=[profiler])
    trainer.fit(Net(), loader(12))  # 12 batches, a schedule of 8: only the scheduled windows are kept
    directory = Path(trainer.log_dir) / "profiler"
    assert sorted(path.name for path in directory.iterdir()) == [
        "rank0-window0.pt.trace.json.gz", "rank0-window0.txt", "rank0-window1.pt.trace.json.gz", "rank0-window1.txt"]
    for window in range(2):
        events = read_trace(directory / f"rank0-window{window}.pt.trace.json.gz")
        names = {event.get("name", "") for event in events}
        assert {"aten::addmm", "aten::relu", "aten::mse_loss"} <= names
        assert len([name for name in names if name.startswith("ProfilerStep#")]) == 2  # the window's length
        summary = (directory / f"rank0-window{window}.txt").read_text()
        assert "aten::addmm" in summary and "Verdict: top operators by self CPU time:" in summary
        assert "waiting for data" in summary and "optimizer step and zero_grad" in summary
    assert capsys.readouterr().err.count("Profiler, rank 0, window") == 2
    assert profiler.trace_paths == [directory / "rank0-window0.pt.trace.json.gz", directory / "rank0-window1.pt.trace.json.gz"]


def test_a_fit_that_ends_inside_the_window_keeps_what_it_traced(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=1, callbacks=[Profiler(dirpath=tmp_path / "traces", wait=0, warmup=1, active=3)])
    trainer.fit(Net(), loader(3))  # warmup 1, then 2 of the 3 active batches
    names = {event.get("name") for event in read_trace(tmp_path / "traces" / "rank0-window0.pt.trace.json.gz")}
    assert {"ProfilerStep#1", "ProfilerStep#2", "aten::addmm"} <= names and "ProfilerStep#0" not in names
    assert "window 0 (training batches 1-2 of this fit)" in (tmp_path / "traces" / "rank0-window0.txt").read_text()


def test_the_trainers_profiler_argument_maps_onto_the_callbacks():
    kinds = lambda trainer: [type(callback) for callback in trainer.callbacks]  # noqa: E731
    quiet = {"strategy": "cpu", "logger": False, "enable_progress_bar": False, "enable_checkpointing": False,
             "enable_model_summary": False}
    assert kinds(Trainer(profiler=None, **quiet)) == [PerformanceReport]
    assert kinds(Trainer(profiler="simple", report=False, **quiet)) == [ProfiledHooks]  # Lightning's SimpleProfiler
    mine = Profiler(active=1)
    assert Trainer(profiler=mine, report=False, **quiet).callbacks == [mine]
    with pytest.raises(ValueError, match=r"Trainer\(profiler=<callbacks.profiler.Profiler .*\) and a Profiler in callbacks: pass one of them"):
        Trainer(profiler=mine, callbacks=[Profiler()], **quiet)
    with pytest.raises(ValueError, match=r"Trainer\(report='yes'\): use True"):
        Trainer(report="yes", **quiet)


def test_bad_profiler_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"Profiler\(repeat=0\): use an int >= 1 \(0 would trace every batch"):
        Profiler(repeat=0)
    with pytest.raises(ValueError, match=r"Profiler\(active=0\): use an int >= 1"):
        Profiler(active=0)
    with pytest.raises(ValueError, match=r"Profiler\(sort_by='time'\): use one of self_cpu_time_total"):
        Profiler(sort_by="time")


def cuda_window_events():
    """Two 1 ms batches as torch.profiler records them on a GPU: each ``ProfilerStep`` and data span
    on the host and again as a device-side annotation, kernels on two streams that overlap, a copy."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, start, end, device=False, activity=None):
        kind = DeviceType.CUDA if device else DeviceType.CPU
        return FunctionEvent(id=0, name=name, thread=1, start_us=start, end_us=end, device_type=kind, stack=[], input_shapes=[],
                             is_user_annotation=activity in ("user_annotation", "gpu_user_annotation"),
                             activity_type=activity or ("kernel" if device else "cpu_op"), use_device="cuda")

    return [
        event("ProfilerStep*", 0, 1000, activity="user_annotation"),
        event("ProfilerStep*", 1000, 2000, activity="user_annotation"),
        event("ProfilerStep*", 100, 1100, device=True, activity="gpu_user_annotation"),
        event("ProfilerStep*", 1100, 2100, device=True, activity="gpu_user_annotation"),
        event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 200, activity="user_annotation"),
        event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1000, 1200, activity="user_annotation"),
        event("aten::mm", 250, 900),
        event("ampere_sgemm_128x64_nn", 300, 700, device=True),  # stream 7
        event("ampere_sgemm_128x64_nn", 500, 900, device=True),  # stream 13, overlapping
        event("Memcpy HtoD (Pinned -> Device)", 1000, 1300, device=True, activity="gpu_memcpy"),
        event("vectorized_elementwise_kernel", 1300, 1500, device=True),
    ]


def test_on_a_gpu_the_verdict_counts_each_batch_once_and_device_time_without_annotations_or_overlap():
    from torch.autograd.profiler_util import EventList

    from callbacks.profiler import verdict

    events = EventList(cuda_window_events(), use_device="cuda")
    events._build_tree()  # what profile.events() has done before it returns them
    text = verdict(events, events.key_averages(), "self_device_time_total", "cuda")
    # Kernels cover 300-900 and 1300-1500: 800 us of the window's 2000 (the host's steps; annotations left out).
    assert "Of the 2 profiled batches (1.00 ms each on the host): waiting for data 20%" in text
    assert "The cuda device ran kernels 40% of the profiled time (idle 60%; copying memory 15%" in text
    assert "the host does not keep it fed" in text
