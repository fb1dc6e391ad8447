"""Cadence: the Trainer and the user's contract (TrainingModule)."""

from trainer.environment import environment_report
from trainer.module import TrainingModule
from trainer.seed import seed_everything
from trainer.trainer import Trainer

__all__ = ["Trainer", "TrainingModule", "environment_report", "seed_everything"]
