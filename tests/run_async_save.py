"""A run whose checkpoints are written in the background, for the test that SIGKILLs it mid-write.

    python tests/run_async_save.py ROOT

``ModelCheckpoint(async_save=True)`` saves after every optimizer step into ``ROOT/checkpoints``,
keeping the newest file and ``last.ckpt``. The module carries a 32 MB buffer so that each write
lasts long enough for the test to catch one in flight (its temporary file exists). Every run calls
``fit(..., ckpt_path="last")``, so running the same command again resumes; the global step it
resumed from and the one it ended at go to ``ROOT/resumed.txt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from linear_regression import LinearRegression, regression_samples  # noqa: E402
from trainer import Trainer  # noqa: E402


class Heavy(LinearRegression):
    """The regression module with 32 MB of state that a checkpoint must write."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.zeros(8_000_000))


class RecordStart(Callback):
    def on_train_start(self, trainer, module):
        self.start = trainer.global_step


def main() -> None:
    root = Path(sys.argv[1])
    start = RecordStart()
    trainer = Trainer(strategy="cpu", max_steps=4, default_root_dir=root, enable_progress_bar=False, logger=False,
                      report=False, callbacks=[start, ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=1,
                                                                      async_save=True)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*found no last.ckpt.*")  # the first run starts fresh
        trainer.fit(Heavy(), DataLoader(TensorDataset(*regression_samples(64)), batch_size=8), ckpt_path="last")
    (root / "resumed.txt").write_text(f"{start.start} {trainer.global_step}")


if __name__ == "__main__":
    main()
