"""Loggers: Lightning's logger interface, and what the file loggers share.

A logger is a callback. The Trainer hands it host values in ``on_log`` (at log steps, epoch
ends and after validation; never per step) and it writes them, on rank zero only. The file
loggers (``CSVLogger``, ``TensorBoardLogger``) build on ``callbacks/async_logger.py``: Lightning's
directories and a background writer thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import MisconfigurationException
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class Logger(Callback):
    """Lightning's logger interface, as a callback. Subclass it to send metrics anywhere.

    Implement :meth:`log_metrics` (and :meth:`log_hyperparams` if you keep them); they are called
    on rank zero only, from the training thread, at log steps, epoch ends and after validation,
    with host floats (never per step). The Trainer adds ``"epoch"`` to every metrics dict, as
    Lightning does (a value logged as ``"step"`` is the step instead: :func:`logger_metrics`). ``trainer.loggers`` lists a run's loggers; ``module.logger`` is the first.

    Example::

        class PrintLogger(Logger):
            def log_metrics(self, metrics, step=None):
                print(step, metrics)
    """

    @property
    def name(self) -> str | None:
        return None

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return None

    @property
    def root_dir(self) -> str | None:
        """Where this logger keeps its versions (None for a logger that has no directory)."""
        return None

    @property
    def group_separator(self) -> str:
        """What separates a metric's group from its name (``train/loss``), as in Lightning."""
        return "/"

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement log_metrics(metrics, step).")

    def log_hyperparams(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        """Record the run's hyperparameters (the module's ``save_hyperparameters`` at fit start)."""

    def save(self) -> None:
        """Write out what is buffered."""

    def finalize(self, status: str) -> None:
        """The run ended (``status`` is ``"success"`` or ``"failed"``): write and close everything."""

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None: ...

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Record the model's graph, traced on ``input_array`` (default ``model.example_input_array``)."""

    # --- the callback side -----------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        params = hyperparameters_to_log(trainer, module)
        if trainer.is_global_zero and (params or saved_hyperparameters(trainer, module)):
            self.log_hyperparams(params)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            self.log_metrics(*logger_metrics(metrics, step, trainer.current_epoch))

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if trainer.is_global_zero and not vars(self).pop("_failed", False):  # once per run, as Lightning
            self.finalize("success")

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        if trainer.is_global_zero:
            self.finalize("failed")
        self._failed = True  # the teardown that follows does not finalize it again as "success"


class DummyExperiment:
    """An experiment whose every method does nothing (``experiment[0].add_image(...)`` included),
    as Lightning's ``DummyExperiment``: it keeps nothing, so an item set is not there to read back."""

    def nop(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends see a plain object
            raise AttributeError(name)
        return self.nop

    def __getitem__(self, index: Any) -> DummyExperiment:
        return self

    def __setitem__(self, *args: Any, **kwargs: Any) -> None:
        pass


class DummyLogger(Logger):
    """Lightning's ``DummyLogger``: a logger that records nothing, for code that needs one to call.

    Every method, its own and any other (``log_text``, ``log_image``...), takes any arguments and
    does nothing; ``experiment`` is a :class:`DummyExperiment`; ``name`` and ``version`` are ``""``."""

    def __init__(self) -> None:
        self._experiment = DummyExperiment()

    @property
    def experiment(self) -> DummyExperiment:
        return self._experiment

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getitem__(self, index: int) -> DummyLogger:
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # private and special names: the Trainer and copy see a plain Logger
            raise AttributeError(name)
        return do_nothing


class LoggerAdapter(Logger):
    """A logger that is not a ``callbacks.Logger``: any object with Lightning's logger methods (a
    ``unittest.mock.Mock``, a class written for Lightning's interface), called as Lightning calls its
    loggers: at each stage's start ``log_hyperparams`` (when there are hyperparameters), ``log_graph``
    and ``save``; at each log ``log_metrics(metrics=..., step=...)`` then ``save``; ``finalize`` at the
    end. ``trainer.logger`` and ``trainer.loggers`` give the object itself (``wrapped``).
    ``Trainer(logger=obj)`` makes one when ``obj`` has a callable ``log_metrics``."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    name = property(lambda self: _plain(getattr(self.wrapped, "name", None), str))
    version = property(lambda self: _plain(getattr(self.wrapped, "version", None), (str, int)))
    save_dir = property(lambda self: _plain(getattr(self.wrapped, "save_dir", None), (str, os.PathLike)))
    log_dir = property(lambda self: _plain(getattr(self.wrapped, "log_dir", None), (str, os.PathLike)))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.wrapped.log_metrics(metrics=metrics, step=step)
        self.wrapped.save()

    def log_hyperparams(self, params: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        self.wrapped.log_hyperparams(params, *args, **kwargs)

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        if input_array is None:  # as Lightning calls it
            self.wrapped.log_graph(model)
        else:
            self.wrapped.log_graph(model, input_array)

    def save(self) -> None:
        self.wrapped.save()

    def finalize(self, status: str) -> None:
        self.wrapped.finalize(status)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.wrapped.after_save_checkpoint(checkpoint_callback)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":  # fit's: after on_fit_start, as Lightning's
            self._start_stage(trainer, module)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._start_stage(trainer, module)

    def _start_stage(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.is_global_zero:
            params = hyperparameters_to_log(trainer, module)
            if params or saved_hyperparameters(trainer, module):
                self.log_hyperparams(params)
            self.log_graph(module)
            self.save()


def as_logger(logger: Any) -> Any:
    """``logger`` as a callback: a :class:`LoggerAdapter` around an object with Lightning's ``log_metrics``
    that is not a callback; anything else unchanged (the caller refuses what is not a callback)."""
    if not isinstance(logger, Callback) and callable(getattr(logger, "log_metrics", None)):
        return LoggerAdapter(logger)
    return logger


def _plain(value: Any, kinds: type | tuple[type, ...]) -> Any:
    """``value`` when it is of ``kinds``, else None (a Mock's attribute nobody set is a Mock)."""
    return value if isinstance(value, kinds) else None


def logger_metrics(metrics: Mapping[str, float], step: int, epoch: int) -> tuple[dict[str, float], int]:
    """The metrics and step a logger gets, as Lightning's logger connector makes them: a value logged as
    ``"step"`` is the step (and leaves the dict, with no ``"epoch"`` added); otherwise ``"epoch"`` is
    added, unless the module logged one itself."""
    if "step" in metrics:
        metrics = dict(metrics)
        return metrics, int(metrics.pop("step"))
    return {"epoch": epoch, **metrics}, step


def saved_hyperparameters(trainer: Trainer, module: TrainingModule) -> bool:
    """Whether the module or the DataModule called ``save_hyperparameters`` (``logger=True``): then, as in
    Lightning, the loggers get ``log_hyperparams`` at each stage's start, also with nothing to record."""
    return any(obj is not None and "_hparams_initial" in vars(obj) and getattr(obj, "_log_hyperparams", True)
               for obj in (module, trainer.datamodule))


def hyperparameters_to_log(trainer: Trainer, module: TrainingModule) -> dict[str, Any]:
    """What the loggers get, as in Lightning: the module's and the DataModule's hyperparameters as
    ``save_hyperparameters`` kept them (``hparams_initial``: later changes to ``hparams`` are not
    logged), each unless saved with ``logger=False``, merged; a name both hold with different values
    is an error."""
    datamodule = trainer.datamodule
    sources = [obj for obj in (module, datamodule) if obj is not None and getattr(obj, "_log_hyperparams", True)]
    merged: dict[str, Any] = {}
    for obj in sources:
        for name, value in getattr(obj, "hparams_initial", obj.hparams).items():
            if name in merged and (type(merged[name]) is not type(value) or merged[name] is not value
                                   and (isinstance(value, torch.Tensor) or merged[name] != value)):
                raise RuntimeError(
                    f"Error while merging hparams: {type(module).__name__} and {type(datamodule).__name__} both save "
                    f"the hyperparameter {name!r}, "
                    f"with different values ({merged[name]!r} and {value!r}), so the loggers cannot record one. "
                    "Rename one, or pass logger=False to one's save_hyperparameters.")
            merged[name] = value
    return merged


def metric_number(key: str, value: Any) -> float:
    """``value`` as a number for ``log_metrics``; a tensor is read to the host (a device sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MisconfigurationException(
                f"log_metrics got a tensor of shape {tuple(value.shape)} for {key!r}; log a scalar.")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationException(
            f"log_metrics got {type(value).__name__} for {key!r}; log a number or a one-element tensor.")
    return value


def plain_hparams(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with values YAML and TensorBoard can hold: numbers, strings, bools, None, lists
    and dicts of those; anything else as its ``repr``."""

    def plain(value: Any) -> Any:
        if isinstance(value, (int, float, str, bool, type(None))):
            return value
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, Mapping):
            return {str(key): plain(item) for key, item in value.items()}
        return repr(value)

    return {str(key): plain(value) for key, value in params.items()}


def write_hparams(directory: Path, hparams: Mapping[str, Any]) -> None:
    """``<directory>/hparams.yaml``, replaced atomically (two loggers may write it)."""
    import yaml  # loaded on the writer thread: importing callbacks stays cheap

    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".hparams.yaml.{threading.get_ident()}.tmp"
    # Keys sorted, as Lightning's yaml.dump writes them (OmegaConf, when installed, keeps their order there)
    temporary.write_text(yaml.safe_dump(plain_hparams(hparams), sort_keys=True))
    os.replace(temporary, directory / "hparams.yaml")


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """What ``experiment.add_*`` is where nothing can be written (other ranks; a CSV file)."""
