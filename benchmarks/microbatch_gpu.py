"""AutoMicrobatch on a real GPU: a batch that does not fit in a capped memory trains as microbatches.

Run from the repository root on a machine with an NVIDIA GPU (also a part of ``gpu_check.py``)::

    python benchmarks/microbatch_gpu.py

What it does: trains an MLP once with no cap (the reference), measuring the peak memory of a step;
then caps this process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``) between the
peak of a quarter batch and that of a whole one, and trains the same run again with
``callbacks.AutoMicrobatch()``. The capped run must finish: the real ``torch.OutOfMemoryError`` of
the first step is caught, the batch redone as microbatches, and the weights must equal the
reference's up to rounding. It prints one line (and returns the figures as a dict): the
microbatches chosen, step times and peak memory of both runs, the largest weight difference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from callbacks import AutoMicrobatch, Callback  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402


class WideMLP(TrainingModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.GELU())])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class StepClock(Callback):
    """Synchronized wall time of the training steps after the first (which may split)."""

    def __init__(self) -> None:
        self.started, self.steps = 0.0, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            torch.cuda.synchronize()
            self.started = time.perf_counter()

    def on_train_end(self, trainer, module):
        torch.cuda.synchronize()
        self.steps = trainer.global_step - 1

    def step_ms(self) -> float:
        return 1000 * (time.perf_counter() - self.started) / max(1, self.steps)


def train(root: Path, data: TensorDataset, batch: int, width: int, depth: int, callbacks: list) -> tuple[WideMLP, float, float]:
    module, clock = WideMLP(width, depth), StepClock()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(strategy="cuda", max_epochs=1, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, report=False, num_sanity_val_steps=0,
                      callbacks=[*callbacks, clock])
    trainer.fit(module, DataLoader(data, batch_size=batch))
    return module, clock.step_ms(), torch.cuda.max_memory_allocated() / 2**20


def check(out: Path, width: int = 4096, depth: int = 8, batch: int = 8192, steps: int = 6) -> dict:
    """The reference run, then the capped run with AutoMicrobatch; ``status`` passed when the capped
    run split, finished, and ended with the reference's weights up to rounding."""
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(batch * steps, width, generator=generator),
                         torch.randn(batch * steps, width, generator=generator))
    reference, reference_ms, reference_peak = train(out / "reference", data, batch, width, depth, [])
    expected = [p.detach().cpu() for p in reference.parameters()]
    del reference
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() / 2**20  # the data set and the expected weights stay on the CPU
    weights = 2 * sum(p.numel() * 4 for p in expected) / 2**20  # parameters and their gradients
    cap = weights + (reference_peak - weights) * 0.4  # below a half batch's activations, above a quarter's
    total = torch.cuda.get_device_properties(0).total_memory / 2**20
    torch.cuda.set_per_process_memory_fraction(min(1.0, (cap + held) / total))
    splitter = AutoMicrobatch()
    try:
        capped, capped_ms, capped_peak = train(out / "capped", data, batch, width, depth, [splitter])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    difference = max(float((p.detach().cpu() - q).abs().max()) for p, q in zip(capped.parameters(), expected))
    passed = splitter.microbatches > 1 and difference < 1e-4
    summary = (f"{batch} x {width} batches, {depth} layers: whole batch {reference_ms:.1f} ms/step, peak "
               f"{reference_peak:.0f} MiB; capped at {cap:.0f} MiB: {splitter.microbatches} microbatches, "
               f"{capped_ms:.1f} ms/step, peak {capped_peak:.0f} MiB; weights differ by at most {difference:.2e}")
    return {"status": "passed" if passed else "failed", "summary": summary, "microbatches": splitter.microbatches,
            "reference_ms": reference_ms, "capped_ms": capped_ms, "reference_peak_mib": reference_peak,
            "capped_peak_mib": capped_peak, "cap_mib": cap, "max_weight_difference": difference}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("microbatch_gpu: skipped: no GPU")
        sys.exit(0)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        result = check(Path(directory))
    print(f"microbatch_gpu: {result['status']}: {result['summary']}")
    sys.exit(0 if result["status"] == "passed" else 1)
