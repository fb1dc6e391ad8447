"""TrainingModule: the hooks a user overrides, and ``self.log``.

Names and meanings follow PyTorch Lightning's ``LightningModule``, so a Lightning user moves by
changing imports. The module keeps no per-step state of its own: ``self.log`` hands values to the
Trainer's metric store, which keeps them on the device until a log step.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class HParams(dict):
    """The hyperparameters saved by ``save_hyperparameters``; keys read as attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; it has {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class TrainingModule(nn.Module):
    """A model plus the steps that train, validate, test and predict with it.

    Override ``training_step`` and ``configure_optimizers``; everything else is optional.

    Example::

        class Regressor(TrainingModule):
            def __init__(self, lr: float = 0.1):
                super().__init__()
                self.save_hyperparameters()
                self.net = nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = F.mse_loss(self.net(x), y)
                self.log("train/loss", loss, prog_bar=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
    """

    def __init__(self) -> None:
        super().__init__()
        # Plain attributes (not Parameters, Buffers or Modules) land in __dict__, so reading them
        # in the hot loop skips nn.Module.__getattr__.
        self._trainer: Trainer | None = None
        self._automatic_optimization = True
        self.hparams = HParams()

    # --- what the Trainer provides ---------------------------------------------------------
    @property
    def trainer(self) -> Trainer | None:
        """The Trainer running this module, or None outside ``fit``/``validate``/``test``/``predict``."""
        return self._trainer

    @property
    def device(self) -> torch.device:
        for parameter in self.parameters():
            return parameter.device
        for buffer in self.buffers():
            return buffer.device
        return torch.device("cpu")

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        """The Trainer's first logger (``self.logger.experiment`` is TensorBoard's SummaryWriter), or None."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        """The Trainer's loggers, or [] outside a run."""
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def automatic_optimization(self) -> bool:
        """False means ``training_step`` calls ``manual_backward`` and steps the optimizers itself."""
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    def optimizers(self) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
        """The optimizers from ``configure_optimizers``: one, or a list when there are several."""
        optimizers = self._require_trainer("optimizers").optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The LR schedulers from ``configure_optimizers``: None, one, or a list."""
        schedulers = [config.scheduler for config in self._require_trainer("lr_schedulers").lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the Trainer, so AMP scaling and DDP work in manual mode."""
        self._require_trainer("manual_backward").run_backward(loss)

    def _require_trainer(self, name: str) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(
                f"{type(self).__name__}.{name}() needs a running Trainer; call it from inside "
                "training_step (or another hook) during Trainer.fit."
            )
        return self._trainer

    # --- logging ---------------------------------------------------------------------------
    def log(
        self,
        name: str,
        value: torch.Tensor | float | int,
        prog_bar: bool = False,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        reduce_fx: str = "mean",
        batch_size: int | None = None,
    ) -> None:
        """Record a scalar metric. It stays on the device; the Trainer reads it at log steps.

        Args:
            name: the metric's key, e.g. ``"train/loss"``.
            value: a one-element tensor or a Python number.
            prog_bar: show it in the progress bar.
            on_step: log the value of each log step. Default: True in training, False elsewhere.
            on_epoch: log its reduction over the epoch. Default: False in training, True elsewhere.
            sync_dist: reduce over processes (DDP) when it is read; costs a collective then.
            reduce_fx: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``, for the epoch value.
            batch_size: weight of this value in the epoch mean (default 1 per call).
        """
        if self._trainer is None:
            return  # outside a run (a unit test calling training_step): nothing to record
        self._trainer.metrics.current.log(name, value, prog_bar, on_step, on_epoch, sync_dist, reduce_fx, batch_size)

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log`` for each item; keyword arguments apply to all."""
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    # --- hyperparameters -------------------------------------------------------------------
    def save_hyperparameters(self, *names: str, ignore: list[str] | str | None = None) -> None:
        """Keep the arguments of the caller's ``__init__`` in ``self.hparams`` (and checkpoints).

        Args:
            names: keep only these arguments (default: all of them).
            ignore: arguments to leave out (a submodule passed in, say).
        """
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            return
        init_args = inspect.getargvalues(caller)
        values = {name: init_args.locals[name] for name in init_args.args if name != "self"}
        if init_args.keywords:
            values.update(init_args.locals[init_args.keywords])
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        chosen = names or tuple(values)
        unknown = [name for name in chosen if name not in values]
        if unknown:
            raise ValueError(
                f"save_hyperparameters{tuple(names)}: {unknown} are not arguments of "
                f"{type(self).__name__}.__init__ (which takes {list(values)})."
            )
        self.hparams.update({name: values[name] for name in chosen if name not in ignored})

    # --- the steps a user writes -----------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | Mapping[str, Any] | None:
        raise NotImplementedError(
            f"{type(self).__name__} does not define training_step(self, batch, batch_idx). "
            "Define it and return the loss tensor (or a dict with a 'loss' key)."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional; log metrics with ``self.log`` (they are averaged over the epoch)."""

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Optional; as ``validation_step``, for ``Trainer.test``."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the prediction for ``batch``; default: ``self(batch)``."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define configure_optimizers(). Return an optimizer, "
            "a list of optimizers, (optimizers, schedulers), or "
            '{"optimizer": ..., "lr_scheduler": ...}.'
        )

    # --- optional data hooks ---------------------------------------------------------------
    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    # --- lifecycle hooks, each a no-op; see Trainer.fit for the order ------------------------
    def configure_model(self) -> None:
        """Build layers late, once per stage, before the model moves (keep it idempotent). Under
        FSDP, layers built here inside ``torch.device("meta")`` are materialized shard by shard."""

    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add plain data to ``checkpoint`` before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` added, before the state is restored."""
