"""DDP against FSDP through ``Trainer.fit``: steps per second and what each rank holds.

Run from the repository root::

    python benchmarks/fsdp_bench.py                      # 2 gloo processes on the CPU
    python benchmarks/fsdp_bench.py --repeats 3 --steps 30
    python benchmarks/fsdp_bench.py --device cuda        # one process per visible GPU, NCCL

The model is an MLP of DEPTH Linear(WIDTH, WIDTH) layers (8 x 1024: 8.4 M parameters, 33.6 MB in
float32) trained with AdamW (two states per parameter), so DDP keeps parameters + gradients +
optimizer states = 4 x 33.6 MB on every rank, and FSDP (``auto_wrap=nn.Linear``: each layer a
block, gathered only while it computes) keeps 1/N of each on each of N ranks: the DDP copy is N
times the FSDP shard. Per rank the script reports those bytes, counted over the tensors each rank
holds (``to_local()`` for FSDP's shards), and the process's resident memory when training starts
and at its peak (which also hold torch itself, activations, the communication buffers, and under
FSDP one gathered layer at a time); on CUDA, the peak of ``torch.cuda.max_memory_allocated``.

Steps per second are timed on rank zero from the end of the warm-up batches to the end of the
last one; runs alternate DDP, FSDP, DDP, ... so both meet the machine in the same state, and the
medians are reported.
"""

from __future__ import annotations

import argparse
import json
import resource
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

from callbacks import Callback  # noqa: E402
from strategies import DDP, FSDP  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

WIDTH, DEPTH, BATCH_SIZE = 1024, 8, 64


class Network(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _resident_bytes() -> int:
    """This process's resident memory now (Linux), 0 where /proc is missing."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        if tensor is not None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += local.numel() * local.element_size()
    return total


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Measure(Callback):
    """Times the steps after the warm-up on rank zero; counts each rank's bytes; writes the result."""

    def __init__(self, warmup: int, result_path: str) -> None:
        self.warmup, self.result_path = warmup, result_path
        self.held: dict[str, int] = {}
        self.started = self.cpu_started = 0.0

    def on_train_start(self, trainer, module):
        self.held["resident_at_start"] = _resident_bytes()  # after sharding and configure_optimizers

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if "parameters" not in self.held:
            self.held.update(parameters=_local_bytes(module.parameters()),
                             gradients=_local_bytes(p.grad for p in module.parameters()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            states = trainer.optimizers[0].state.values()
            self.held["optimizer"] = _local_bytes(v for state in states for v in state.values() if torch.is_tensor(v))
        if batch_idx + 1 == self.warmup:
            _synchronize(trainer.strategy.device)
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, module):
        device = trainer.strategy.device  # the run's device: a --device cpu run on a GPU machine opens no CUDA context
        _synchronize(device)
        seconds, cpu_seconds = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        steps = trainer.global_step - self.warmup
        peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        ranks = trainer.strategy.all_gather_object({**self.held, "peak": peak})
        if trainer.is_global_zero:
            Path(self.result_path).write_text(json.dumps({
                "steps_per_s": steps / seconds, "cpu_ms_per_step": 1000 * cpu_seconds / steps, "ranks": ranks}))


def run(kind: str, devices: int, backend: str, steps: int, warmup: int, directory: str) -> dict:
    result_path = str(Path(directory) / f"{kind}.json")
    strategy = (DDP(devices=devices, backend=backend) if kind == "ddp"
                else FSDP(devices=devices, backend=backend, auto_wrap=nn.Linear))
    generator = torch.Generator().manual_seed(0)
    count = steps * BATCH_SIZE * devices
    data = TensorDataset(torch.randn(count, WIDTH, generator=generator), torch.randint(0, WIDTH, (count,), generator=generator))
    trainer = Trainer(strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=directory, callbacks=[Measure(warmup, result_path)])
    trainer.fit(Network(), DataLoader(data, batch_size=BATCH_SIZE))
    return json.loads(Path(result_path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--devices", type=int, default=None, help="processes (default: 2 on the CPU, every GPU on CUDA)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write every run's figures here")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    devices = args.devices or (torch.cuda.device_count() if args.device == "cuda" else 2)
    runs: dict[str, list[dict]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory(prefix="cadence-fsdp-bench-") as directory:
        for _ in range(args.repeats):
            for kind in runs:
                runs[kind].append(run(kind, devices, backend, args.steps, args.warmup, directory))
    whole = sum(p.numel() * p.element_size() for p in Network().parameters())
    print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}), {whole / 2**20:.1f} MiB of float32 parameters, AdamW, batch {BATCH_SIZE} "
          f"per rank, {devices} processes ({backend}), {args.steps - args.warmup} timed steps, {args.repeats} runs each:")
    peak_name = "peak CUDA memory" if args.device == "cuda" else "peak RSS"
    for kind, results in runs.items():
        rank0 = results[0]["ranks"][0]
        held = rank0["parameters"] + rank0["gradients"] + rank0["optimizer"]
        print(f"  {kind:4}  {statistics.median(r['steps_per_s'] for r in results):6.2f} steps/s "
              f"(runs {', '.join(format(r['steps_per_s'], '.2f') for r in results)}), "
              f"{statistics.median(r['cpu_ms_per_step'] for r in results):6.0f} ms CPU/step on rank 0; per rank: "
              f"parameters {rank0['parameters'] / 2**20:.1f} + gradients {rank0['gradients'] / 2**20:.1f} + optimizer "
              f"{rank0['optimizer'] / 2**20:.1f} = {held / 2**20:.1f} MiB, {peak_name} "
              f"{max(r['peak'] for res in results for r in res['ranks']) / 2**20:.0f} MiB"
              + ("" if args.device == "cuda" else
                 f" (resident when training starts: {rank0['resident_at_start'] / 2**20:.0f} MiB)"))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
