"""Lightning's ``ModelPruning``: prune the module's weights with ``torch.nn.utils.prune`` as it trains.

At the end of each training epoch (or validation epoch, ``prune_on_train_epoch_end=False``) the
callback prunes ``amount`` of the chosen parameters (a fraction or a count; or a function of the
epoch), globally across them (``use_global_unstructured``) or layer by layer; with the lottery
ticket hypothesis, the weights that remain are reset to their values when fit began (or to new
random ones, ``resample_parameters``). torch's pruning keeps ``weight_orig`` and ``weight_mask``
and computes ``weight`` before each forward; ``make_pruning_permanent`` folds the mask into the
weights when training ends, and in each checkpoint written (a copy: training goes on with the
masks), so that a checkpoint loads into the plain module.

Under DDP every rank keeps rank zero's masks (a random method draws them once, on rank zero, so
the ranks train the same model); under FSDP, whose ranks hold shards, it is refused. ``verbose``
logs the sparsity (1: overall, 2: per layer) on rank zero to the ``"cadence"`` logger, with
Lightning's words. Nothing runs per step but torch's mask multiply in the pruned layers' forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from copy import deepcopy
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils.prune as pytorch_prune
from torch import nn

from callbacks.base import Callback
from callbacks.console import cadence_logger, MisconfigurationException

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

_PRUNING_FUNCTIONS = {
    "ln_structured": pytorch_prune.ln_structured, "l1_unstructured": pytorch_prune.l1_unstructured,
    "random_structured": pytorch_prune.random_structured, "random_unstructured": pytorch_prune.random_unstructured,
}
_PRUNING_METHODS = {
    "ln_structured": pytorch_prune.LnStructured, "l1_unstructured": pytorch_prune.L1Unstructured,
    "random_structured": pytorch_prune.RandomStructured, "random_unstructured": pytorch_prune.RandomUnstructured,
}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class ModelPruning(Callback):
    """Prune parameters during training with ``torch.nn.utils.prune`` (Lightning's arguments and defaults).

    Args:
        pruning_fn: ``"l1_unstructured"``, ``"random_unstructured"``, ``"ln_structured"``,
            ``"random_structured"``, or a ``torch.nn.utils.prune.BasePruningMethod`` subclass (the
            class, with ``use_global_unstructured=True``).
        parameters_to_prune: ``[(module, "weight"), ...]``; empty (default): every ``parameter_names``
            parameter of every layer of the module.
        parameter_names: which parameters to prune when ``parameters_to_prune`` is empty:
            ``["weight", "bias"]`` (default) or one of them.
        use_global_unstructured: rank the parameters together (default) rather than each alone.
        amount: a fraction in [0, 1] or a number of parameters to prune, or a function of the epoch
            returning one; 0 prunes nothing that epoch.
        apply_pruning: prune (True), or a function of the epoch saying whether to.
        make_pruning_permanent: fold the masks into the weights at the end of training and in each
            checkpoint (default True).
        use_lottery_ticket_hypothesis: after pruning, reset the remaining weights to their values at
            the start (True, default), or a function of the epoch saying whether to.
        resample_parameters: reset them to newly drawn values instead (the layer's ``reset_parameters``).
        pruning_dim, pruning_norm: the dimension (structured methods) and the norm (``ln_structured``).
        verbose: 0, 1 (log the overall sparsity after each pruning), 2 (and each layer's).
        prune_on_train_epoch_end: prune at the end of the training epoch (default), else at the end
            of each validation epoch of fit.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self, pruning_fn: Callable | str, parameters_to_prune: Sequence[tuple[nn.Module, str]] = (),
        parameter_names: list[str] | None = None, use_global_unstructured: bool = True,
        amount: int | float | Callable[[int], int | float] = 0.5, apply_pruning: bool | Callable[[int], bool] = True,
        make_pruning_permanent: bool = True, use_lottery_ticket_hypothesis: bool | Callable[[int], bool] = True,
        resample_parameters: bool = False, pruning_dim: int | None = None, pruning_norm: int | None = None,
        verbose: int = 0, prune_on_train_epoch_end: bool = True,
    ) -> None:
        self._use_global_unstructured = use_global_unstructured
        self._parameters_to_prune = parameters_to_prune
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        self._parameter_names = parameter_names or self.PARAMETER_NAMES
        self._global_kwargs: dict[str, Any] = {}
        self._original_layers: dict[int, dict[str, Any]] | None = None
        self._logs_here = True  # rank zero logs the sparsity
        for name in self._parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise MisconfigurationException(
                    f"ModelPruning(parameter_names=[{name!r}]): The provided `parameter_names` name: "
                    f"{name} isn't in {self.PARAMETER_NAMES}; name the parameters to prune by these.")
        if isinstance(pruning_fn, str):
            pruning_fn = self._named_pruning_fn(pruning_fn.lower(), pruning_dim, pruning_norm)
        elif self._is_pruning_method(pruning_fn):
            if not use_global_unstructured:
                raise MisconfigurationException(
                    f"ModelPruning(pruning_fn={pruning_fn.__name__}, use_global_unstructured=False): a "
                    "PyTorch `BasePruningMethod` is currently only supported with "
                    "`use_global_unstructured=True`; pass that, or one of the named methods.")
            self._pruning_method_name = pruning_fn.__name__
        else:
            raise MisconfigurationException(
                f"ModelPruning(pruning_fn={pruning_fn!r}): `pruning_fn` is expected to be a str in "
                f"{list(_PRUNING_FUNCTIONS)} or a PyTorch `BasePruningMethod`. HINT: if passing a "
                "`BasePruningMethod`, pass the class, not an instance.")
        if use_global_unstructured and pruning_fn.PRUNING_TYPE != "unstructured":
            raise MisconfigurationException(
                f"ModelPruning: Only the \"unstructured\" PRUNING_TYPE is supported with "
                f"`use_global_unstructured=True`; {self._pruning_method_name} is "
                f"{pruning_fn.PRUNING_TYPE}. Pass use_global_unstructured=False to prune each layer alone.")
        self.pruning_fn = pruning_fn
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        if isinstance(amount, bool) or not (isinstance(amount, (int, float)) or callable(amount)):
            raise MisconfigurationException(
                f"ModelPruning(amount={amount!r}): `amount` should be provided and be either an int "
                "(a number of parameters), a float (a fraction) or a function of the epoch.")
        self.amount = amount
        if verbose not in (0, 1, 2):
            raise MisconfigurationException(f"ModelPruning(verbose={verbose!r}): `verbose` must be any of (0, 1, 2).")
        self._verbose = verbose

    def _named_pruning_fn(self, name: str, dim: int | None, norm: int | None) -> Callable:
        """torch's method class (global pruning) or function (layer by layer) of that name, with its dim and norm."""
        if name not in _PRUNING_FUNCTIONS:
            raise MisconfigurationException(
                f"ModelPruning(pruning_fn={name!r}): The provided `pruning_fn` {name} isn't available in "
                f"PyTorch's built-in functions: {list(_PRUNING_FUNCTIONS)}; or pass a "
                "BasePruningMethod subclass.")
        kwargs: dict[str, Any] = {}
        if name.endswith("_structured"):
            if dim is None:
                raise MisconfigurationException(
                    f"ModelPruning(pruning_fn={name!r}): When requesting `structured` pruning, the "
                    "`pruning_dim` should be provided (the dimension whose slices are pruned: 0 for rows).")
            if name == "ln_structured":
                if norm is None:
                    raise MisconfigurationException(
                        "ModelPruning(pruning_fn='ln_structured'): When requesting `ln_structured` "
                        "pruning, the `pruning_norm` should be provided (1, 2, float('inf'), ...).")
                kwargs["n"] = norm
            kwargs["dim"] = dim
        method = _PRUNING_METHODS[name] if self._use_global_unstructured else _PRUNING_FUNCTIONS[name]
        self._pruning_method_name = _PRUNING_METHODS[name].__name__
        if self._use_global_unstructured:
            self._global_kwargs = kwargs
            return method
        return partial(method, **kwargs)

    @staticmethod
    def _is_pruning_method(method: Any) -> bool:
        return inspect.isclass(method) and issubclass(method, pytorch_prune.BasePruningMethod)

    def filter_parameters_to_prune(self, parameters_to_prune: Sequence[tuple[nn.Module, str]] = ()) -> Sequence[tuple[nn.Module, str]]:
        """Override to choose which of the parameters to prune (the default keeps them all)."""
        return parameters_to_prune

    @staticmethod
    def sanitize_parameters_to_prune(pl_module: nn.Module, parameters_to_prune: Sequence[tuple[nn.Module, str]] = (),
                                     parameter_names: Sequence[str] = ()) -> Sequence[tuple[nn.Module, str]]:
        """``parameters_to_prune`` checked against ``pl_module``; when empty, every ``parameter_names``
        parameter (an ``nn.Parameter``) of each of its layers that is not a container."""
        names = parameter_names or ModelPruning.PARAMETER_NAMES
        layers = [m for m in pl_module.modules() if m is not pl_module and not isinstance(m, _CONTAINERS)]
        if not parameters_to_prune:
            return [(m, name) for name in names for m in layers if isinstance(getattr(m, name, None), nn.Parameter)]
        pairs = isinstance(parameters_to_prune, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], nn.Module) and isinstance(p[1], str)
            for p in parameters_to_prune)
        if not pairs:
            raise MisconfigurationException(
                "ModelPruning: The provided `parameters_to_prune` should either be list of tuple with 2 "
                "elements: (nn.Module, parameter_name_to_prune) or None; e.g. [(model.fc, \"weight\")].")
        missing_modules = [m for m, _ in parameters_to_prune if not any(m is layer for layer in layers)]
        missing_parameters = [n for m, n in parameters_to_prune if m not in missing_modules and not hasattr(m, n)]
        if missing_modules or missing_parameters:
            raise MisconfigurationException(
                "ModelPruning: Some provided `parameters_to_prune` don't exist in the model. Found missing "
                f"modules: {missing_modules} and missing parameters: {missing_parameters}. Name layers of "
                "the module being trained (made before the callback, the same objects).")
        return parameters_to_prune

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage == "fit" and not trainer.strategy.whole_state_on_rank_zero:
            raise MisconfigurationException(
                "ModelPruning needs the whole model on each process; under strategy=\"fsdp\" each holds a "
                "shard. Use strategy=\"ddp\" (or one device) to prune.")
        if stage == "fit" and trainer.strategy.launches_subprocesses and not self._make_pruning_permanent:
            raise MisconfigurationException(
                "ModelPruning(make_pruning_permanent=False) under a DDP that starts its own processes: the "
                "trained weights come back to this process's module, which has no pruning masks, so they "
                "could not be loaded after training. Keep make_pruning_permanent=True, or launch with "
                "torchrun (`torchrun --nproc-per-node=2 your_script.py`).")
        self._logs_here = trainer.is_global_zero
        self._parameters_to_prune = self.filter_parameters_to_prune(
            self.sanitize_parameters_to_prune(module, self._parameters_to_prune, self._parameter_names))
        if self._use_lottery_ticket_hypothesis:  # a copy of each layer as it starts, for the resets
            self._original_layers = {}
            for index, (layer, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(layer), {"data": deepcopy(layer), "names": []})
                entry["names"].append((index, name))

    # --- when to prune ----------------------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._prune_on_train_epoch_end:
            self._run_pruning(trainer, trainer.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if not self._prune_on_train_epoch_end and not trainer.sanity_checking and trainer.stage == "fit":
            self._run_pruning(trainer, trainer.current_epoch)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(module)

    def _run_pruning(self, trainer: Trainer, epoch: int) -> None:
        prune = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not prune or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        reset = lottery(epoch) if callable(lottery) else lottery
        if reset:
            self.apply_lottery_ticket_hypothesis()
        if trainer.world_size > 1:  # a random method drew other masks on each rank, and the starting
            self._share_from_rank_zero(trainer, reset)  # weights a reset restores may differ too

    def _share_from_rank_zero(self, trainer: Trainer, weights: bool) -> None:
        """Rank zero's masks (and, after a reset, its weights) on every rank, so that they train one model."""
        suffixes = ("_mask", "_orig") if weights else ("_mask",)
        tensors = [getattr(layer, name + suffix) for layer, name in self._parameters_to_prune for suffix in suffixes]
        shared = trainer.strategy.broadcast_object([t.detach().cpu() for t in tensors], 0)
        with torch.no_grad():
            for tensor, value in zip(tensors, shared):
                tensor.copy_(value)

    # --- pruning ------------------------------------------------------------------------------
    def apply_pruning(self, amount: int | float) -> None:
        """Prune ``amount`` of ``parameters_to_prune`` now."""
        before = [self._pruned_stats(m, n) for m, n in self._parameters_to_prune] if self._verbose else []
        if self._use_global_unstructured:
            self._global_kwargs["amount"] = amount
            accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
            kwargs = {k: v for k, v in self._global_kwargs.items() if k in accepted}
            pytorch_prune.global_unstructured(self._parameters_to_prune, pruning_method=self.pruning_fn, **kwargs)
        else:
            for layer, name in self._parameters_to_prune:
                self.pruning_fn(layer, name=name, amount=amount)
        if self._verbose:
            self._log_sparsity_stats(before, [self._pruned_stats(m, n) for m, n in self._parameters_to_prune], amount)

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Reset the parameters that remain to their values when fit began (or, with
        ``resample_parameters``, to new values from the layer's ``reset_parameters``); masks stay."""
        for entry in self._original_layers.values():
            original = entry["data"]
            if self._resample_parameters and callable(getattr(original, "reset_parameters", None)):
                original = deepcopy(original)  # the first values stay for the next reset
                original.reset_parameters()
            for index, name in entry["names"]:
                layer, _ = self._parameters_to_prune[index]
                target = getattr(layer, name + "_orig", None)
                target = getattr(layer, name) if target is None else target
                source = getattr(original, name)
                if isinstance(target, torch.Tensor) and isinstance(source, torch.Tensor):
                    with torch.no_grad():
                        target.copy_(source)

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Fold every pruning mask in ``module`` into its weights and remove torch's pruning hooks."""
        for layer in module.modules():
            for key, hook in list(layer._forward_pre_hooks.items()):
                if isinstance(hook, pytorch_prune.BasePruningMethod):
                    hook.remove(layer)
                    del layer._forward_pre_hooks[key]

    @staticmethod
    def _pruned_stats(layer: nn.Module, name: str) -> tuple[int, int]:
        mask = getattr(layer, name + "_mask", None)
        return (0, 1) if mask is None else (int((mask == 0).sum()), mask.numel())

    def _log_sparsity_stats(self, before: list[tuple[int, int]], after: list[tuple[int, int]], amount: int | float) -> None:
        if not self._logs_here:
            return
        log, total = cadence_logger(), sum(size for _, size in after)
        zeros_before, zeros_after = sum(z for z, _ in before), sum(z for z, _ in after)
        log.info(f"Applied `{self._pruning_method_name}`. Pruned: {zeros_before}/{total} ({zeros_before / total:.2%}) "
                 f"-> {zeros_after}/{total} ({zeros_after / total:.2%})")
        if self._verbose == 2:
            for (layer, name), (was, size), (now, _) in zip(self._parameters_to_prune, before, after):
                log.info(f"Applied `{self._pruning_method_name}` to `{layer!r}.{name}` with amount={amount}. Pruned: "
                         f"{was} ({was / size:.2%}) -> {now} ({now / size:.2%})")

    # --- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """With ``make_pruning_permanent``: the checkpoint's weights with the masks folded in (the
        module keeps its masks and goes on training)."""
        if not self._make_pruning_permanent:
            return
        weights = dict(checkpoint["state_dict"])
        for pruned in [key[:-len("_mask")] for key in weights if key.endswith("_mask")]:
            original, mask = weights.pop(pruned + "_orig"), weights.pop(pruned + "_mask")
            weights[pruned] = (mask.to(dtype=original.dtype) * original).detach()
        checkpoint["state_dict"] = weights
