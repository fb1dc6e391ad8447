"""On a CUDA machine: a fit with logging every step raises no host sync between log steps, on one
GPU and under DDP, from the batch transfer to the optimizer step.

Run from the repository root on a machine with a GPU (about a minute per run, most of it start-up)::

    python benchmarks/cuda_sync_check.py
    python benchmarks/cuda_sync_check.py --steps 400 --log-every 50 --prefetch off --json result.json

PyTorch's sync debug mode (``torch.cuda.set_sync_debug_mode("error")``) raises at any call that
makes the host wait for the GPU (``.item()``, ``.cpu()``, ``bool(tensor)``, a blocking copy,
``nonzero``, ...). After ``--warmup`` training batches the mode is switched on when the training
loader collates a batch (its ``collate_fn``), so every batch's copy to the GPU runs under it, the
one that follows a log step included, and by a callback at the start of each training step; it is
switched off only where the budget allows reading values: at log steps (every ``--log-every``
batches), at the end of an epoch and in validation. The warm-up is PyTorch's, not Cadence's:
DistributedDataParallel's second forward rebuilds its gradient buckets with a blocking copy of the
bucket indices, and its runtime statistics wait on CUDA events in its first 10 iterations (and
every 100th: ``cudaEventSynchronize``, which the sync debug mode does not flag), so checking from
the first batch fails at batch 1 on one GPU without Cadence being at fault.

Two runs: ``strategy="cuda"`` (one GPU), then ``DDP`` over two GPUs where there are two (one
process otherwise; NCCL either way). Each uses what users run: ``self.log(..., prog_bar=True)``
every step, an ``on_epoch`` metric, a ``sync_dist=True`` metric, a value logged as a CPU tensor
beside the GPU ones (the learning rate), the default loggers and progress bar, a
``ModelCheckpoint`` on a validation metric, a DataLoader without ``pin_memory`` (the strategy pins
it), the prefetcher (``--prefetch off`` to compare) and the ``AMP`` callback when the installed
Cadence has one. The CPU test ``tests/test_performance_guards.py`` checks the same property without
a GPU by intercepting the conversions with a TorchFunctionMode.

Exit status 0 and a line starting with ``OK`` per run mean no sync outside the allowed points;
without a GPU it prints ``SKIPPED`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from strategies import DDP, SingleDevice  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402


class SyncDebugWindows(Callback):
    """``set_sync_debug_mode("error")`` during training steps after the warm-up; ``"default"``
    where reads are allowed.

    Placed first, so its ``on_train_batch_end`` runs before the other callbacks': after a non-log
    step the mode stays "error" for them, for the next batch's transfer and for the next step.
    Its count of checked steps comes back from DDP workers as its state.
    """

    def __init__(self, log_every: int, warmup: int) -> None:
        self.log_every, self.warmup = log_every, warmup
        self.started = 0  # training batches started, over the epochs
        self.checked_steps = 0

    @property
    def armed(self) -> bool:
        return self.started > self.warmup

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.started += 1
        if self.armed:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not self.armed:
            return
        log_step = trainer.global_step % self.log_every == 0
        epoch_end = batch_idx + 1 == trainer.num_training_batches
        if log_step or epoch_end:
            torch.cuda.set_sync_debug_mode("default")
        else:
            self.checked_steps += 1

    def on_validation_start(self, trainer, module):
        torch.cuda.set_sync_debug_mode("default")

    def on_train_epoch_end(self, trainer, module):
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, module, error):
        torch.cuda.set_sync_debug_mode("default")

    def teardown(self, trainer, module, stage):
        torch.cuda.set_sync_debug_mode("default")

    def state_dict(self):
        return {"checked_steps": self.checked_steps}

    def load_state_dict(self, state):
        self.checked_steps = state["checked_steps"]


class CollateUnderSyncCheck:
    """The training loader's collate_fn: once the warm-up is over, from here to the next allowed
    read a sync is an error (the batch's copy to the GPU included)."""

    def __init__(self, windows: SyncDebugWindows) -> None:
        self.windows = windows

    def __call__(self, samples):
        if self.windows.armed:
            torch.cuda.set_sync_debug_mode("error")
        return default_collate(samples)


class Classifier(TrainingModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(1) == y).float().mean(), on_step=True, on_epoch=True, sync_dist=True)
        # A value on the CPU beside the GPU ones: stacked per device at log steps, no copy per step.
        self.log("train/lr", torch.tensor(self.trainer.optimizers[0].param_groups[0]["lr"]))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def loader(batches: int, width: int, batch_size: int, seed: int, collate_fn=None) -> DataLoader:
    """Without pin_memory, as users write it: the CUDA strategies pin it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, width, generator=generator)
    y = torch.randint(0, 10, (batches * batch_size,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, num_workers=0, collate_fn=collate_fn)


def amp_callbacks() -> list[Callback]:
    try:
        from callbacks import AMP
    except ImportError:  # not in this version of Cadence yet
        return []
    return [AMP("bf16")]


def check(name: str, strategy, args: argparse.Namespace) -> dict:
    """One fit under the sync debug windows; what it found."""
    windows = SyncDebugWindows(args.log_every, args.warmup)
    extra = amp_callbacks()
    result = {"run": name, "amp": bool(extra), "ok": False, "error": None}
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_epochs=args.epochs, strategy=strategy, default_root_dir=root, log_every_n_steps=args.log_every,
            callbacks=[windows, *extra, ModelCheckpoint(monitor="val/loss")],
        )
        try:
            train = loader(args.steps, args.width, 64, 0, collate_fn=CollateUnderSyncCheck(windows))
            trainer.fit(Classifier(args.width), train, loader(4, args.width, 64, 1))
            result["ok"] = True
        except RuntimeError as error:  # the sync debug mode's error names the call that synced
            result["error"] = f"{type(error).__name__}: {error}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result["checked_steps"] = windows.checked_steps
    if result["ok"]:
        print(f"OK {name}: {windows.checked_steps} non-log steps and their batch transfers ran under sync debug "
              f"mode 'error' without a host sync, after {args.warmup} warm-up batches (AMP "
              f"{'on' if extra else 'not available'}).")
    else:
        print(f"FAILED {name} after {windows.checked_steps} checked steps: {result['error']}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training batches per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=12,
                        help="batches before the check starts (DDP syncs in its first iterations by design)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--prefetch", choices=("on", "off"), default="on", help="the CUDA strategies' prefetch option")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"SKIPPED: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              "this check needs a GPU.")
        return 2

    prefetch = args.prefetch == "on"
    gpus = min(2, torch.cuda.device_count())
    runs = [
        check(f"cuda:0, prefetch {args.prefetch}", SingleDevice("cuda", prefetch=prefetch), args),
        check(f"DDP on {gpus} GPU(s), NCCL, prefetch {args.prefetch}", DDP(devices=gpus, prefetch=prefetch), args),
    ]
    summary = {
        "torch": torch.__version__, "python": platform.python_version(), "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(), "steps": args.steps * args.epochs, "log_every_n_steps": args.log_every,
        "runs": runs, "ok": all(run["ok"] for run in runs),
    }
    print(f"{'OK' if summary['ok'] else 'FAILED'}: {summary['gpu']} x{summary['gpus']}, torch {summary['torch']}.")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
