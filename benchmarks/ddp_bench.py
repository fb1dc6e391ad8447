"""Two-process DDP (gloo, CPU): ``Trainer.fit`` against a hand-written mp.spawn + DDP loop.

Run from the repository root::

    python benchmarks/ddp_bench.py                 # 1024-wide 4-layer MLP, batch 256 per rank
    python benchmarks/ddp_bench.py --steps 40 --repeats 5

Both contenders train the same model on the same data in 2 spawned processes with 1 thread each,
DistributedDataParallel with gradients as bucket views (Cadence's default), SGD, a
DistributedSampler, and no worker processes. Each run is timed on rank zero from the end of the
warm-up batches to the end of the last batch, so process start-up, imports and the end of the run
are outside the timed interval. Runs alternate (hand, fit, hand, fit, ...) so that both meet the
machine in the same state; the ratio is taken per adjacent pair and its median reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from strategies import DDP  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

WIDTH, DEPTH, BATCH_SIZE, WORLD_SIZE = 1024, 4, 256, 2


def make_network() -> nn.Sequential:
    layers: list[nn.Module] = []
    for index in range(DEPTH):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if index < DEPTH - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    count = steps * BATCH_SIZE * WORLD_SIZE
    return TensorDataset(torch.randn(count, WIDTH, generator=generator),
                         torch.randint(0, WIDTH, (count,), generator=generator))


# --- the hand-written loop -------------------------------------------------------------------------
def hand_worker(rank: int, port: int, steps: int, warmup: int, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_network(), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = make_data(steps)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=DistributedSampler(data, WORLD_SIZE, rank))
    started = cpu_started = 0.0
    for batch_idx, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if batch_idx + 1 == warmup:
            started, cpu_started = time.perf_counter(), time.process_time()
    if rank == 0:
        write_result(result_path, steps - warmup, time.perf_counter() - started, time.process_time() - cpu_started)
    dist.destroy_process_group()


def write_result(path: str, steps: int, seconds: float, cpu_seconds: float) -> None:
    Path(path).write_text(json.dumps({"steps_per_s": steps / seconds, "cpu_ms_per_step": 1000 * cpu_seconds / steps}))


def run_hand(steps: int, warmup: int, result_path: str) -> dict:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(hand_worker, args=(port, steps, warmup, result_path), nprocs=WORLD_SIZE)
    return json.loads(Path(result_path).read_text())


# --- the same through Trainer.fit ------------------------------------------------------------------
class Classifier(TrainingModule):
    def __init__(self, steps: int, warmup: int, result_path: str) -> None:
        super().__init__()
        self.steps, self.warmup, self.result_path = steps, warmup, result_path
        torch.manual_seed(0)
        self.network = make_network()
        self.started = self.cpu_started = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.network(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx + 1 == self.warmup:
            self.started, self.cpu_started = time.perf_counter(), time.process_time()
        elif batch_idx + 1 == self.steps and self.trainer.is_global_zero:
            write_result(self.result_path, self.steps - self.warmup, time.perf_counter() - self.started,
                         time.process_time() - self.cpu_started)


def run_fit(steps: int, warmup: int, result_path: str) -> dict:
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE), max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=Path(result_path).parent)
    data = make_data(steps)
    trainer.fit(Classifier(steps, warmup, result_path), DataLoader(data, batch_size=BATCH_SIZE, shuffle=True))
    return json.loads(Path(result_path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="batches per rank in each run")
    parser.add_argument("--warmup", type=int, default=10, help="batches before the timed interval")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (hand, fit)")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" in os.environ:
        del os.environ["OMP_NUM_THREADS"]  # both contenders use 1 thread per process
    hand, fit = [], []
    with tempfile.TemporaryDirectory() as directory:
        for repeat in range(args.repeats):
            hand.append(run_hand(args.steps, args.warmup, f"{directory}/hand{repeat}.json"))
            fit.append(run_fit(args.steps, args.warmup, f"{directory}/fit{repeat}.json"))
            print(f"repeat {repeat + 1}: hand {hand[-1]['steps_per_s']:.2f} steps/s, "
                  f"fit {fit[-1]['steps_per_s']:.2f} steps/s", file=sys.stderr)
    print(f"## DDP, 2 gloo processes x 1 thread: {DEPTH}-layer MLP width {WIDTH}, batch {BATCH_SIZE} per rank, "
          f"{args.steps - args.warmup} timed steps after {args.warmup}; {args.repeats} repeats, torch {torch.__version__}")
    print()
    print("| contender | steps/s (median) | range | rank-0 CPU ms/step (median) |")
    print("| --- | --- | --- | --- |")
    for name, runs in (("hand-written mp.spawn + DDP", hand), ("Trainer.fit, strategy=DDP(devices=2)", fit)):
        rates = [run["steps_per_s"] for run in runs]
        cpu = statistics.median(run["cpu_ms_per_step"] for run in runs)
        print(f"| {name} | {statistics.median(rates):.2f} | {min(rates):.2f} - {max(rates):.2f} | {cpu:.1f} |")
    ratios = [f["steps_per_s"] / h["steps_per_s"] for f, h in zip(fit, hand)]
    print()
    print(f"fit / hand steps/s, per adjacent pair: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f} - {max(ratios):.3f})")

if __name__ == "__main__":
    main()
