"""Build a run from YAML: what ``cadence fit|validate|test|predict --config run.yaml`` reads.

The layout is Lightning's (``LightningCLI``): any object is a ``class_path`` with ``init_args``::

    seed_everything: 0                    # an int; true draws one (written into the saved config)
    model:
      class_path: examples.digits.DigitsClassifier
      init_args: {hidden: 128, lr: 3.0e-3}
    data:                                 # a DataModule, any object with train_dataloader() and
      class_path: examples.digits.DigitsData  # friends, or a function returning the loaders
      init_args: {batch_size: 64}
    trainer:                              # Trainer(**these)
      max_epochs: 30
      callbacks:
        - class_path: callbacks.EarlyStopping     # or just EarlyStopping
          init_args: {monitor: val/acc, mode: max}
    optimizer:                            # only for a module without configure_optimizers
      class_path: torch.optim.AdamW
      init_args: {lr: 1.0e-3}
    lr_scheduler: null                    # likewise, e.g. torch.optim.lr_scheduler.StepLR
    ckpt_path: null                       # a checkpoint, "last", or (not for fit) "best"

Everything is checked against the signatures before anything is built: an unknown key, a missing
argument or a value of the wrong type fails naming the key, the file and line it came from, and
what is accepted. :meth:`Run.resolved` is the same run with every default filled in and every
class path spelled out; ``cadence`` saves it as ``config.yaml`` in the run's log directory, and
``cadence fit --config`` on that file runs the same run again. Class paths import as ``import``
would, with the current directory on the path; a bare name (``EarlyStopping``, ``AdamW``) is
looked up in ``callbacks``, ``strategies``, ``torch.optim`` and ``torch.optim.lr_scheduler``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.cli.config_files import ConfigError, read_config
from trainer.cli.specs import BuildError, Spec, building, checked_kwargs, did_you_mean, make_spec, name_of

#: The top-level keys, in the order a resolved configuration lists them (Lightning's).
SECTIONS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path")
#: The data object's hook for each stage (a DataModule's, or any object's with the same names).
DATA_HOOKS = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
              "predict": "predict_dataloader"}

@dataclass
class Run:
    """A checked run: :meth:`build` makes its objects, :func:`stage_arguments` gives a stage its data."""

    seed_everything: int | bool | None
    trainer: Spec
    model: Spec
    data: Spec | None
    optimizer: Spec | None
    lr_scheduler: Spec | None
    ckpt_path: str | None
    seed_drawn: bool = field(default=False)  # seed_everything was true and a seed was drawn for it

    def with_seed(self) -> Run:
        """This run with ``seed_everything: true`` replaced by a freshly drawn seed."""
        if self.seed_everything is not True:
            return self
        return replace(self, seed_everything=random.SystemRandom().randrange(2**32), seed_drawn=True)

    def resolved(self) -> dict[str, Any]:
        """The whole configuration as plain data: every default filled in, class paths spelled out."""
        trainer = self.trainer.resolved()["init_args"]
        if isinstance(self.seed_everything, int) and not isinstance(self.seed_everything, bool) and trainer.get("seed") is None:
            trainer["seed"] = self.seed_everything
        return {
            "seed_everything": self.seed_everything,
            "trainer": trainer,
            "model": self.model.resolved(),
            "data": self.data.resolved() if self.data is not None else None,
            "optimizer": self.optimizer.resolved() if self.optimizer is not None else None,
            "lr_scheduler": self.lr_scheduler.resolved() if self.lr_scheduler is not None else None,
            "ckpt_path": self.ckpt_path,
        }

    def build(self, extra_callbacks: list[Any] = ()) -> tuple[Any, Any, Any]:
        """Seed, then build the module, the data and the Trainer (with ``extra_callbacks`` after the
        file's). A value that only the built object rejects raises a :class:`BuildError`."""
        from trainer.seed import seed_everything

        seed = self.seed_everything
        if isinstance(seed, int) and not isinstance(seed, bool):
            seed_everything(seed, verbose=False)  # before the module is built: its initial weights follow the seed
        model = building(self.model, self.model.build)
        if self.optimizer is not None:
            model.configure_optimizers = OptimizersFromConfig(model, self.optimizer, self.lr_scheduler)
        data = building(self.data, self.data.build) if self.data is not None else None
        trainer_spec = self.trainer
        if isinstance(seed, int) and not isinstance(seed, bool) and self.trainer.kwargs.get("seed") is None:
            trainer_spec = replace(trainer_spec, kwargs={**trainer_spec.kwargs, "seed": seed})
        if extra_callbacks:
            callbacks = trainer_spec.kwargs.get("callbacks")
            callbacks = [] if callbacks is None else callbacks if isinstance(callbacks, list) else [callbacks]
            trainer_spec = replace(trainer_spec, kwargs={**trainer_spec.kwargs, "callbacks": [*callbacks, *extra_callbacks]})
        trainer = building(trainer_spec, trainer_spec.build)
        return model, data, trainer


class OptimizersFromConfig:
    """``configure_optimizers`` for a module that does not define it: the ``optimizer`` (and
    ``lr_scheduler``) sections, given the module's parameters. Picklable, for DDP's spawn."""

    def __init__(self, module: Any, optimizer: Spec, lr_scheduler: Spec | None) -> None:
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler

    def __call__(self) -> Any:
        optimizer = self.optimizer.build(self.module.parameters())
        if self.lr_scheduler is None:
            return optimizer
        monitor = self.lr_scheduler.kwargs.get("monitor")
        spec = replace(self.lr_scheduler, kwargs={k: v for k, v in self.lr_scheduler.kwargs.items() if k != "monitor"})
        scheduler = {"scheduler": spec.build(optimizer)}
        if monitor is not None:
            scheduler["monitor"] = monitor
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


# =============================================================================================
# Reading and checking
# =============================================================================================
def load_run(paths: list[str | os.PathLike], overrides: list[tuple[str, str]] = ()) -> Run:
    """Read, merge and check a run; nothing is built. Errors name the file and line of the key."""
    config, origins = read_config(paths, overrides, SECTIONS)
    try:
        return check_config(config)
    except ConfigError as error:
        where = origins.of(error.key)
        raise ConfigError(f"{where}: {error}" if where else str(error), error.key) from None


def check_config(config: dict[str, Any]) -> Run:
    """Check every section against the signatures it names; return the run, nothing built yet."""
    from trainer.module import TrainingModule
    from trainer.shorthands import LIGHTNING_ONLY, reject_unknown_arguments
    from trainer.trainer import Trainer

    unknown = [key for key in config if key not in SECTIONS]
    if unknown:
        raise ConfigError(f"Unknown top-level key {unknown[0]!r}{did_you_mean(unknown[0], SECTIONS)}; the keys "
                          f"are {', '.join(SECTIONS)}.", unknown[0])
    if config.get("model") is None:
        raise ConfigError("The config has no 'model' section; add model: {class_path: package.module.YourModule}.")
    model = make_spec("model", config["model"], must_be=TrainingModule)
    data = make_spec("data", config["data"]) if config.get("data") is not None else None
    trainer_args = config.get("trainer") or {}
    if not isinstance(trainer_args, dict):
        raise ConfigError(f"trainer must be a mapping of Trainer arguments; got {type(trainer_args).__name__}.", "trainer")
    lightning_only = next((name for name in trainer_args if name in LIGHTNING_ONLY), None)
    if lightning_only is not None:  # Lightning's argument: say the Cadence way, not just "unknown"
        try:
            reject_unknown_arguments({lightning_only: trainer_args[lightning_only]}, Trainer.__init__)
        except TypeError as error:
            raise ConfigError(f"trainer: {error}", f"trainer.{lightning_only}") from None
    trainer = Spec("trainer", "trainer.Trainer", Trainer, checked_kwargs("trainer", Trainer, trainer_args))
    optimizer = lr_scheduler = None
    if config.get("optimizer") is not None:
        optimizer = make_spec("optimizer", config["optimizer"], positional=1)
        if _defines(model.target, "configure_optimizers"):
            raise ConfigError(f"model {model.target.__qualname__} defines configure_optimizers, so the optimizer "
                              "section would be ignored; remove one of them.", "optimizer")
    if config.get("lr_scheduler") is not None:
        if optimizer is None:
            raise ConfigError("lr_scheduler needs an optimizer section (the scheduler steps that optimizer).", "lr_scheduler")
        lr_scheduler = make_spec("lr_scheduler", config["lr_scheduler"], positional=1, extra=_scheduler_extras)
    return Run(_checked_seed(config.get("seed_everything", True), trainer), trainer, model, data, optimizer,
               lr_scheduler, _checked_ckpt_path(config.get("ckpt_path")))


def _checked_seed(seed: Any, trainer: Spec) -> int | bool | None:
    if seed is False:
        seed = None
    if seed is not None and seed is not True and (not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise ConfigError(f"seed_everything: got {seed!r}; use an int in [0, 2**32 - 1], true (draw one) or false.",
                          "seed_everything")
    trainer_seed = trainer.kwargs.get("seed")
    if trainer_seed is not None:
        if seed not in (None, True, trainer_seed):
            raise ConfigError(f"seed_everything: {seed} and trainer.seed: {trainer_seed} differ; set one of them.",
                              "seed_everything")
        return trainer_seed  # trainer.seed decides; seed_everything: true draws nothing then
    return seed


def _checked_ckpt_path(ckpt_path: Any) -> str | None:
    if ckpt_path is not None and not isinstance(ckpt_path, (str, os.PathLike)):
        raise ConfigError(f"ckpt_path: got {ckpt_path!r}; use a checkpoint path, 'last' or 'best'.", "ckpt_path")
    return None if ckpt_path is None else str(ckpt_path)


def _defines(target: Any, method: str) -> bool:
    from trainer.module import TrainingModule

    return getattr(target, method, None) is not getattr(TrainingModule, method)


def _scheduler_extras(target: Any) -> set[str]:
    import torch

    # ReduceLROnPlateau needs the metric it watches; it is not an argument of the class.
    return {"monitor"} if issubclass(target, torch.optim.lr_scheduler.ReduceLROnPlateau) else set()


# =============================================================================================
# Data for each stage
# =============================================================================================
def is_datamodule(data: Any) -> bool:
    """A DataModule, or any object with its loader hooks (``train_dataloader()`` and friends)."""
    return any(callable(getattr(data, hook, None)) for hook in DATA_HOOKS.values())


def stage_arguments(stage: str, model: Any, data: Any, data_spec: Spec | None) -> dict[str, Any]:
    """The loader arguments of ``Trainer.<stage>`` for the ``data`` object the config built."""
    from trainer.datamodule import DataModule

    if data is None:
        return {}  # the module's own *_dataloader hooks
    if isinstance(data, DataModule):
        return {"datamodule": data}
    if is_datamodule(data):  # any class with loader hooks: its loaders, as the Trainer would get them
        return _datamodule_loaders(stage, data)
    name = name_of(data_spec.target) if data_spec is not None else "data"
    loaders = list(data) if isinstance(data, (list, tuple)) else [data]
    if len(loaders) not in (1, 2):
        raise BuildError(f"data ({name}) returned {len(loaders)} items; return train_loader or (train_loader, val_loader), "
                         "or name a class with train_dataloader(), val_dataloader(), test_dataloader() methods.")
    if stage == "fit":
        return {"train_dataloaders": loaders[0], "val_dataloaders": loaders[1] if len(loaders) == 2 else None}
    if stage == "validate" and len(loaders) == 2:
        return {"dataloaders": loaders[1]}
    if _defines(type(model), DATA_HOOKS[stage]):
        return {}
    raise BuildError(f"data ({name}) returns loaders for fit only; for {stage}, name a class with "
                     f"{DATA_HOOKS[stage]}() in data:, or give the model a {DATA_HOOKS[stage]}() method.")


def _datamodule_loaders(stage: str, data: Any) -> dict[str, Any]:
    """A data object's loaders for ``stage``, as ``Trainer.fit(datamodule=...)`` would get them:
    ``prepare_data()``, ``setup(stage)``, then the hooks."""
    hook = DATA_HOOKS[stage]
    if not callable(getattr(data, hook, None)):
        raise BuildError(f"data ({type(data).__name__}) has no {hook}() for {stage}.")
    for method, arguments in (("prepare_data", ()), ("setup", (stage,))):
        if callable(getattr(data, method, None)):
            getattr(data, method)(*arguments)
    if stage == "fit":
        val = data.val_dataloader() if callable(getattr(data, "val_dataloader", None)) else None
        return {"train_dataloaders": data.train_dataloader(), "val_dataloaders": val}
    return {"dataloaders": getattr(data, hook)()}


def to_yaml(config: dict[str, Any]) -> str:
    """A resolved configuration as YAML, its sections in Lightning's order."""
    import yaml

    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True)
