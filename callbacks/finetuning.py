"""BaseFinetuning and BackboneFinetuning: freeze parts of a model, then unfreeze them during fit
(Lightning's fine-tuning callbacks).

A subclass of :class:`BaseFinetuning` freezes modules in ``freeze_before_training`` (called at
``setup``, before ``configure_optimizers``, which should then pass only the parameters that
require grad) and, at the start of every epoch, ``finetune_function`` may unfreeze modules and add
their parameters to the optimizer as a new param group (``unfreeze_and_add_param_group``).

The param groups added so far, by parameter name, and which parameters train are this callback's
checkpoint state. A run resumed from a checkpoint gets the same param groups back before the
optimizer's state is loaded into them (``on_load_checkpoint``; Lightning rebuilds them in
``on_fit_start``, which in Cadence comes after the optimizer state is restored), and the same
parameters train: the unfrozen ones stay unfrozen (Lightning leaves them as
``freeze_before_training`` froze them, so a resumed run stops training them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.optimizer import Optimizer

from callbacks.console import MisconfigurationException
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

Modules = Module | Iterable[Any]  # a module, or an iterable of modules (nested iterables too)


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default ``lambda_func``: double the backbone's learning rate each epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Freeze modules before training and unfreeze them at chosen epochs; subclass it.

    Override ``freeze_before_training(module)`` (freeze with :meth:`freeze`) and
    ``finetune_function(module, epoch, optimizer)`` (unfreeze with
    :meth:`unfreeze_and_add_param_group`).

    Example::

        class FeatureExtractorFreezeUnfreeze(BaseFinetuning):
            def __init__(self, unfreeze_at_epoch=10):
                super().__init__()
                self._unfreeze_at_epoch = unfreeze_at_epoch

            def freeze_before_training(self, module):
                self.freeze(module.feature_extractor)

            def finetune_function(self, module, current_epoch, optimizer):
                if current_epoch == self._unfreeze_at_epoch:
                    self.unfreeze_and_add_param_group(modules=module.feature_extractor, optimizer=optimizer)

    ``configure_optimizers`` then passes ``filter(lambda p: p.requires_grad, self.parameters())``.
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}  # param groups by name, per optimizer

    # --- what subclasses override ------------------------------------------------------------
    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        """Freeze modules (``self.freeze(...)``); called at setup, before configure_optimizers."""
        raise NotImplementedError(f"{type(self).__name__} must override freeze_before_training(pl_module).")

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: Optimizer) -> None:
        """Unfreeze modules (``self.unfreeze_and_add_param_group(...)``); called at every epoch's start."""
        raise NotImplementedError(f"{type(self).__name__} must override "
                                  "finetune_function(pl_module, epoch, optimizer).")

    # --- the tools ---------------------------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules of ``modules`` (a module or a nested iterable of them), and the parent
        modules that hold parameters themselves."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            flat: list[Module] = []
            for module in modules:
                flat.extend(BaseFinetuning.flatten_modules(module))
            candidates: Iterable[Module] = flat
        else:
            candidates = modules.modules()
        return [module for module in candidates if not list(module.children()) or module._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Generator:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (BatchNorm
        layers' left out unless ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for parameter in module.parameters(recurse=False):  # recurse=False: a parent's own, once
                if parameter.requires_grad == requires_grad:
                    yield parameter

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze ``modules``' parameters (and let BatchNorm layers track running statistics)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for parameter in module.parameters(recurse=False):
                parameter.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        """Freeze ``module``'s own parameters (a BatchNorm layer also stops tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for parameter in module.parameters(recurse=False):
            parameter.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn``, their BatchNorm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable) -> list:
        """``params`` without those ``optimizer`` holds already (with a warning if there were any)."""
        held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        params = list(params)
        kept = [parameter for parameter in params if id(parameter) not in held]
        if len(kept) != len(params):
            warnings.warn(
                "The provided params to be frozen already exist within another group of this optimizer. Those "
                "parameters will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n "
                f"{type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ", stacklevel=3)
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Modules, optimizer: Optimizer, lr: float | None = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their parameters to ``optimizer`` as a new param group.

        Args:
            modules: the module(s) to unfreeze.
            optimizer: the optimizer that gets the new group.
            lr: the group's learning rate; by default the first group's divided by ``initial_denom_lr``.
            initial_denom_lr: see ``lr``.
            train_bn: add the BatchNorm layers' parameters too.
        """
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, list(params))
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    # --- the hooks -----------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: TrainingModule, stage: str) -> None:
        if trainer.world_size > 1 and trainer.is_global_zero:
            warnings.warn(f"{type(self).__name__} under several processes: DistributedDataParallel all-reduces the "
                          "gradients of the parameters that required grad when it wrapped the model, so parameters "
                          "frozen then and unfrozen later train on each process's own gradients. Check that the "
                          "processes' weights stay equal, or fine-tune on one device.", stacklevel=2)
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: TrainingModule) -> None:
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            self._store(pl_module, opt_idx, num_param_groups, optimizer.param_groups)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Rebuild the param groups the checkpointed run had, before its optimizer state is loaded
        into them; what they hold trains again, as it did when the checkpoint was written."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state:
            return
        # Lightning's checkpoints before 1.6 hold the dict itself.
        metadata = state.get("internal_optimizer_metadata", state)
        named = dict(pl_module.named_parameters())
        trained: set[int] = set()
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            if opt_idx in metadata:
                optimizer.param_groups = self._apply_mapping_to_param_groups(metadata[opt_idx], named)
                trained |= {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        if "frozen" in state:  # Cadence's checkpoints say what was frozen when they were written: restore that
            frozen, untracked = set(state["frozen"]["parameters"]), set(state["frozen"]["untracked_batchnorm"])
            for name, parameter in named.items():
                parameter.requires_grad = name not in frozen
            for name, module in pl_module.named_modules():
                if isinstance(module, _BatchNorm):
                    module.track_running_stats = name not in untracked
            return
        # Lightning's name only the param groups: what they hold trains (a BatchNorm left out of them with
        # train_bn=False stays frozen, its statistics too)
        for module in self.flatten_modules(pl_module):
            own = list(module.parameters(recurse=False))
            if own and all(id(parameter) in trained for parameter in own):
                self.make_trainable(module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Add to the state what is frozen now (Cadence's key; Lightning's loader reads only its own): a
        module ``unfreeze_and_add_param_group`` made trainable but left out of the groups (a BatchNorm
        with ``train_bn=False``) tracks its statistics again when the run resumes, as it did here."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None:
            state["frozen"] = {
                "parameters": [name for name, parameter in pl_module.named_parameters() if not parameter.requires_grad],
                "untracked_batchnorm": [name for name, module in pl_module.named_modules()
                                        if isinstance(module, _BatchNorm) and not module.track_running_stats]}

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._internal_optimizer_metadata = state_dict.get("internal_optimizer_metadata", state_dict)

    @staticmethod
    def _apply_mapping_to_param_groups(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        output = []
        for group in param_groups:
            state = {key: value for key, value in group.items() if key != "params"}
            state["params"] = [mapping[parameter] for parameter in group["params"]]
            output.append(state)
        return output

    def _store(self, pl_module: TrainingModule, opt_idx: int, num_param_groups: int,
               current_param_groups: list[dict[str, Any]]) -> None:
        mapping = {parameter: name for name, parameter in pl_module.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(current_param_groups,
                                                                                             mapping)
        elif num_param_groups != len(current_param_groups):  # groups the finetune_function added
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], mapping))


class BackboneFinetuning(BaseFinetuning):
    """Freeze the module's ``backbone`` and unfreeze it at ``unfreeze_backbone_at_epoch``, with a
    learning rate that then grows each epoch (``lambda_func``) up to the rest of the model's.

    Args:
        unfreeze_backbone_at_epoch: the epoch at which the backbone starts training.
        lambda_func: ``epoch -> factor`` for the backbone's learning rate at each later epoch.
        backbone_initial_ratio_lr: the backbone's first learning rate, as a fraction of the model's.
        backbone_initial_lr: the backbone's first learning rate (instead of the ratio).
        should_align: once the backbone's rate would pass the model's, use the model's.
        initial_denom_lr: passed to ``unfreeze_and_add_param_group``.
        train_bn: train the backbone's BatchNorm layers from the start.
        verbose: print both learning rates each epoch.
        rounding: digits of those printed rates.
    """

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata,
                "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def setup(self, trainer: Trainer, pl_module: TrainingModule, stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), Module):
            raise MisconfigurationException(
                f"BackboneFinetuning freezes {type(pl_module).__name__}.backbone, which is not an "
                "nn.Module attribute of it. Name the part to fine-tune `self.backbone`, or subclass "
                "BaseFinetuning to choose the modules.")
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial_backbone_lr = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                                   else current_lr * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial_backbone_lr,
                                              train_bn=self.train_bn, initial_denom_lr=self.initial_denom_lr)
            self._say(current_lr, initial_backbone_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            next_backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and next_backbone_lr > current_lr:
                next_backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = next_backbone_lr
            self.previous_backbone_lr = next_backbone_lr
            self._say(current_lr, next_backbone_lr)

    def _say(self, current_lr: float, backbone_lr: float) -> None:
        if self.verbose:
            print(f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(backbone_lr, self.rounding)}")
