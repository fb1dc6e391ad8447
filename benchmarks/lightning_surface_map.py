"""The name map ``lightning_surface.py`` measures with: each name a Lightning user imports, and Cadence's.

A value is the Cadence name a user imports instead (``"callbacks.ModelCheckpoint"``): where it does
not exist yet, the name counts as missing until it does, so the map names where it belongs. Or a
:class:`Refused`: Cadence does not offer it on purpose, and the user must be told so, with the
Cadence way, when importing it from the Cadence package named in ``CADENCE_MODULE_OF``, or when making
one (``callbacks.RichProgressBar()``: the name imports, so a script's imports do not fail).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Refused:
    way: str


NO_SERVICES = "write a callbacks.Logger for the service (Cadence depends on no tracking service)"

MAP: dict[str, str | Refused] = {
    # lightning.pytorch
    "lightning.pytorch.Trainer": "trainer.Trainer",
    "lightning.pytorch.LightningModule": "trainer.TrainingModule",
    "lightning.pytorch.LightningDataModule": "trainer.DataModule",
    "lightning.pytorch.Callback": "callbacks.Callback",
    "lightning.pytorch.seed_everything": "trainer.seed_everything",
    # lightning.pytorch.callbacks
    "lightning.pytorch.callbacks.ModelCheckpoint": "callbacks.ModelCheckpoint",
    "lightning.pytorch.callbacks.EarlyStopping": "callbacks.EarlyStopping",
    "lightning.pytorch.callbacks.LearningRateMonitor": "callbacks.LearningRateMonitor",
    "lightning.pytorch.callbacks.Timer": "callbacks.Timer",
    "lightning.pytorch.callbacks.ModelSummary": "callbacks.ModelSummary",
    "lightning.pytorch.callbacks.TQDMProgressBar": "callbacks.ProgressBar",
    "lightning.pytorch.callbacks.ProgressBar": "callbacks.ProgressBar",
    "lightning.pytorch.callbacks.BaseFinetuning": "callbacks.BaseFinetuning",
    "lightning.pytorch.callbacks.BackboneFinetuning": "callbacks.BackboneFinetuning",
    "lightning.pytorch.callbacks.LearningRateFinder": "callbacks.LearningRateFinder",
    "lightning.pytorch.callbacks.BatchSizeFinder": "callbacks.BatchSizeFinder",
    "lightning.pytorch.callbacks.BasePredictionWriter": "callbacks.BasePredictionWriter",
    "lightning.pytorch.callbacks.Checkpoint": "callbacks.Checkpoint",
    "lightning.pytorch.callbacks.OnExceptionCheckpoint": "callbacks.OnExceptionCheckpoint",
    "lightning.pytorch.callbacks.GradientAccumulationScheduler": "callbacks.GradientAccumulationScheduler",
    "lightning.pytorch.callbacks.LambdaCallback": "callbacks.LambdaCallback",
    "lightning.pytorch.callbacks.StochasticWeightAveraging": "callbacks.StochasticWeightAveraging",
    "lightning.pytorch.callbacks.WeightAveraging": "callbacks.WeightAveraging",
    "lightning.pytorch.callbacks.EMAWeightAveraging": "callbacks.EMAWeightAveraging",
    "lightning.pytorch.callbacks.DeviceStatsMonitor": "callbacks.DeviceStatsMonitor",
    "lightning.pytorch.callbacks.ThroughputMonitor": "callbacks.ThroughputMonitor",
    "lightning.pytorch.callbacks.SpikeDetection": Refused("on_nonfinite_loss; EarlyStopping(divergence_threshold)"),
    "lightning.pytorch.callbacks.ModelPruning": "callbacks.ModelPruning",
    "lightning.pytorch.callbacks.RichProgressBar": "callbacks.RichProgressBar",
    "lightning.pytorch.callbacks.RichModelSummary": "callbacks.RichModelSummary",
    # lightning.pytorch.loggers
    "lightning.pytorch.loggers.Logger": "callbacks.Logger",
    "lightning.pytorch.loggers.TensorBoardLogger": "callbacks.TensorBoardLogger",
    "lightning.pytorch.loggers.CSVLogger": "callbacks.CSVLogger",
    "lightning.pytorch.loggers.csv_logs.ExperimentWriter": "callbacks.csv_logger.ExperimentWriter",
    "lightning.pytorch.loggers.logger.DummyLogger": "callbacks.DummyLogger",
    "lightning.pytorch.loggers.logger.DummyExperiment": "callbacks.DummyExperiment",
    "lightning.pytorch.loggers.WandbLogger": Refused(NO_SERVICES),
    "lightning.pytorch.loggers.MLFlowLogger": Refused(NO_SERVICES),
    "lightning.pytorch.loggers.CometLogger": Refused(NO_SERVICES),
    "lightning.pytorch.loggers.LitLogger": Refused(NO_SERVICES),
    # lightning.pytorch.profilers
    "lightning.pytorch.profilers.Profiler": "callbacks.profilers.Profiler",  # callbacks.Profiler: Cadence's torch.profiler callback
    "lightning.pytorch.profilers.SimpleProfiler": "callbacks.SimpleProfiler",
    "lightning.pytorch.profilers.AdvancedProfiler": "callbacks.AdvancedProfiler",
    "lightning.pytorch.profilers.PyTorchProfiler": "callbacks.PyTorchProfiler",
    "lightning.pytorch.profilers.PassThroughProfiler": "callbacks.PassThroughProfiler",
    "lightning.pytorch.profilers.XLAProfiler": Refused("nothing: Cadence runs on CPUs, CUDA GPUs and Apple GPUs"),
    # lightning.pytorch.tuner
    "lightning.pytorch.tuner.Tuner": "trainer.Tuner",
    # lightning.pytorch.utilities
    "lightning.pytorch.utilities.parsing.collect_init_args": "trainer.hparams.collect_init_args",
    "lightning.pytorch.utilities.parsing.parse_class_init_keys": "trainer.hparams.parse_class_init_keys",
    "lightning.pytorch.utilities.rank_zero_only": "trainer.utilities.rank_zero_only",
    "lightning.pytorch.utilities.rank_zero_info": "trainer.utilities.rank_zero_info",
    "lightning.pytorch.utilities.rank_zero_warn": "trainer.utilities.rank_zero_warn",
    "lightning.pytorch.utilities.rank_zero.rank_zero_debug": "trainer.utilities.rank_zero_debug",
    "lightning.pytorch.utilities.rank_zero_deprecation": "trainer.utilities.rank_zero_deprecation",
    "lightning.pytorch.utilities.grad_norm": "trainer.utilities.grad_norm",
    "lightning.pytorch.utilities.AttributeDict": "trainer.utilities.AttributeDict",
    "lightning.pytorch.utilities.types.LRSchedulerConfig": "trainer.utilities.LRSchedulerConfig",
    "lightning.pytorch.utilities.move_data_to_device": "trainer.utilities.move_data_to_device",
    "lightning.pytorch.utilities.measure_flops": "trainer.utilities.measure_flops",
    "lightning.pytorch.utilities.is_picklable": "trainer.utilities.is_picklable",
    "lightning.pytorch.utilities.suggested_max_num_workers": "trainer.utilities.suggested_max_num_workers",
    "lightning.pytorch.utilities.find_shared_parameters": "trainer.utilities.find_shared_parameters",
    "lightning.pytorch.utilities.set_shared_parameters": "trainer.utilities.set_shared_parameters",
    "lightning.pytorch.utilities.is_shared_filesystem": "trainer.utilities.is_shared_filesystem",
    "lightning.pytorch.utilities.disable_possible_user_warnings": "trainer.utilities.disable_possible_user_warnings",
    "lightning.pytorch.utilities.warnings.PossibleUserWarning": "trainer.utilities.PossibleUserWarning",
    "lightning.pytorch.utilities.GradClipAlgorithmType": "trainer.utilities.GradClipAlgorithmType",
    "lightning.pytorch.utilities.LightningEnum": "trainer.utilities.LightningEnum",
    "lightning.pytorch.utilities.CombinedLoader": "trainer.utilities.CombinedLoader",
    "lightning.pytorch.utilities.model_summary.ModelSummary": "trainer.utilities.model_summary.ModelSummary",
    "lightning.pytorch.utilities.model_summary.summarize": "trainer.utilities.model_summary.summarize",
    "lightning.pytorch.utilities.model_summary.LayerSummary": "trainer.utilities.model_summary.LayerSummary",
    "lightning.pytorch.utilities.model_summary.get_human_readable_count":
        "trainer.utilities.model_summary.get_human_readable_count",
    "lightning.pytorch.utilities.model_summary.get_formatted_model_size":
        "trainer.utilities.model_summary.get_formatted_model_size",
    # lightning.pytorch.cli
    "lightning.pytorch.cli.LightningCLI": Refused("the cadence command: cadence fit --config run.yaml"),
    # lightning.pytorch.strategies: what users construct for strategy=
    "lightning.pytorch.strategies.DDPStrategy": "strategies.DDPStrategy",
    "lightning.pytorch.strategies.FSDPStrategy": "strategies.FSDPStrategy",
    "lightning.pytorch.strategies.SingleDeviceStrategy": "strategies.SingleDeviceStrategy",
    "lightning.pytorch.strategies.ModelParallelStrategy": Refused('strategy="fsdp" (no tensor-parallel strategy)'),
    "lightning.pytorch.strategies.DeepSpeedStrategy": Refused('strategy="fsdp" (DeepSpeed is not a dependency)'),
}

#: Where a user looks for a Lightning module's names in Cadence (refusals are checked there).
CADENCE_MODULE_OF = {
    "lightning.pytorch": "trainer",
    "lightning.pytorch.callbacks": "callbacks",
    "lightning.pytorch.loggers": "callbacks",
    "lightning.pytorch.profilers": "callbacks",
    "lightning.pytorch.tuner": "trainer",
    "lightning.pytorch.utilities": "trainer.utilities",
    "lightning.pytorch.utilities.rank_zero": "trainer.utilities",
    "lightning.pytorch.utilities.model_summary": "trainer.utilities.model_summary",
    "lightning.pytorch.utilities.model_summary.model_summary": "trainer.utilities.model_summary",
    "lightning.pytorch.strategies": "strategies",
    "lightning.pytorch.cli": "trainer",
}

#: Parameters Lightning passes on through **kwargs that users write (name -> Lightning's default).
KWARGS_OF = {
    # DDPStrategy(**kwargs) goes to torch's DistributedDataParallel.
    "lightning.pytorch.strategies.DDPStrategy": {
        "find_unused_parameters": False, "static_graph": False, "gradient_as_bucket_view": False,
        "broadcast_buffers": True, "bucket_cap_mb": None,
    },
}


#: Cadence functions that take **kwargs and pass them on: their parameters are the target's.
FORWARDS = {
    "lightning.pytorch.LightningModule.log_dict": "trainer.TrainingModule.log",
}


def _save_dir(directory: Path, side: str) -> str:
    return str(directory / side)


def _trainer(directory: Path, side: str) -> Any:
    if side == "lightning":
        from lightning.pytorch import Trainer
    else:
        from trainer import Trainer
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   default_root_dir=str(directory / side))


#: Arguments a constructor requires, per side, to build an instance and try refused parameters
#: (a callable gets the temporary directory and the side). Lightning's value is used on both sides.
CONSTRUCT: dict[str, dict[str, dict[str, Any]]] = {
    "lightning.pytorch.Trainer": {"lightning": {"logger": False}, "cadence": {"logger": False}},
    "lightning.pytorch.callbacks.EarlyStopping": {"lightning": {"monitor": "val_loss"}, "cadence": {"monitor": "val_loss"}},
    "lightning.pytorch.callbacks.ModelCheckpoint": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.callbacks.LearningRateMonitor": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.callbacks.Timer": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.callbacks.ModelSummary": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.callbacks.TQDMProgressBar": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.callbacks.StochasticWeightAveraging": {"lightning": {"swa_lrs": 0.01}, "cadence": {"swa_lrs": 0.01}},
    "lightning.pytorch.callbacks.GradientAccumulationScheduler": {"lightning": {"scheduling": {0: 2}},
                                                                  "cadence": {"scheduling": {0: 2}}},
    "lightning.pytorch.callbacks.ModelPruning": {"lightning": {"pruning_fn": "l1_unstructured"},
                                                 "cadence": {"pruning_fn": "l1_unstructured"}},
    "lightning.pytorch.callbacks.OnExceptionCheckpoint": {"lightning": {"dirpath": _save_dir}, "cadence": {"dirpath": _save_dir}},
    "lightning.pytorch.callbacks.ThroughputMonitor": {"lightning": {"batch_size_fn": len}, "cadence": {"batch_size_fn": len}},
    "lightning.pytorch.loggers.TensorBoardLogger": {"lightning": {"save_dir": _save_dir}, "cadence": {"save_dir": _save_dir}},
    "lightning.pytorch.loggers.CSVLogger": {"lightning": {"save_dir": _save_dir}, "cadence": {"save_dir": _save_dir}},
    "lightning.pytorch.profilers.SimpleProfiler": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.profilers.AdvancedProfiler": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.profilers.PyTorchProfiler": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.profilers.Profiler": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.tuner.Tuner": {"lightning": {"trainer": _trainer}, "cadence": {"trainer": _trainer}},
    "lightning.pytorch.seed_everything": {"lightning": {"seed": 0}, "cadence": {"seed": 0}},
    "lightning.pytorch.strategies.DDPStrategy": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.strategies.FSDPStrategy": {"lightning": {}, "cadence": {}},
    "lightning.pytorch.strategies.SingleDeviceStrategy": {"lightning": {}, "cadence": {}},
}

#: Members compared: the Lightning class's public names less those of the base named here (its
#: hooks are measured on Callback itself), less Lightning's internals.
MEMBERS_OF: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "lightning.pytorch.LightningModule": ("torch.nn.Module", ()),
    "lightning.pytorch.Callback": (None, ()),
    "lightning.pytorch.LightningDataModule": (None, ()),
    **{name: ("lightning.pytorch.Callback", ()) for name in MAP if name.startswith("lightning.pytorch.callbacks.")},
}

#: Compared by their constructor only: their other members are Lightning's machinery (a strategy's
#: methods are called by Lightning's loops, not by users).
PARAMETERS_ONLY = {name for name in MAP if name.startswith("lightning.pytorch.strategies.")}

#: Lightning members that are its machinery, not what users read: not counted.
INTERNAL_MEMBERS = {
    "lightning.pytorch.Trainer": {"fit_loop", "validate_loop", "test_loop", "predict_loop", "state", "precision_plugin",
                                  "val_check_batch", "distributed_sampler_kwargs", "barebones", "enable_autolog_hparams",
                                  "scaler", "is_last_batch", "evaluating"},
    "lightning.pytorch.LightningModule": {"CHECKPOINT_HYPER_PARAMS_KEY", "CHECKPOINT_HYPER_PARAMS_NAME",
                                          "CHECKPOINT_HYPER_PARAMS_TYPE", "remove_ignored_hparams", "fabric",
                                          "device_mesh", "to_tensorrt"},
    "lightning.pytorch.LightningDataModule": {"CHECKPOINT_HYPER_PARAMS_KEY", "CHECKPOINT_HYPER_PARAMS_NAME",
                                              "CHECKPOINT_HYPER_PARAMS_TYPE", "remove_ignored_hparams"},
}

#: Differences Cadence makes on purpose, with the reason the docs give: counted as covered, still listed.
#: Keys: "<Lightning name>(<parameter>)" or "<Lightning name>.<member>".
#: Only what the README documents with its reason belongs here.
DELIBERATE: dict[str, str] = {
    "lightning.pytorch.strategies.DDPStrategy(start_method)":
        "Cadence spawns the workers (or joins torchrun's group) and never re-runs the user's script",
    "lightning.pytorch.strategies.DDPStrategy(gradient_as_bucket_view)": "on: it saves a copy of the gradients",
    "lightning.pytorch.strategies.DDPStrategy(find_unused_parameters)":
        "None: off, and on in manual optimization, where toggled optimizers leave parameters without gradients",
}

#: The classes whose public methods Cadence's base classes may lack: a one-batch fit defines each
#: missing one on a subclass, and a hook named in the warning it emits counts as refused.
HOOK_CLASSES = {"module": "lightning.pytorch.LightningModule", "callback": "lightning.pytorch.Callback"}
