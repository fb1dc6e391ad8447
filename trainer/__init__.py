"""Cadence: the Trainer and the user's contract (TrainingModule, DataModule)."""

import os

import _cadence_shadowing

_cadence_shadowing.check_packages()  # first: a user's callbacks.py would break the imports below

from trainer.datamodule import DataModule
from trainer.environment import environment_report
from trainer.module import TrainingModule
from trainer.seed import seed_everything
from trainer.trainer import Trainer
from trainer.tuner import Tuner
from trainer.utilities import disable_possible_user_warnings, rank_zero_only
from callbacks import Callback

# Lightning's top-level names, so `import lightning.pytorch as pl` -> `import trainer as pl` keeps
# `pl.LightningModule`, `pl.LightningDataModule` and `pl.Callback` working.
LightningModule = TrainingModule
LightningDataModule = DataModule

__all__ = ["Callback", "DataModule", "LightningCLI", "LightningDataModule", "LightningModule", "Trainer",
           "TrainingModule", "Tuner", "disable_possible_user_warnings", "environment_report", "rank_zero_only",
           "seed_everything"]

# Lightning's switch, read when the package is imported (as ``import lightning.pytorch`` reads it).
if os.environ.get("POSSIBLE_USER_WARNINGS", "").lower() in ("0", "off"):
    disable_possible_user_warnings()


def __getattr__(name: str):
    # Lightning's LightningCLI, refused with the cadence command; the command line loads only when named.
    if name == "LightningCLI":
        from trainer.cli import LightningCLI

        return LightningCLI
    if name == "cli_lightning_logo":  # Lightning's examples start with it (lightning.pytorch.cli_lightning_logo)
        from trainer.utilities import cli_lightning_logo

        return cli_lightning_logo
    # The rest of ``lightning.pytorch``'s namespace, as ``import trainer as pl`` reaches it:
    # pl.callbacks.EarlyStopping, pl.loggers.CSVLogger, pl.profilers.SimpleProfiler, pl.strategies.DDPStrategy.
    if name in ("callbacks", "loggers", "profilers", "strategies"):
        import callbacks
        import strategies

        if name == "profilers":  # Lightning's Profiler is the profilers' base; callbacks.Profiler is torch.profiler's
            import types

            return types.SimpleNamespace(Profiler=callbacks.LightningProfiler, **{
                key: getattr(callbacks, key) for key in ("SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler",
                                                         "PassThroughProfiler", "XLAProfiler")})
        return strategies if name == "strategies" else callbacks
    if name in ("plugins", "accelerators"):
        raise AttributeError(f"module 'trainer' has no attribute {name!r}: Lightning's {name} are Trainer arguments "
                             "in Cadence (precision=, accelerator=, devices=, strategy=); see docs/lightning.md.")
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
