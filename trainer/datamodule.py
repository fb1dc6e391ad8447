"""DataModule: the data of a run in one class (PyTorch Lightning's ``LightningDataModule``).

The Trainer calls its hooks in Lightning's order, in every process of the run::

    prepare_data()      once per machine (local rank zero), or once in all (global rank zero) when
                        prepare_data_per_node is False; before any process sets up
    setup(stage)        every process: build the datasets ("fit", "validate", "test" or "predict")
    *_dataloader()      after setup, when the stage needs its loaders
    teardown(stage)     every process, at the end of the stage (after an error too)

``state_dict`` is kept in checkpoints and handed to ``load_state_dict`` when one is restored.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainer.data_hooks import DataHooks
from trainer.hparams import HyperparametersMixin
from trainer.loading import class_only_method, load_datamodule
from trainer.module import TrainingModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class DataModule(HyperparametersMixin, DataHooks):
    """Where a run's data comes from: download it, build the datasets, hand out the loaders.

    Override ``setup`` and the ``*_dataloader`` hooks the stages you run need; everything else
    is optional.

    Example::

        class MNISTData(DataModule):
            def __init__(self, batch_size: int = 64):
                super().__init__()
                self.save_hyperparameters()

            def prepare_data(self):          # download once per machine; set no state here
                MNIST(".", download=True)

            def setup(self, stage):          # every process: build the datasets
                full = MNIST(".", train=True, transform=ToTensor())
                self.train_set, self.val_set = random_split(full, [55000, 5000])

            def train_dataloader(self):
                return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

            def val_dataloader(self):
                return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

        trainer.fit(model, datamodule=MNISTData())   # or trainer.fit(model, MNISTData())
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None  # the Trainer that last ran with it
        self._init_hparams()  # an empty hparams, which save_hyperparameters (trainer/hparams.py) fills

    #: Lightning's: a name for it (None: none given), and the checkpoint keys of its hyperparameters.
    name: str | None = None
    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"
    CHECKPOINT_HYPER_PARAMS_TYPE = "datamodule_hparams_type"

    # --- the hooks, in the order the Trainer calls them: prepare_data (DataHooks), setup, the
    # *_dataloader hooks (DataHooks), teardown -------------------------------------------------
    def setup(self, stage: str) -> None:
        """Build the datasets for ``stage`` (``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``)."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built, at the end of ``stage`` (also after an error)."""

    def on_exception(self, exception: BaseException) -> None:
        """The running stage raised ``exception`` (after the callbacks' ``on_exception``, as in Lightning)."""

    # --- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts, tensors) to keep in checkpoints."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read what ``state_dict`` returned, when a checkpoint is restored."""

    @classmethod
    def from_datasets(cls, train_dataset: Dataset | None = None, val_dataset: Any = None, test_dataset: Any = None,
                      predict_dataset: Any = None, batch_size: int = 1, num_workers: int = 0,
                      **datamodule_kwargs: Any) -> DataModule:
        """A ``cls`` serving ready-made datasets (Lightning's ``from_datasets``). ``val_dataset``,
        ``test_dataset`` and ``predict_dataset`` may be lists (or dicts) of datasets: one loader each.
        The training loader shuffles (unless it is an IterableDataset); the others keep the order.
        ``cls(**datamodule_kwargs)`` is built, with ``batch_size`` and ``num_workers`` when its
        ``__init__`` takes them."""
        parameters = inspect.signature(cls.__init__).parameters
        takes_any = any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values())
        special = {name: value for name, value in (("batch_size", batch_size), ("num_workers", num_workers))
                   if takes_any or name in parameters}
        datamodule = cls(**datamodule_kwargs, **special)
        for kind, datasets in (("train", train_dataset), ("val", val_dataset), ("test", test_dataset),
                               ("predict", predict_dataset)):
            if datasets is not None:  # a module-level function: spawned DDP workers unpickle it
                setattr(datamodule, f"{kind}_dataloader", functools.partial(_loaders, kind, datasets, batch_size,
                                                                            num_workers))
        return datamodule

    @class_only_method
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, map_location: Any = None,
                             hparams_file: str | os.PathLike | None = None, weights_only: bool | None = None,
                             **kwargs: Any) -> DataModule:
        """A new DataModule built from the hyperparameters a checkpoint kept of the run's DataModule
        (``save_hyperparameters``), with ``kwargs`` replacing saved ones, and its ``state_dict``
        loaded, as in Lightning. ``map_location``, ``hparams_file`` and ``weights_only`` as for
        :meth:`TrainingModule.load_from_checkpoint`."""
        return load_datamodule(cls, checkpoint_path, map_location, hparams_file, weights_only, kwargs)

    def __str__(self) -> str:
        """The loaders of each stage and their datasets' sizes (Lightning's), one line each:
        ``{Train dataloader: size=64}``, ``{Validation dataloader: None}`` (the hook fails or gives none)."""
        lines = []
        for label, hook in (("Train dataloader", "train_dataloader"), ("Validation dataloader", "val_dataloader"),
                            ("Test dataloader", "test_dataloader"), ("Predict dataloader", "predict_dataloader")):
            try:
                loaders = getattr(self, hook)()
            except Exception:  # noqa: BLE001 - a stage not set up yet: Lightning shows None
                loaders = None
            lines.append(f"{{{label}: {_sizes(loaders)}}}")
        return os.linesep.join(lines)


def _sizes(loaders: Any) -> str:
    if isinstance(loaders, DataLoader):
        return f"size={len(loaders.dataset)}" if isinstance(loaders.dataset, Sized) else "size=NA"
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)) and loaders:
        return " ; ".join(f"{i}. {_sizes(loader)}" for i, loader in enumerate(loaders, start=1))
    return "None"


def overrides(obj: Any, hook: str) -> bool:
    """True when ``obj`` defines ``hook`` itself (its class, or a function set on it, as ``from_datasets``
    does and as ``model.train_dataloader = lambda: loader`` does) instead of inheriting the base's
    default; as in Lightning, a hook set to None (``model.validation_step = None``) is not there."""
    base = DataModule if isinstance(obj, DataModule) else TrainingModule
    value = getattr(obj, hook, None)
    if value is None:
        return False
    if hook in getattr(obj, "__dict__", {}):  # set on the instance: a wrapper of the default is none (Lightning's rule)
        function = _unwrapped(value)
        return function is not None and function is not getattr(base, hook)
    return getattr(type(obj), hook) is not getattr(base, hook)


def _unwrapped(value: Any) -> Any:
    """The function behind ``value``, as Lightning's ``is_overridden`` looks through ``functools.wraps``
    (``__wrapped__``), ``Mock(wraps=...)`` and ``functools.partial`` to a bound method's function
    (None for a ``Mock`` that wraps nothing: no override, as in Lightning)."""
    value = getattr(value, "__wrapped__", value)
    if type(value).__module__ == "unittest.mock":
        value = value._mock_wraps
    elif isinstance(value, functools.partial):
        value = value.func
    return getattr(value, "__func__", value)


def _loaders(kind: str, datasets: Any, batch_size: int, num_workers: int) -> Any:
    """The loaders ``from_datasets`` serves for ``kind`` (one per dataset of a list or dict)."""
    if isinstance(datasets, Mapping):
        return {name: _loaders(kind, dataset, batch_size, num_workers) for name, dataset in datasets.items()}
    if isinstance(datasets, (list, tuple)):
        return [_loaders(kind, dataset, batch_size, num_workers) for dataset in datasets]
    shuffle = kind == "train" and not isinstance(datasets, IterableDataset)
    return DataLoader(datasets, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)
