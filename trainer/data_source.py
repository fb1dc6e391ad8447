"""Where a stage's loaders come from, checked before anything starts; called after setup.

``fit``, ``validate``, ``test`` and ``predict`` take loaders, a :class:`~trainer.datamodule.DataModule`,
or neither (the module's own ``*_dataloader`` hooks). :func:`collect_data` checks what was given
before any process starts and returns a :class:`DataSource`; the stage's process calls its hooks in
Lightning's order: ``prepare_data`` (:func:`prepare_data`), then ``setup``, and only then the
``*_dataloader`` hooks (:meth:`DataSource.loaders`), so datasets built in ``setup`` exist when the
loaders are made.

Validation, test and prediction take several loaders, as a list or a dict; they run one after the
other (``dataloader_idx`` 0, 1, ...). Training takes one, or several combined (a ``CombinedLoader``:
each batch holds a batch of each, ``trainer/combined_loader.py``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainer.arguments import require_training_module
from trainer.combined_loader import LOADER, MODES as COMBINED_MODES, CombinedLoader, flatten
from trainer.datamodule import DataModule, overrides
from trainer.stage_metrics import refusing
from callbacks.console import MisconfigurationException, PossibleUserWarning, warn

#: The loader kinds, the hook that makes each, and the stages' kinds.
HOOKS = {"train": "train_dataloader", "val": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}
STAGE_KIND = {"validate": "val", "test": "test", "predict": "predict"}
STEPS = {"validate": "validation_step", "test": "test_step"}


class NoLoaderError(MisconfigurationException, TypeError):
    """A stage got no loader and has no hook to make one (a TypeError in Lightning)."""


class NoStepError(MisconfigurationException, TypeError):
    """The stage's step is not defined: Lightning's MisconfigurationException, a TypeError as Cadence's was."""


@dataclasses.dataclass
class DataSource:
    """The loaders of one stage: those given to the Trainer's method (named as its arguments, so
    that an error about one names the argument), else the hooks of the datamodule (when there is
    one) or of the module. Hooks are called by :meth:`loaders`, after setup."""

    stage: str
    module: Any
    datamodule: DataModule | None = None
    train_dataloaders: Any = None  # fit's
    val_dataloaders: Any = None  # fit's
    dataloaders: Any = None  # validate's, test's or predict's
    skip: frozenset[str] = frozenset()  # kinds not to load (a val loader without validation_step)

    def argument(self, kind: str) -> str:
        """The name of the argument that gives ``kind`` loaders: ``train_dataloaders``, ..."""
        if self.stage != "fit":
            return "dataloaders"
        return "train_dataloaders" if kind == "train" else "val_dataloaders"

    def given(self, kind: str) -> Any:
        """What the user passed for ``kind`` ("train", "val", "test" or "predict"); None: ask a hook."""
        if self.stage == "fit":
            return {"train": self.train_dataloaders, "val": self.val_dataloaders}.get(kind)
        return self.dataloaders if kind == STAGE_KIND[self.stage] else None

    def hook_owner(self, kind: str) -> Any:
        """The datamodule or module whose ``*_dataloader`` hook gives ``kind``, or None. As in
        Lightning, a datamodule's hooks replace the module's."""
        if self.given(kind) is not None:
            return None
        owner = self.datamodule if self.datamodule is not None else self.module
        return owner if overrides(owner, HOOKS[kind]) else None

    def defines(self, kind: str) -> bool:
        return kind not in self.skip and (self.given(kind) is not None or self.hook_owner(kind) is not None)

    def from_hook(self, kind: str) -> bool:
        return kind not in self.skip and self.hook_owner(kind) is not None

    def loaders(self, kind: str) -> list[Any]:
        """The ``kind`` loaders, as a list (one item for training); ``[]`` when there are none."""
        if not self.defines(kind):
            return []
        owner = self.hook_owner(kind)
        if owner is None:
            return loader_list(self.given(kind), self.argument_text(kind), several=kind != "train")
        loaders = refusing(self.module, HOOKS[kind], getattr(owner, HOOKS[kind]))  # no self.log there, as in Lightning
        where = f"{type(owner).__name__}.{HOOKS[kind]}()"
        if loaders is None and kind == "val":
            return []
        if loaders is None:
            raise MisconfigurationException(
                f"{where} returned None; return a DataLoader (or another iterable of batches).")
        return loader_list(loaders, where, several=kind != "train")

    def refuse_sequential_training(self) -> None:
        """fit's loader is a ``CombinedLoader(mode="sequential")``: Lightning's refusal (after it counted its batches)."""
        owner = self.hook_owner("train")
        where = f"{type(owner).__name__}.{HOOKS['train']}()" if owner is not None else self.argument_text("train")
        raise MisconfigurationException(
            f"`_FitLoop` does not support the `CombinedLoader(mode=\"sequential\")` mode. The available "
            f"modes are: {[mode for mode in COMBINED_MODES if mode != 'sequential']}. Training takes a "
            f"batch of each loader of {where} at each step: use one of those modes.")

    def argument_text(self, kind: str) -> str:
        """How errors name where ``kind`` loaders were passed: "Trainer.fit(val_dataloaders=...)"."""
        return f"Trainer.{self.stage}({self.argument(kind)}=...)"


def reloadable(data: DataSource | None, stage: str | None) -> None:
    """Raise unless the loaders of the running stage (``data``, None between stages) come from hooks,
    which ``Trainer.reload_dataloaders`` can call again."""
    if data is None:
        raise RuntimeError("Trainer.reload_dataloaders() remakes the loaders of a running stage: call it from a "
                           "hook (on_fit_start, on_train_epoch_start, on_test_start, ...).")
    kind = "train" if stage == "fit" else STAGE_KIND[stage]
    if not data.from_hook(kind):
        raise MisconfigurationException(
            f"Trainer.reload_dataloaders() cannot remake loaders passed as {data.argument_text(kind)}. "
            f"Return them from {HOOKS[kind]}() of the module or of a DataModule.")


def collect_data(stage: str, module: Any, loaders: Any, val_loaders: Any, datamodule: Any,
                 previous_datamodule: DataModule | None = None, validates: bool = True) -> DataSource:
    """Check what ``Trainer.<stage>`` was given and return where its loaders come from.

    Args:
        stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
        loaders: ``train_dataloaders`` (fit) or ``dataloaders``; a DataModule here is taken as ``datamodule``.
        val_loaders: fit's ``val_dataloaders``.
        previous_datamodule: the Trainer's datamodule from an earlier call, used by an evaluation
            stage given no data when the module has no hook for it.
        validates: fit validates at all (``limit_val_batches`` is not 0).
    """
    if stage not in ("fit", *STAGE_KIND):  # Trainer.run_search's method
        raise MisconfigurationException(
            f"Trainer.run_search(method={stage!r}): use 'fit', 'validate', 'test' or 'predict'.")
    require_training_module(module, stage)
    argument = "train_dataloaders" if stage == "fit" else "dataloaders"
    if isinstance(loaders, DataModule):  # fit(model, dm), test(model, dm): Lightning takes these too
        if datamodule is not None:
            raise MisconfigurationException(
                f"Trainer.{stage} got a DataModule as {argument} and another as datamodule; pass one.")
        loaders, datamodule = None, loaders
    if datamodule is not None:
        if not isinstance(datamodule, DataModule):
            raise TypeError(f"Trainer.{stage}(datamodule=...) takes a trainer.DataModule; got "
                            f"{type(datamodule).__name__}. Subclass DataModule, or pass loaders as {argument}.")
        if loaders is not None or val_loaders is not None:
            raise MisconfigurationException(
                f"Trainer.{stage} got both loaders and a datamodule; pass the loaders, or let the "
                "datamodule's *_dataloader hooks make them.")
    kind = STAGE_KIND.get(stage, "train")
    if (stage != "fit" and datamodule is None and loaders is None and not overrides(module, HOOKS[kind])
            and previous_datamodule is not None):
        datamodule = previous_datamodule  # trainer.test() after fit(model, datamodule=dm)
    if stage == "fit":
        data = DataSource(stage, module, datamodule, train_dataloaders=loaders, val_dataloaders=val_loaders)
    else:
        data = DataSource(stage, module, datamodule, dataloaders=loaders)
    for name in ("train", "val") if stage == "fit" else (kind,):  # what was passed is checked now
        if data.given(name) is not None:
            loader_list(data.given(name), data.argument_text(name), several=name != "train")
    if stage == "fit" and isinstance(data.given("train"), CombinedLoader) and data.given("train").mode == "sequential":
        data.refuse_sequential_training()  # passed: before the run starts (from a hook: once counted, as Lightning)
    _check_steps(stage, module)
    if not data.defines(kind):
        owner = f"the datamodule {type(datamodule).__name__}" if datamodule is not None else type(module).__name__
        raise NoLoaderError(f"An invalid dataloader was passed to `Trainer.{stage}({argument}=None)`: Trainer.{stage} "
                            f"got no {argument}, and {owner} defines no {HOOKS[kind]}(). Pass a DataLoader as "
                            f"{argument}, or define {HOOKS[kind]}().")
    if stage == "fit":
        data.skip = _check_validation(module, data, validates)
    return data


def _check_steps(stage: str, module: Any) -> None:
    """An evaluation stage needs its step, and no step takes Lightning's ``dataloader_iter``: raise before anything runs."""
    name = type(module).__name__
    for step in ("training_step", "validation_step") if stage == "fit" else (STEPS.get(stage, "predict_step"),):
        if overrides(module, step) and "dataloader_iter" in _parameters(getattr(module, step)):
            raise TypeError(
                f"{name}.{step}(self, dataloader_iter) takes the loader's iterator (Lightning's experimental step "
                "flavour), which Cadence does not support: its loop fetches each batch, moves it to the device "
                f"(copying the next one ahead on CUDA) and passes it to the step. Write {step}(self, batch, batch_idx); "
                "to move batches yourself, override transfer_batch_to_device; to use several batches in one step, have "
                "the loader yield them together (a larger batch_size or a batch_sampler), or use accumulate_grad_batches.")
    if stage in STEPS and not overrides(module, STEPS[stage]):
        raise NoStepError(f"No `{STEPS[stage]}()` method defined to run `Trainer.{stage}`: "  # Lightning's words first
                        f"Trainer.{stage} runs {name}.{STEPS[stage]}(batch, batch_idx), which {name} does not "
                        f"define. Define it and log metrics with self.log.")
    if stage == "predict" and not overrides(module, "predict_step") and type(module).forward is torch.nn.Module.forward:
        raise TypeError(f"Trainer.predict runs {name}.predict_step, whose default returns self(batch), but {name} "
                        "defines neither predict_step(batch, batch_idx) nor forward. Define one of them.")


def _parameters(step: Any) -> Any:
    try:  # as Lightning reads it: a parameter of that name (not **kwargs); unwrapped, as a profiler wraps steps
        return inspect.signature(inspect.unwrap(step)).parameters
    except (TypeError, ValueError):  # a builtin or C callable
        return {}


def _check_validation(module: Any, data: DataSource, validates: bool) -> frozenset[str]:
    """fit's validation: the kinds to skip, with a warning when loaders and validation_step do not meet."""
    name = type(module).__name__
    if not overrides(module, "validation_step"):
        if data.defines("val") and validates:
            warn(f"You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop: {name} defines "
                 "no validation_step, so its val loaders are not used. Define validation_step, or pass no val_dataloaders.")
        return frozenset({"val"})
    if not data.defines("val") and validates:
        warn(f"You defined a `validation_step` but have no `val_dataloader`. Skipping val loop: {name}'s fit got no "
             "val_dataloaders and no val_dataloader() hook. Pass val_dataloaders=... to fit.", PossibleUserWarning)
    return frozenset() if validates else frozenset({"val"})  # limit_val_batches=0: no val_dataloader() call, as Lightning


def loader_list(value: Any, where: str, several: bool) -> list[Any]:
    """``value`` as a list of loaders: one loader, or a collection of them (a list, tuple or dict, nested
    as you like: Lightning's ``CombinedLoader`` structure). For evaluation (``several``) the loaders run
    one after the other (a ``CombinedLoader`` in ``"sequential"`` mode gives its loaders, in another mode
    it is one loader of combined batches); for training a collection is one ``CombinedLoader`` in
    ``"max_size_cycle"`` mode, as in Lightning (``fit`` refuses ``"sequential"`` once it counted its batches).

    Raises:
        TypeError: something that is not an iterable of batches (a Dataset, a DataModule, a number).
        ValueError: an empty collection for training.
    """
    if isinstance(value, CombinedLoader):
        for index, loader in enumerate(value.flattened):
            _check_loader(loader, f"{where} item {index}")
        return list(value.flattened) if value.mode == "sequential" and several else [value]
    if isinstance(value, (list, tuple, collections.abc.Mapping)) and not value:
        if several:
            return []  # no validation (or nothing to test: the stage says so)
        raise MisconfigurationException(f"{where} got an empty {type(value).__name__}; pass one DataLoader.")
    loaders, structure = flatten(value)  # a list of numbers is one loader; a list of tensors, one of batches
    if structure is LOADER or not all(_is_loader(item) or isinstance(item, (list, tuple, collections.abc.Mapping))
                                      for item in loaders):
        if isinstance(value, collections.abc.Mapping):
            raise TypeError(f"{where} got a {type(value).__name__} that is not a dict of loaders. Pass a DataLoader, "
                            "or a list or dict of DataLoaders.")
        _check_loader(value, where)
        return [value]  # one loader (a list of batches is one too)
    for index, loader in enumerate(loaders):
        _check_loader(loader, f"{where} item {index}")
    if not several:  # each batch holds one of each loader's, in the collection's structure
        return [CombinedLoader(value, "max_size_cycle")]
    return loaders


def _is_loader(value: Any) -> bool:
    """A DataLoader or another iterable of batches, as opposed to a batch (a tensor, tuple, dict)."""
    if isinstance(value, (DataLoader, DataModule, Dataset)):
        return True
    return isinstance(value, collections.abc.Iterable) and not isinstance(
        value, (torch.Tensor, list, tuple, collections.abc.Mapping, str, bytes))


def _check_loader(value: Any, where: str) -> None:
    what = type(value).__name__
    if isinstance(value, DataModule):
        raise TypeError(f"{where} got the DataModule {what} where a loader is expected. Pass it as "
                        "datamodule=... (or as the first argument after the model).")
    if isinstance(value, Dataset) and not isinstance(value, IterableDataset):
        raise TypeError(f"{where} got the dataset {what}, which yields samples, not batches. Wrap it in a "
                        f"DataLoader: DataLoader(dataset, batch_size=...).")
    if not isinstance(value, collections.abc.Iterable) or isinstance(value, (str, bytes)):
        raise TypeError(f"{where} got {what}, which is not a loader. Pass a torch DataLoader or another "
                        "iterable of batches.")


def prepare_data(data: DataSource, strategy: Any, datamodule: DataModule | None) -> None:
    """``prepare_data`` of the ``datamodule`` (the stage's, or as in Lightning an earlier stage's when this
    one was given none), then of the module, in one process per machine (local rank
    zero), or in one in all (global rank zero) when their ``prepare_data_per_node`` is False; every
    process then waits for it, so that none reads data still being written."""
    owners = [owner for owner in (datamodule, data.module) if owner is not None and overrides(owner, "prepare_data")]
    for owner in owners:
        rank = strategy.local_rank if owner.prepare_data_per_node else strategy.global_rank
        if rank == 0:
            owner.prepare_data()
    if owners:
        strategy.barrier("prepare_data")
