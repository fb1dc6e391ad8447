"""Train a small classifier on the UCI handwritten digits that ship in ``examples/data/``.

1,797 images of 8x8 pixels (values 0..16), ten classes; see ``examples/data/README.md`` for the
source and licence. A two-layer MLP reaches about 97% validation accuracy in a few seconds on two
CPU cores. Run from the repository root::

    python examples/digits.py                  # strategy "auto": a GPU if there is one
    python examples/digits.py --max-epochs 5 --strategy cpu

or from a YAML file, through the command line: ``cadence fit --config examples/digits.yaml``.
It prints where its logs (``metrics.csv``, TensorBoard events) and checkpoints went.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import EarlyStopping, ModelCheckpoint
from trainer import Trainer, TrainingModule

DATA = Path(__file__).resolve().parent / "data" / "digits.csv.gz"


def load_digits(path: str | Path = DATA) -> tuple[torch.Tensor, torch.Tensor]:
    """The images as float32 in [0, 1], shape (N, 64), and the labels as int64, shape (N,)."""
    with gzip.open(path, "rt") as file:
        table = np.loadtxt(file, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :64] / 16.0)
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
    return images, labels


def digits_loaders(batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0,
                   path: str = str(DATA)) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders over a fixed random split of the digits.

    Args:
        batch_size: samples per training batch (validation uses batches of 512).
        val_fraction: share of the samples held out for validation.
        seed: seed of the split, so every run validates on the same images.
        path: the ``digits.csv.gz`` file.
    """
    images, labels = load_digits(path)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_val = int(len(labels) * val_fraction)
    val, train = order[:num_val], order[num_val:]
    train_loader = DataLoader(TensorDataset(images[train], labels[train]), batch_size=batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(seed))
    val_loader = DataLoader(TensorDataset(images[val], labels[val]), batch_size=512)
    return train_loader, val_loader


class DigitsClassifier(TrainingModule):
    """A two-layer MLP over the 64 pixels.

    Args:
        hidden: width of the hidden layer.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        dropout: dropout before the output layer.
    """

    def __init__(self, hidden: int = 128, lr: float = 3e-3, weight_decay: float = 1e-4, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val/loss", F.cross_entropy(logits, labels), batch_size=len(labels))
        self.log("val/acc", (logits.argmax(1) == labels).float().mean(), prog_bar=True, batch_size=len(labels))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        # The learning rate falls to zero over the run (or over 100 epochs when only max_steps is set).
        epochs = self.trainer.max_epochs or 100
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)}


def train(max_epochs: int = 30, strategy: str = "auto", default_root_dir: str | None = None,
          enable_progress_bar: bool = True, seed: int = 0) -> tuple[Trainer, ModelCheckpoint]:
    """Train the classifier; return the trainer and the checkpoint callback (``best_model_path``)."""
    checkpoint = ModelCheckpoint(monitor="val/acc", mode="max", filename="{epoch}-{val/acc:.4f}")
    stopping = EarlyStopping(monitor="val/acc", mode="max", patience=8)
    trainer = Trainer(max_epochs=max_epochs, strategy=strategy, callbacks=[checkpoint, stopping], seed=seed,
                      default_root_dir=default_root_dir, enable_progress_bar=enable_progress_bar, log_every_n_steps=10)
    train_loader, val_loader = digits_loaders(seed=seed)
    trainer.fit(DigitsClassifier(), train_loader, val_loader)
    return trainer, checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--strategy", default="auto", help='"auto", "cpu", "cuda", "cuda:N", "mps" or "ddp"')
    parser.add_argument("--root-dir", default=None, help="where cadence_logs/ goes (default: the current directory)")
    args = parser.parse_args(argv)
    trainer, checkpoint = train(args.max_epochs, args.strategy, args.root_dir)
    best = checkpoint.best_k_models.get(checkpoint.best_model_path, float("nan"))
    print(f"Best validation accuracy: {best:.4f} after {trainer.current_epoch} epochs")
    print(f"Logs (metrics.csv, TensorBoard events): {trainer.log_dir}")
    print(f"Best checkpoint: {checkpoint.best_model_path}")
    print(f"Last checkpoint (resume with ckpt_path=...): {checkpoint.last_model_path}")


if __name__ == "__main__":
    main()
