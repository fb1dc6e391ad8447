"""Cadence: the Trainer and the user's contract (TrainingModule, DataModule)."""

from trainer.datamodule import DataModule
from trainer.module import TrainingModule
from trainer.seed import seed_everything
from trainer.trainer import Trainer

__all__ = ["DataModule", "Trainer", "TrainingModule", "seed_everything"]
