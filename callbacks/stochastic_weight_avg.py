"""Lightning's ``StochasticWeightAveraging``: average the weights of the last epochs, with SWALR.

From epoch ``swa_epoch_start`` (an int, 1-based; or a fraction of ``max_epochs``) the callback
swaps the LR scheduler for ``torch.optim.swa_utils.SWALR`` (annealing to ``swa_lrs`` over
``annealing_epochs``, ``"cos"`` or ``"linear"``) and, at the start of each epoch up to the last,
adds the weights to an equal-weight average (or ``avg_fn``'s), kept on ``device`` (CPU by
default). When the last epoch ends the module takes the averaged weights, and a module with
BatchNorm layers gets their statistics recomputed with them: one pass of ``training_step`` over
the training data, without gradients (torch's ``update_bn`` on the module's own step).

Checkpoints keep the average, the number of averaged models and SWALR's state; a run resumed from
one continues with SWALR (the module's own scheduler is left out, as in Lightning). One optimizer
and at most one scheduler, as in Lightning; under FSDP, whose ranks hold shards, it is refused.

Where Cadence differs from Lightning, on purpose: Lightning runs the BatchNorm pass as one more
epoch (``max_epochs`` grows by one during fit, the epoch is counted and logged); here it runs when
training ends, so ``current_epoch``, checkpoints and logs count the epochs asked for. Nothing runs
per step: the work is once per epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from copy import deepcopy
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR

from callbacks.base import Callback
from callbacks.console import cadence_logger, MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

_AVG_FN = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass
class _EpochScheduler:
    """SWALR as the loop steps schedulers: once per epoch (the fields of ``trainer.lr_scheduler_configs``' items)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    needs_metric: bool = False
    step_with: Any = None  # the module's lr_scheduler_step (its default calls step()), as Lightning steps SWALR


class StochasticWeightAveraging(Callback):
    """Stochastic Weight Averaging (Izmailov et al., 2018) with Lightning's arguments and defaults.

    Args:
        swa_lrs: the SWA learning rate, one float for every parameter group or a list of them.
        swa_epoch_start: the epoch SWA starts, an int >= 1 (1-based), or a float in [0, 1]: that
            fraction of ``max_epochs``.
        annealing_epochs: epochs of annealing from the optimizer's LR to ``swa_lrs`` (10).
        annealing_strategy: ``"cos"`` (default) or ``"linear"``.
        avg_fn: ``avg_fn(averaged, current, n_averaged)`` -> the new average (default: equal weights).
        device: where the average is kept (default ``"cpu"``); None: on the module's device.
    """

    def __init__(self, swa_lrs: float | list[float], swa_epoch_start: int | float = 0.8, annealing_epochs: int = 10,
                 annealing_strategy: Literal["cos", "linear"] = "cos", avg_fn: _AVG_FN | None = None,
                 device: torch.device | str | None = torch.device("cpu")) -> None:
        if (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
                isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1):
            raise MisconfigurationException(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start}): swa_epoch_start should be a "
                ">0 integer or a float between 0 and 1 (the fraction of max_epochs).")
        wrong_float = isinstance(swa_lrs, float) and swa_lrs <= 0
        wrong_list = isinstance(swa_lrs, list) and not all(isinstance(lr, float) and lr > 0 for lr in swa_lrs)
        if not isinstance(swa_lrs, (float, list)) or wrong_float or wrong_list:
            raise MisconfigurationException(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}): The `swa_lrs` should a positive float, or "
                "a list of positive floats (one per parameter group), e.g. 0.01.")
        if annealing_strategy not in ("cos", "linear"):
            raise MisconfigurationException(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}): use \"cos\" or \"linear\".")
        if avg_fn is not None and not callable(avg_fn):
            raise MisconfigurationException(
                "StochasticWeightAveraging: The `avg_fn` should be callable: avg_fn(averaged, current, n).")
        if device is not None and not isinstance(device, (torch.device, str)):
            raise MisconfigurationException(
                f"StochasticWeightAveraging: device is expected to be a torch.device or a str. Found {device}")
        self.n_averaged: Tensor | None = None
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._model_contains_batch_norm: bool | None = None
        self._average_model: nn.Module | None = None
        self._initialized = False
        self._swa_scheduler: SWALR | None = None
        self._scheduler_state: dict | None = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self.momenta: dict[nn.Module, float | None] = {}
        self._max_epochs: int = -1

    @property
    def swa_start(self) -> int:
        """The first SWA epoch, 0-based."""
        return max(self._swa_epoch_start - 1, 0)

    @property
    def swa_end(self) -> int | float:
        """The last epoch, 0-based (infinite with ``max_epochs=-1``)."""
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: nn.Module) -> bool:
        return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in pl_module.modules())

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not trainer.strategy.whole_state_on_rank_zero:
            raise MisconfigurationException(
                "StochasticWeightAveraging needs the whole model on each process; under strategy=\"fsdp\" "
                "each holds a shard (SWA does not currently support sharded models). Use strategy=\"ddp\".")
        self._average_model = deepcopy(module)  # before the module moves to its device

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"StochasticWeightAveraging: SWA currently works with 1 `optimizer`; configure_optimizers "
                f"returned {len(trainer.optimizers)}.")
        if len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationException(
                "StochasticWeightAveraging: SWA currently not supported for more than 1 `lr_scheduler`; "
                f"configure_optimizers returned {len(trainer.lr_scheduler_configs)}.")
        if isinstance(self._swa_epoch_start, float):
            if trainer.max_epochs == -1:
                raise MisconfigurationException(
                    "StochasticWeightAveraging: SWA with `swa_epoch_start` as a float is not supported when "
                    "`max_epochs=-1`. Please provide `swa_epoch_start` as an integer.")
            self._swa_epoch_start = int(trainer.max_epochs * self._swa_epoch_start)
        self._model_contains_batch_norm = self.pl_module_contains_batch_norm(module)
        self._max_epochs = trainer.max_epochs

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        in_swa = self.swa_start <= trainer.current_epoch <= self.swa_end
        if not self._initialized and in_swa:
            self._start(trainer, module)
        if in_swa and trainer.current_epoch > self._latest_update_epoch:
            self.update_parameters(self._average_model, module, self.n_averaged, self._avg_fn)
            self._latest_update_epoch = trainer.current_epoch

    def _start(self, trainer: Trainer, module: TrainingModule) -> None:
        """The first SWA epoch: the average moves to its device, SWALR takes the scheduler's place."""
        self._initialized = True
        self._average_model = self._average_model.to(self._device or module.device)
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(optimizer, swa_lr=self._swa_lrs, anneal_epochs=self._annealing_epochs,
                                    anneal_strategy=self._annealing_strategy,
                                    last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1)
        if self._scheduler_state is not None:  # resumed
            self._swa_scheduler.load_state_dict(self._scheduler_state)
        elif trainer.current_epoch != self.swa_start:
            warn("SWA is initializing after swa_start without any checkpoint data: the average starts now, with "
                 "fewer epochs in it than a run from the start would have.")
        from trainer.stage_metrics import refused_in  # the trainer package imports this one

        step_with = refused_in(module, "lr_scheduler_step")  # no self.log there, as in Lightning
        if trainer.lr_scheduler_configs:
            config = trainer.lr_scheduler_configs[0]
            if config.interval != "epoch" or config.frequency != 1:
                warn(f"SWA is currently only supported every epoch. Found {config}: SWALR replaces it and steps once "
                     "per epoch.")
            if trainer.is_global_zero:
                cadence_logger().info(f"Swapping scheduler `{type(config.scheduler).__name__}` for `SWALR`")
            trainer.lr_scheduler_configs[0] = _EpochScheduler(self._swa_scheduler, step_with=step_with)
        else:
            trainer.lr_scheduler_configs.append(_EpochScheduler(self._swa_scheduler, step_with=step_with))
        if self.n_averaged is None:
            self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long, device=module.device)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """After the last epoch (or any, with ``max_epochs=-1``): the module takes the average, and
        its BatchNorm statistics are recomputed with it."""
        finished = trainer.current_epoch - 1 == self.swa_end or self._max_epochs == -1
        if not finished or self._average_model is None or not self._initialized:
            return
        self.transfer_weights(self._average_model, module)
        # Lightning updates BatchNorm in an extra epoch, which a stop (early stopping, max_steps) at the last one skips.
        stopped = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        if self._model_contains_batch_norm and not stopped:
            self.reset_batch_norm_and_save_state(module)
            try:
                self._batch_norm_pass(trainer, module)
            finally:
                self.reset_momenta()

    def _batch_norm_pass(self, trainer: Trainer, module: TrainingModule) -> None:
        """One pass of ``training_step`` over the training data without gradients: with momentum None,
        BatchNorm's running statistics become the mean over the pass (torch's ``update_bn``)."""
        was_training = module.training
        module.train()
        count = trainer.num_training_batches
        with torch.no_grad(), trainer.metrics.unrecorded():  # its self.log calls record nothing (not an epoch)
            for batch_idx, batch in enumerate(trainer.train_dataloader):
                if batch_idx >= count:
                    break
                module.training_step(trainer.strategy.batch_to_device(batch), batch_idx)
        module.train(was_training)

    @staticmethod
    def transfer_weights(src_pl_module: nn.Module, dst_pl_module: nn.Module) -> None:
        for src_param, dst_param in zip(src_pl_module.parameters(), dst_pl_module.parameters()):
            dst_param.detach().copy_(src_param.to(dst_param.device))

    def reset_batch_norm_and_save_state(self, pl_module: nn.Module) -> None:
        """BatchNorm statistics reset to (0, 1), momentum None (a cumulative mean) until :meth:`reset_momenta`."""
        self.momenta = {}
        for module in pl_module.modules():
            if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
                continue
            module.running_mean = torch.zeros_like(module.running_mean)
            module.running_var = torch.ones_like(module.running_var)
            self.momenta[module] = module.momentum
            module.momentum = None
            module.num_batches_tracked *= 0

    def reset_momenta(self) -> None:
        for bn_module, momentum in self.momenta.items():
            bn_module.momentum = momentum

    @staticmethod
    def update_parameters(average_model: nn.Module, model: nn.Module, n_averaged: Tensor, avg_fn: _AVG_FN) -> None:
        """Add ``model``'s parameters to ``average_model``'s (the first time, copy them)."""
        first = int(n_averaged) == 0  # once per epoch: a host read is fine here
        for p_swa, p_model in zip(average_model.parameters(), model.parameters()):
            p_swa_, p_model_ = p_swa.detach(), p_model.detach().to(p_swa.device)
            p_swa_.copy_(p_model_ if first else avg_fn(p_swa_, p_model_, n_averaged.to(p_swa.device)))
        n_averaged += 1

    @staticmethod
    def avg_fn(averaged_model_parameter: Tensor, model_parameter: Tensor, num_averaged: Tensor) -> Tensor:
        """The equal-weight running mean."""
        return averaged_model_parameter + (model_parameter - averaged_model_parameter) / (num_averaged + 1)

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_averaged": 0 if self.n_averaged is None else int(self.n_averaged),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
            "average_model_state": None if self._average_model is None else self._average_model.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_n_averaged = state_dict["n_averaged"]
        self._latest_update_epoch = state_dict["latest_update_epoch"]
        self._scheduler_state = state_dict["scheduler_state"]
        if self._average_model is not None and state_dict["average_model_state"] is not None:
            self._average_model.load_state_dict(state_dict["average_model_state"])

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written after SWA started holds SWALR's state as its scheduler: it is SWALR's
        to load (when this epoch starts), not the module's scheduler's, which is left out (as in Lightning)."""
        mine = checkpoint.get("callbacks", {}).get(self.state_key) or {}
        if trainer.stage == "fit" and mine.get("scheduler_state") is not None:
            trainer.lr_scheduler_configs.clear()
            checkpoint["lr_schedulers"] = []
