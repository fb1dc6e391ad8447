"""Lightning's ``WeightAveraging`` and ``EMAWeightAveraging``: an averaged copy of the module's weights.

A ``torch.optim.swa_utils.AveragedModel`` of the module is made when fit begins and updated after
optimizer steps (and epochs) that ``should_update`` chooses: by default every step, an equal-weight
average (SWA); ``EMAWeightAveraging`` an exponential moving average (``decay``). As in Lightning:

- validation runs on the averaged weights (they are swapped in at the start of each validation epoch
  and swapped back at its end), and after fit the module holds them;
- a checkpoint written during fit holds the averaged weights under ``state_dict`` (so that loading
  it for inference gets them), the training weights under ``current_model_state`` and the
  ``AveragedModel``'s other state (``n_averaged``) under ``averaging_state``; resuming from it
  restores both copies;
- under DDP every rank keeps the same average (the weights are the same on every rank after each
  step); under FSDP, whose ranks hold shards, it is refused.

The only per-step cost is the update itself, and only on steps that update: the count of averaged
models is kept on the host as well, so that the update does not ask the device whether it is the
first one (torch's ``AveragedModel`` compares a device tensor with 0, a sync per update on a GPU);
with the average on the module's device (the default) an update does not wait for the device.
"""

from __future__ import annotations

import itertools
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn

from callbacks.base import Callback
from callbacks.console import MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class HostCountedAveragedModel(AveragedModel):
    """torch's ``AveragedModel`` whose number of averaged models is also counted on the host.

    torch's ``update_parameters`` asks ``n_averaged == 0`` (a device-to-host copy: on a GPU, a wait
    for the device at every update); this one asks the host's count, and passes ``avg_fn`` /
    ``multi_avg_fn`` the ``n_averaged`` buffer where it lives (what checkpoints keep), so an update
    queues its work and returns. The averaging is torch's (the same functions, the same defaults).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host_count = 0

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self.use_buffers:
            averaged = itertools.chain(self.module.parameters(), self.module.buffers())
            current = itertools.chain(model.parameters(), model.buffers())
        else:
            averaged, current = self.module.parameters(), model.parameters()
        pairs = [(mine.detach(), theirs.detach().to(mine.device)) for mine, theirs in zip(averaged, current)]
        if self.host_count == 0:
            for mine, theirs in pairs:
                mine.copy_(theirs)
        elif self.avg_fn is not None and self.multi_avg_fn is None:
            for mine, theirs in pairs:
                mine.copy_(self.avg_fn(mine, theirs, self.n_averaged.to(mine.device)))
        else:  # torch's default is the equal-weight average: as torch, grouped by device and dtype, with
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}  # foreach kernels on CUDA
            for mine, theirs in pairs:
                group = groups.setdefault((mine.device, mine.dtype), ([], []))
                group[0].append(mine)
                group[1].append(theirs)
            for (device, _), (mine_list, theirs_list) in groups.items():
                count = self.n_averaged.to(device)
                if self.multi_avg_fn is not None or device.type == "cuda":
                    (self.multi_avg_fn or get_swa_multi_avg_fn())(mine_list, theirs_list, count)
                else:
                    for mine, theirs in zip(mine_list, theirs_list):
                        mine.copy_(get_swa_avg_fn()(mine, theirs, count))
        if not self.use_buffers:  # buffers follow the module (BatchNorm statistics are the user's to update)
            for mine, theirs in zip(self.module.buffers(), model.buffers()):
                mine.detach().copy_(theirs.detach().to(mine.device))
        self.n_averaged += 1
        self.host_count += 1

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.host_count = int(self.n_averaged)  # once per load: the checkpoint's count
        return result


def _pairs(average: nn.Module, module: nn.Module) -> Any:
    return zip(itertools.chain(average.parameters(), average.buffers()), itertools.chain(module.parameters(), module.buffers()))


class WeightAveraging(Callback):
    """Keep an :class:`AveragedModel` of the module, updated after each optimizer step (``should_update``).

    Args (Lightning's):
        device: where the average lives; None (default): on the module's device. ``"cpu"`` saves
            accelerator memory at the price of a copy per update.
        use_buffers: average the buffers too (default True, unlike ``AveragedModel``); with False the
            buffers are copied from the module, and BatchNorm statistics are yours to update
            (``torch.optim.swa_utils.update_bn``).
        **kwargs: for ``AveragedModel``: ``avg_fn`` or ``multi_avg_fn`` (default: the equal-weight
            average, SWA).

    Override ``should_update(step_idx=None, epoch_idx=None)`` to choose when to update: it is asked
    with the zero-based index of each optimizer step, and of each training epoch at its end.
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - {"avg_fn", "multi_avg_fn"})
        if unknown:
            raise TypeError(f"{type(self).__name__} got {unknown}: besides device and use_buffers it takes the "
                            "AveragedModel arguments avg_fn or multi_avg_fn.")
        if kwargs.get("avg_fn") is not None and kwargs.get("multi_avg_fn") is not None:
            raise MisconfigurationException(
                f"{type(self).__name__}: pass avg_fn or multi_avg_fn, not both (Only one of avg_fn and "
                "multi_avg_fn should be provided).")
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average_model: AveragedModel | None = None
        # The global step and epoch of the last update: updates happen once per optimizer step
        # (not per batch while accumulating) and once per epoch.
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after optimizer step ``step_idx`` or epoch ``epoch_idx`` (zero-based;
        one of them is given). Default: after every step, never at an epoch's end."""
        return step_idx is not None

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.strategy.whole_state_on_rank_zero:
            raise MisconfigurationException(
                f"{type(self).__name__} needs the whole model on each process; under strategy=\"fsdp\" "
                "each holds a shard. Use strategy=\"ddp\" (or one device) to average weights.")
        if type(module).configure_model is not _base_configure_model(module):
            warn(f"{type(self).__name__} with a module that overrides configure_model: the layers it makes are built "
                 "now, to be averaged, and averaging does not shard them, so memory may run out (You're using the "
                 "WeightAveraging callback with a model that overrides the configure_model callback).")
            module.configure_model()
        # Made before the module moves to its device (and before a checkpoint is restored into it);
        # it follows the module at fit start when no device was given.
        self._average_model = HostCountedAveragedModel(module, device=self._device, use_buffers=self._use_buffers,
                                                       **self._kwargs)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._average_model is not None and self._device is None:
            self._average_model.to(module.device)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # global_step counts optimizer steps: step_idx is the zero-based index of the last one.
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._average_model.update_parameters(module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._average_model.update_parameters(module)
            self._latest_update_epoch = trainer.current_epoch

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """After fit the module holds the averaged weights."""
        if self._average_model.host_count == 0:  # Lightning would copy the weights fit started with
            warn(f"{type(self).__name__}: should_update never allowed an update during this fit, so there is no "
                 "average; the module keeps its trained weights.")
            return
        for average, current in _pairs(self._average_model.module, module):
            current.data.copy_(average.data)

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # Fit's validations run on the average. A validate/test after fit runs on the module as it
        # is: the average after fit, or the weights of the checkpoint it was given.
        if self._average_model is not None and trainer.stage == "fit":
            self._swap_models(module)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._average_model is not None and trainer.stage == "fit":
            self._swap_models(module)

    def _swap_models(self, module: TrainingModule) -> None:
        for average, current in _pairs(self._average_model.module, module):
            kept = average.data.clone()
            average.data.copy_(current.data)
            current.data.copy_(kept)

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """The averaged weights under ``state_dict``, the training ones under ``current_model_state``."""
        if self._average_model is None:
            return  # outside fit: the module's weights (after fit, the average) as they are
        average_state = self._average_model.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {name[len("module."):]: value for name, value in average_state.items()
                                    if name.startswith("module.")}
        checkpoint["averaging_state"] = {name: value for name, value in average_state.items()
                                         if not name.startswith("module.")}

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Resume both copies: the average from ``state_dict``, the module from ``current_model_state``
        (as in Lightning, the module has been given ``checkpoint["state_dict"]``, the average, before this
        hook: it is given its training weights again here, through the strategy)."""
        if trainer.stage != "fit":
            return  # validate/test/predict(ckpt_path=...): the module gets the averaged weights
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            average_state = {"module." + name: value for name, value in checkpoint["state_dict"].items()}
            self._average_model.load_state_dict({**average_state, **checkpoint["averaging_state"]})
            trainer.strategy.load_module_state_dict(module, checkpoint["current_model_state"])
        else:
            warn(f"{type(self).__name__}: the checkpoint was not written with weight averaging, so the average "
                 "starts from its weights (The checkpoint was not created with WeightAveraging).")
            self._average_model.module.load_state_dict(deepcopy(checkpoint["state_dict"]), strict=False)


def _base_configure_model(module: nn.Module) -> Any:
    """TrainingModule's own configure_model (callbacks do not import the trainer package)."""
    for klass in type(module).__mro__:
        if klass.__name__ == "TrainingModule" and "configure_model" in vars(klass):
            return klass.configure_model
    return None


class EMAUpdate:
    """torch's ``get_ema_avg_fn(decay)`` as an object that pickles, so that DDP's spawned processes
    get it: ``decay * average + (1 - decay) * current``."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: torch.Tensor, current_param: torch.Tensor, num_averaged: Any) -> torch.Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights: ``average = decay * average + (1 - decay) * weights``.

    Args (Lightning's): ``device``, ``use_buffers`` as :class:`WeightAveraging`; ``decay`` (0.999);
    ``update_every_n_steps`` (1: after every optimizer step whose zero-based index it divides);
    ``update_starting_at_step`` (None: from the first; else from that step index on);
    ``update_starting_at_epoch`` (None: no updates at epoch ends; else at the end of each epoch from
    that one on).
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, decay: float = 0.999,
                 update_every_n_steps: int = 1, update_starting_at_step: int | None = None,
                 update_starting_at_epoch: int | None = None, **kwargs: Any) -> None:
        if not 0.0 <= decay <= 1.0:
            raise MisconfigurationException(
                f"EMAWeightAveraging(decay={decay}): use a value in [0, 1] (0.999 is usual).")
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=EMAUpdate(decay))
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return epoch_idx is not None and self.update_starting_at_epoch is not None and epoch_idx >= self.update_starting_at_epoch
