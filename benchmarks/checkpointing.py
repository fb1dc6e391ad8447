"""What gradient checkpointing saves (activation memory) and costs (step time), on the CPU.

Run from the repository root::

    python benchmarks/checkpointing.py                          # 8 blocks, width 512, batch 64
    python benchmarks/checkpointing.py --blocks 16 --width 1024 --repeats 5

A stack of residual MLP blocks (Linear width->4*width, GELU, Linear 4*width->width) trains through
``Trainer.fit`` with and without ``GradientCheckpointing(modules=Block)``. Memory: the bytes autograd
saves for backward during one training step, counted by a callback whose forward context is
``torch.autograd.graph.saved_tensors_hooks`` (every tensor packed for backward, by its size; on a GPU
this is what ``torch.cuda.max_memory_allocated`` grows by, less allocator rounding). Time: the median
per-step wall time and CPU time of the process (``on_train_batch_start`` to ``on_train_batch_end``)
after a warm-up, the two configurations run alternately ``--repeats`` times. On a shared machine the
CPU time (all threads' work) is the steadier figure: waiting for a core does not count in it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from callbacks import Callback, GradientCheckpointing  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Stack(TrainingModule):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Meter(Callback):
    """Bytes saved for backward per step (forward context) and wall time per step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.saved_bytes: list[int] = []
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self._started = self._cpu_started = 0.0

    def forward_context(self):
        self.saved_bytes.append(0)

        def pack(tensor):
            self.saved_bytes[-1] += tensor.numel() * tensor.element_size()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._started, self._cpu_started = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.step_seconds.append(time.perf_counter() - self._started)
            self.step_cpu_seconds.append(time.process_time() - self._cpu_started)


def run(checkpointing: bool, args: argparse.Namespace) -> Meter:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps * args.batch, args.width, generator=generator)
    loader = DataLoader(TensorDataset(x, x.roll(1, dims=1)), batch_size=args.batch)
    meter = Meter(args.warmup)
    callbacks = [meter, *([GradientCheckpointing(modules=Block)] if checkpointing else [])]
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(max_epochs=1, strategy="cpu", default_root_dir=root, callbacks=callbacks, logger=False,
                          enable_progress_bar=False, enable_checkpointing=False)
        trainer.fit(Stack(args.blocks, args.width), loader)
    return meter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    meters: dict[bool, list[Meter]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for checkpointing in ((False, True) if repeat % 2 == 0 else (True, False)):
            meters[checkpointing].append(run(checkpointing, args))
    parameters = sum(p.numel() * p.element_size() for p in Stack(args.blocks, args.width).parameters())
    print(f"## gradient checkpointing: {args.blocks} blocks, width {args.width} (hidden {4 * args.width}), "
          f"batch {args.batch}, {args.threads} threads, {args.steps - args.warmup} timed steps x {args.repeats} repeats\n")
    print("| | saved for backward per step | CPU ms per step (median; per repeat) | wall ms per step (median; per repeat) |")
    print("| --- | ---: | --- | --- |")
    rows = {}
    for checkpointing, label in ((False, "without"), (True, "GradientCheckpointing(modules=Block)")):
        saved = max(b for meter in meters[checkpointing] for b in meter.saved_bytes)
        cpu = [statistics.median(meter.step_cpu_seconds) * 1e3 for meter in meters[checkpointing]]
        wall = [statistics.median(meter.step_seconds) * 1e3 for meter in meters[checkpointing]]
        rows[checkpointing] = (saved, statistics.median(cpu), statistics.median(wall))
        print(f"| {label} | {saved / 2**20:.2f} MiB | {statistics.median(cpu):.1f}; {', '.join(f'{m:.1f}' for m in cpu)} | "
              f"{statistics.median(wall):.1f}; {', '.join(f'{m:.1f}' for m in wall)} |")
    (plain_bytes, plain_cpu, plain_wall), (gc_bytes, gc_cpu, gc_wall) = rows[False], rows[True]
    print(f"\nSaved activations: {gc_bytes / plain_bytes:.1%} of the plain run's ({(plain_bytes - gc_bytes) / 2**20:.1f} MiB "
          f"less; the parameters are {parameters / 2**20:.1f} MiB). Step time: {gc_cpu / plain_cpu:.2f}x in CPU time, "
          f"{gc_wall / plain_wall:.2f}x in wall time.")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}")


if __name__ == "__main__":
    main()
