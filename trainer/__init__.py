"""Cadence: the Trainer and the user's contract (TrainingModule, DataModule)."""

import _cadence_shadowing

_cadence_shadowing.check_packages()  # first: a user's callbacks.py would break the imports below

from trainer.datamodule import DataModule
from trainer.environment import environment_report
from trainer.module import TrainingModule
from trainer.seed import seed_everything
from trainer.trainer import Trainer
from trainer.tuner import Tuner
from trainer.utilities import rank_zero_only

__all__ = ["DataModule", "Trainer", "TrainingModule", "Tuner", "environment_report", "rank_zero_only", "seed_everything"]
