"""On a CUDA machine: a fit with logging every step raises no host sync between log steps.

Run from the repository root on a machine with a GPU (about a minute, most of it start-up)::

    python benchmarks/cuda_sync_check.py
    python benchmarks/cuda_sync_check.py --steps 400 --log-every 50 --json result.json

PyTorch's sync debug mode (``torch.cuda.set_sync_debug_mode("error")``) raises at any call that
makes the host wait for the GPU (``.item()``, ``.cpu()``, ``bool(tensor)``, a blocking copy,
``nonzero``, ...). A callback switches it on from the start of each training step and off only
where the budget allows reading values: at log steps (every ``--log-every`` batches), at the
end of an epoch and in validation. The run uses what users run: ``self.log(..., prog_bar=True)``
every step plus an ``on_epoch`` metric, the default loggers and progress bar, a
``ModelCheckpoint`` on a validation metric, a pinned-memory DataLoader, and the ``AMP`` callback
when the installed Cadence has one. The CPU test ``tests/test_performance_guards.py`` checks the
same property without a GPU by intercepting the conversions with a TorchFunctionMode.

Exit status 0 and a line starting with ``OK`` mean no sync outside the allowed points.
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
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402


class SyncDebugWindows(Callback):
    """``set_sync_debug_mode("error")`` during training steps; ``"default"`` where reads are allowed.

    Placed first, so its ``on_train_batch_end`` runs before the other callbacks': after a non-log
    step the mode stays "error" for them, for the next batch's transfer and for the next step.
    """

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every
        self.checked_steps = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
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


class Classifier(TrainingModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(1) == y).float().mean(), on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def loader(batches: int, width: int, batch_size: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, width, generator=generator)
    y = torch.randint(0, 10, (batches * batch_size,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, pin_memory=True, num_workers=0)


def amp_callbacks() -> list[Callback]:
    try:
        from callbacks import AMP
    except ImportError:  # not in this version of Cadence yet
        return []
    return [AMP("bf16")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training batches per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device; this check needs a GPU.")
        return 2

    windows = SyncDebugWindows(args.log_every)
    extra = amp_callbacks()
    result = {
        "torch": torch.__version__, "python": platform.python_version(), "gpu": torch.cuda.get_device_name(0),
        "steps": args.steps * args.epochs, "log_every_n_steps": args.log_every,
        "amp": bool(extra), "ok": False, "error": None,
    }
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_epochs=args.epochs, strategy="cuda", default_root_dir=root, log_every_n_steps=args.log_every,
            callbacks=[windows, *extra, ModelCheckpoint(monitor="val/loss")],
        )
        try:
            trainer.fit(Classifier(args.width), loader(args.steps, args.width, 64, 0), loader(4, args.width, 64, 1))
            result["ok"] = True
        except RuntimeError as error:  # the sync debug mode's error names the call that synced
            result["error"] = f"{type(error).__name__}: {error}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result["checked_steps"] = windows.checked_steps
    if result["ok"]:
        print(f"OK: {windows.checked_steps} non-log steps ran under sync debug mode 'error' without a host sync "
              f"({result['gpu']}, torch {result['torch']}, AMP {'on' if extra else 'not available'}).")
    else:
        print(f"FAILED after {windows.checked_steps} checked steps: {result['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
