"""Train a small classifier on the UCI handwritten digits that ship in ``examples/data/``.

1,797 images of 8x8 pixels (values 0..16), ten classes; see ``examples/data/README.md`` for the
source and licence. A two-layer MLP reaches about 97% test accuracy in a few seconds on two CPU
cores. Run from the repository root::

    python examples/digits.py                               # strategy "auto": a GPU if there is one
    python examples/digits.py --max-epochs 5 --strategy cpu
    python examples/digits.py --strategy ddp --devices 2    # two processes (on a CPU: gloo)

or the same run from a YAML file: ``cadence fit --config examples/digits.yaml`` (the script and the
file train identical weights). It prints the test accuracy and where its logs (``metrics.csv``,
TensorBoard events) and checkpoints went.
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
from trainer import DataModule, Trainer, TrainingModule

DATA = Path(__file__).resolve().parent / "data" / "digits.csv.gz"


def load_digits(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The images as float32 in [0, 1], shape (N, 64), and the labels as int64, shape (N,).

    Args:
        path: a ``digits.csv.gz`` file; default: the one in ``examples/data/``.
    """
    with gzip.open(path or DATA, "rt") as file:
        table = np.loadtxt(file, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :64] / 16.0)
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
    return images, labels


class DigitsData(DataModule):
    """The digits, split at random (with ``seed``) into training, validation and test sets.

    A DataModule, so ``cadence fit`` (``data:``) and ``Trainer.fit(model, datamodule=...)`` take it.
    The data is small, so it is read when the object is made (no ``prepare_data``/``setup`` needed).

    Args:
        batch_size: samples per training batch (evaluation uses batches of 512).
        val_fraction: share of the samples held out for validation (0: no validation loader).
        test_fraction: share held out for testing (0: no test loader).
        seed: seed of the split, so every run validates and tests on the same images.
        path: a ``digits.csv.gz`` file; default: the one in ``examples/data/``.
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.15, test_fraction: float = 0.15,
                 seed: int = 0, path: str | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        images, labels = load_digits(path)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        num_val, num_test = int(len(labels) * val_fraction), int(len(labels) * test_fraction)
        parts = order[:num_val], order[num_val:num_val + num_test], order[num_val + num_test:]
        self.val, self.test, self.train = (TensorDataset(images[part], labels[part]) for part in parts)

    def train_dataloader(self) -> DataLoader:
        # No generator here: Trainer(seed=...) gives the loader one, so the order follows the seed.
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | None:
        return DataLoader(self.val, batch_size=512) if len(self.val) else None

    def test_dataloader(self) -> DataLoader | None:
        return DataLoader(self.test, batch_size=512) if len(self.test) else None

    def predict_dataloader(self) -> DataLoader | None:
        # predict_step takes images alone: the test images, without their labels.
        return DataLoader(self.test.tensors[0], batch_size=512) if len(self.test) else None


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
        self._evaluate("val", batch)

    def test_step(self, batch, batch_idx):
        self._evaluate("test", batch)

    def predict_step(self, batch, batch_idx):
        return self(batch).argmax(1)  # the predicted digit of each image

    def _evaluate(self, stage: str, batch) -> None:
        images, labels = batch
        logits = self(images)
        # sync_dist: under DDP each rank sees a shard; the logged value is the mean over ranks.
        self.log(f"{stage}/loss", F.cross_entropy(logits, labels), batch_size=len(labels), sync_dist=True)
        self.log(f"{stage}/acc", (logits.argmax(1) == labels).float().mean(), prog_bar=True, batch_size=len(labels),
                 sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        # The learning rate falls to zero over the run (or over 100 epochs when only max_steps is set).
        epochs = self.trainer.max_epochs or 100
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)}


def train(max_epochs: int = 30, strategy: str = "auto", devices: int | str = "auto", default_root_dir: str | None = None,
          enable_progress_bar: bool = True, seed: int = 0) -> tuple[Trainer, ModelCheckpoint, DigitsClassifier, DigitsData]:
    """Train the classifier as ``examples/digits.yaml`` does; return the trainer, the checkpoint
    callback (``best_model_path``), the trained model and the data."""
    # A metric name with "/" would be a subdirectory in an inserted name: spell the file name out instead.
    checkpoint = ModelCheckpoint(monitor="val/acc", mode="max", filename="epoch={epoch}-val_acc={val/acc:.4f}",
                                 auto_insert_metric_name=False)
    stopping = EarlyStopping(monitor="val/acc", mode="max", patience=8)
    trainer = Trainer(max_epochs=max_epochs, strategy=strategy, devices=devices, callbacks=[checkpoint, stopping],
                      seed=seed, default_root_dir=default_root_dir, enable_progress_bar=enable_progress_bar,
                      log_every_n_steps=10)
    model = DigitsClassifier()  # after Trainer(seed=...): its initial weights follow the seed
    data = DigitsData(seed=seed)
    trainer.fit(model, datamodule=data)
    return trainer, checkpoint, model, data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--strategy", default="auto", help='"auto", "cpu", "cuda", "cuda:N", "mps" or "ddp"')
    parser.add_argument("--devices", default="auto",
                        help='processes for "ddp" (default "auto": every GPU, or one process on a CPU)')
    parser.add_argument("--root-dir", default=None, help="where lightning_logs/ goes (default: the current directory)")
    args = parser.parse_args(argv)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer, checkpoint, model, data = train(args.max_epochs, args.strategy, devices, args.root_dir)
    # Test the best weights, not the last: load them from the best checkpoint.
    tested = trainer.test(model, data.test_dataloader(), ckpt_path=checkpoint.best_model_path)
    print(f"Test accuracy: {tested[0]['test/acc']:.4f} (best validation accuracy "
          f"{checkpoint.best_model_score:.4f}, after {trainer.current_epoch} epochs)")
    print(f"Logs (metrics.csv, TensorBoard events): {trainer.log_dir}")
    print(f"Best checkpoint: {checkpoint.best_model_path}")
    print(f"Last checkpoint (resume with ckpt_path=...): {checkpoint.last_model_path}")


if __name__ == "__main__":
    main()
