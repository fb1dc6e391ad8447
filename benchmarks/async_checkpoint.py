"""How long a checkpoint save blocks the training loop, synchronous against ``async_save=True``.

Run from the repository root::

    python benchmarks/async_checkpoint.py                    # ~123M parameters, AdamW, 3 saves each
    python benchmarks/async_checkpoint.py --layers 4 --saves 2   # smaller, quicker
    python benchmarks/async_checkpoint.py --fsdp --layers 2 --every 3 --saves 2   # FSDP, 2 spawned processes

A stack of ``--layers`` ``Linear(3200, 3200)`` (12 layers: 123M parameters; with AdamW's two
moments a checkpoint holds ~1.5 GB) trains through ``Trainer.fit`` on the CPU with a
``ModelCheckpoint(every_n_train_steps=--every)``, saved synchronously and with ``async_save=True``.
Blocked: the wall time ``ModelCheckpoint.on_train_batch_end`` takes (timed by a subclass) at the
steps that save: for a synchronous save the snapshot,
serialization, fsync and rename; for an asynchronous one the host snapshot (plus any wait for the
previous write, which ``--every`` large enough avoids). The end of fit, which waits for the last
background write, is reported too. The aim (issue 18): async blocks for at most a quarter of sync.
With ``--fsdp``: ``FSDP(devices=2)`` on gloo, each rank writing its shards (DCP's ``async_save``
when async); rank zero's times.
"""

from __future__ import annotations

import argparse
import json
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

from callbacks import ModelCheckpoint  # noqa: E402
from strategies import FSDP  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

WIDTH = 3200


class Stack(TrainingModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class TimedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint, timing its ``on_train_batch_end`` (where it saves) at each optimizer step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocked: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        start = time.perf_counter()
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        self.blocked[trainer.global_step] = time.perf_counter() - start

    def on_train_end(self, trainer, module):
        (self.dirpath / "train_end").write_text(str(time.time()))  # a file: under FSDP this runs in a spawned rank
        super().on_train_end(trainer, module)
        if trainer.is_global_zero:
            (self.dirpath / "blocked.json").write_text(json.dumps(self.blocked))


def run(layers: int, every: int, saves: int, async_save: bool, directory: Path, fsdp: bool) -> tuple[list[float], float]:
    """Blocked seconds at each save, and the seconds fit took after the last step (its last wait)."""
    torch.manual_seed(0)
    model = Stack(layers)
    checkpoint = TimedCheckpoint(dirpath=directory, every_n_train_steps=every, save_last=False, async_save=async_save)
    ranks = 2 if fsdp else 1
    data = DataLoader(TensorDataset(torch.randn(8 * every * saves * ranks, WIDTH)), batch_size=8)
    trainer = Trainer(strategy=FSDP(devices=2) if fsdp else "cpu", max_epochs=1, logger=False,
                      enable_progress_bar=False, report=False, enable_model_summary=False, default_root_dir=directory,
                      callbacks=[checkpoint])
    trainer.fit(model, data)
    ended = time.time()
    blocked = {int(step): seconds for step, seconds in json.loads((directory / "blocked.json").read_text()).items()}
    return [seconds for step, seconds in sorted(blocked.items()) if step % every == 0], \
        ended - float((directory / "train_end").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--every", type=int, default=10, help="optimizer steps between saves")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="FSDP(devices=2): each rank writes its shards")
    args = parser.parse_args()
    parameters = args.layers * (WIDTH * WIDTH + WIDTH)
    print(f"{parameters / 1e6:.0f}M parameters, AdamW, a save every {args.every} steps, {args.saves} saves; "
          f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} threads")
    results = {}
    for async_save in (False, True):
        with tempfile.TemporaryDirectory() as directory:
            blocked, end_wait = run(args.layers, args.every, args.saves, async_save, Path(directory), args.fsdp)
            size = sum(path.stat().st_size for path in Path(directory).rglob("*") if path.is_file()
                       and ".ckpt" in str(path))
        results[async_save] = statistics.median(blocked)
        print(f"{'async' if async_save else 'sync ':5}: blocked per save {', '.join(f'{s:.2f}' for s in blocked)} s "
              f"(median {results[async_save]:.2f} s); after the last step fit took {end_wait:.2f} s; "
              f"checkpoint {size / 2**30:.2f} GiB")
    print(f"async blocks for {results[True] / results[False]:.2f} of sync (aim: <= 0.25)")


if __name__ == "__main__":
    main()
