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

__all__ = ["DataModule", "LightningCLI", "Trainer", "TrainingModule", "Tuner", "environment_report", "rank_zero_only",
           "seed_everything"]


def __getattr__(name: str):
    # Lightning's LightningCLI, refused with the cadence command; the command line loads only when named.
    if name == "LightningCLI":
        from trainer.cli import LightningCLI

        return LightningCLI
    if name == "cli_lightning_logo":  # Lightning's examples start with it (lightning.pytorch.cli_lightning_logo)
        from trainer.utilities import cli_lightning_logo

        return cli_lightning_logo
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
