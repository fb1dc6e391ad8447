"""The parts of ``benchmarks/gpu_check.py`` that probe one item of issue 19 each, on a CUDA GPU.

Each function takes the part's output directory and returns ``{"status": "passed" | "failed",
"summary": one line, "lines": [details], ...figures}``; ``gpu_check.py`` runs each in a process of
its own under a timeout. They train tiny models: they prove behaviour, not speed.
"""

from __future__ import annotations

import gc
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import AMP, Compile, CSVLogger, PerformanceReport, Profiler
from gpu_check import quiet_trainer
from strategies import FSDP, SingleDevice
from strategies.transfer import pins_batches
from trainer import TrainingModule


class Mlp(TrainingModule):
    """``depth`` Linear(width, width) layers with ReLU between; mean squared error to the targets."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for index in range(depth):
            layers += [nn.Linear(width, width)] + ([nn.ReLU()] if index < depth - 1 else [])
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x).float(), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(batches: int, width: int = 64, batch_size: int = 32, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, width, generator=generator)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=batch_size)


def verdict(ok: bool, summary: str, **figures: Any) -> dict:
    return {"status": "passed" if ok else "failed", "summary": summary, **figures}


# --- item 2 --------------------------------------------------------------------------------------------
class SamplesOnTheGpu(Dataset):
    """Features made on the GPU by the dataset itself, labels on the CPU."""

    def __init__(self, count: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(count, 64, generator=generator).cuda()
        self.labels = torch.tanh(self.features).cpu()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return self.features[index], self.labels[index]


def gpu_dataset(out: Path) -> dict:
    """Item 2: pin_memory=True refuses CUDA tensors; the strategy now pins only the CPU ones."""
    trainer = quiet_trainer(out, max_steps=4, strategy=SingleDevice("cuda"))
    trainer.fit(Mlp(), DataLoader(SamplesOnTheGpu(), batch_size=8))
    pinned = pins_batches(trainer.train_dataloader)
    return verdict(trainer.global_step == 4 and pinned, f"4 steps on batches whose features the dataset made on the GPU "
                                                        f"(the loader pins the CPU labels: {pinned})")


# --- item 10 -------------------------------------------------------------------------------------------
def memory(out: Path) -> dict:
    """Item 10: after fit the module is off the GPU; what else stays there; the peak is per fit."""
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    module = Mlp(width=4096, depth=4)  # 268 MiB of weights, as much in gradients, twice that in AdamW states
    trainer = quiet_trainer(out, max_steps=3, strategy=SingleDevice("cuda"), callbacks=[PerformanceReport()])
    trainer.fit(module, loader(3, width=4096, batch_size=64))
    first_peak = torch.cuda.max_memory_allocated(device)
    after_fit = torch.cuda.memory_allocated(device) - base
    module_device = str(next(module.parameters()).device)
    optimizer_bytes = sum(value.numel() * value.element_size() for optimizer in trainer.optimizers
                          for state in optimizer.state.values() for value in state.values()
                          if torch.is_tensor(value) and value.is_cuda)
    del trainer
    gc.collect()
    after_trainer = torch.cuda.memory_allocated(device) - base
    small = quiet_trainer(out / "small", max_steps=2, strategy=SingleDevice("cuda"), callbacks=[PerformanceReport()])
    small.fit(Mlp(width=64), loader(2))
    second_peak = torch.cuda.max_memory_allocated(device)  # reset by the report when the second fit started
    mib = 2**20
    lines = [f"module after fit: on {module_device}",
             f"allocated on the GPU after fit: {after_fit / mib:.0f} MiB, of it optimizer states {optimizer_bytes / mib:.0f} "
             f"MiB (the Trainer's side of item 10 moves them); after the Trainer is dropped: {after_trainer / mib:.0f} MiB",
             f"peak of the first fit {first_peak / mib:.0f} MiB, of the second (small) fit {second_peak / mib:.0f} MiB"]
    ok = module_device == "cpu" and second_peak < first_peak
    return verdict(ok, "; ".join(lines), lines=lines, after_fit_mib=after_fit / mib, optimizer_mib=optimizer_bytes / mib,
                   after_trainer_mib=after_trainer / mib, first_peak_mib=first_peak / mib, second_peak_mib=second_peak / mib)


# --- item 3 --------------------------------------------------------------------------------------------
def profiler(out: Path) -> dict:
    """Item 3: on a launch-bound model the device idles; each profiled batch is counted once."""
    trainer = quiet_trainer(out, max_epochs=1, strategy=SingleDevice("cuda"),
                            callbacks=[Profiler(dirpath=out / "traces", wait=1, warmup=1, active=3, profile_memory=False)])
    trainer.fit(Mlp(), loader(12))
    text = (out / "traces" / "rank0-window0.txt").read_text()
    batches = re.search(r"Of the (\d+) profiled batches", text)
    busy = re.search(r"ran kernels (\d+)% of the profiled time", text)
    lines = [line for line in text.splitlines() if line.startswith(("Verdict", "Of the", "The cuda"))]
    ok = batches is not None and int(batches.group(1)) == 3 and busy is not None and int(busy.group(1)) < 100
    return verdict(ok, " ".join(lines[1:]) or "no verdict found", lines=lines)


# --- item 7 --------------------------------------------------------------------------------------------
def fsdp_offload(out: Path) -> dict:
    """Item 7: CPU-offloaded gradient shards clipped by their norm (an all-reduce on CPU tensors)."""
    trainer = quiet_trainer(out, max_steps=4, strategy=FSDP(devices=1, cpu_offload=True), gradient_clip_val=0.5)
    trainer.fit(Mlp(), loader(4))
    return verdict(trainer.global_step == 4, f"{trainer.global_step} steps with FSDP(cpu_offload=True), gradient_clip_val=0.5")


# --- item 6 --------------------------------------------------------------------------------------------
def cuda_graphs(out: Path) -> dict:
    """Item 6: Compile(mode="reduce-overhead") through a sanity check and validation, training after
    them, and predict keeping every batch's outputs (compared with the eager model's)."""
    from torch._dynamo.utils import counters

    module, compile_ = Mlp(), Compile(mode="reduce-overhead")
    trainer = quiet_trainer(out, max_epochs=2, strategy=SingleDevice("cuda"), callbacks=[compile_], num_sanity_val_steps=2)
    trainer.fit(module, loader(8), loader(4, seed=1))
    batches = loader(4, seed=2)
    predictions = [prediction.float().cpu() for prediction in trainer.predict(module, batches)]
    with torch.no_grad():  # after the stage: the module is back on the CPU, its forward eager
        expected = [module(x).float() for x, _ in batches]
    difference = max(float((p - e).abs().max()) for p, e in zip(predictions, expected))
    distinct = len({round(float(p.sum()), 3) for p in predictions}) == len(predictions)
    skips = dict(counters["inductor"]) if "inductor" in counters else {}
    lines = [f"replays CUDA graphs: {compile_.replays_cuda_graphs}; trained {trainer.global_step} steps after the sanity "
             f"check and between validations", f"predict: {len(predictions)} batches kept, distinct: {distinct}, largest "
             f"difference from the eager model {difference:.2e}", f"inductor counters: {skips}"]
    ok = compile_.replays_cuda_graphs and trainer.global_step == 16 and distinct and difference < 1e-2
    return verdict(ok, "; ".join(lines[:2]), lines=lines, max_difference=difference)


# --- item 4 --------------------------------------------------------------------------------------------
def report(out: Path) -> dict:
    """Item 4: the report asks what is on: under Compile + AMP it recommends neither; under FSDP's
    bf16 policy, no mixed precision."""
    compiled = PerformanceReport()
    trainer = quiet_trainer(out / "compile", max_epochs=1, strategy=SingleDevice("cuda"),
                            callbacks=[Compile(), AMP("bf16"), compiled])
    trainer.fit(Mlp(), loader(40))
    advice = compiled.text.split("Recommendations:")[-1]
    single_ok = compiled.facts.compiled and compiled.facts.autocast and "callbacks.Compile()" not in advice \
        and "Mixed precision:" not in advice
    sharded = quiet_trainer(out / "fsdp", max_epochs=1, strategy=FSDP(devices=1), precision="bf16-mixed",
                            logger=CSVLogger(), report=True)
    sharded.fit(Mlp(), loader(20))
    saved = Path(sharded.log_dir) / "performance_report.txt"
    fsdp_text = saved.read_text() if saved.exists() else ""
    fsdp_ok = bool(fsdp_text) and "Mixed precision:" not in fsdp_text.split("Recommendations:")[-1]
    lines = ["Compile + AMP:"] + compiled.text.splitlines() + ["FSDP bf16-mixed:"] + (fsdp_text.splitlines() or ["(no report)"])
    return verdict(single_ok and fsdp_ok, f"Compile + AMP: compiled={compiled.facts.compiled}, "
                                          f"compile {compiled.facts.compile_seconds:.1f} s kept apart, advice "
                                          f"{'clean' if single_ok else 'WRONG'}; FSDP bf16: advice "
                                          f"{'clean' if fsdp_ok else 'WRONG or missing'}",
                   lines=lines, compile_seconds=compiled.facts.compile_seconds if compiled.facts else math.nan)
