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

from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset

from trainer.data_hooks import DataHooks
from trainer.module import HParams, TrainingModule

if TYPE_CHECKING:
    from trainer.trainer import Trainer


class DataModule(DataHooks):
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
        self.hparams = HParams()
        self._log_hyperparams = True  # save_hyperparameters(logger=False): keep them from the loggers

    # The same function as TrainingModule's: it reads the arguments of the caller's __init__.
    save_hyperparameters = TrainingModule.save_hyperparameters

    # --- the hooks, in the order the Trainer calls them: prepare_data (DataHooks), setup, the
    # *_dataloader hooks (DataHooks), teardown -------------------------------------------------
    def setup(self, stage: str) -> None:
        """Build the datasets for ``stage`` (``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``)."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built, at the end of ``stage`` (also after an error)."""

    # --- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts, tensors) to keep in checkpoints."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read what ``state_dict`` returned, when a checkpoint is restored."""

    @classmethod
    def from_datasets(cls, train_dataset: Dataset | None = None, val_dataset: Any = None, test_dataset: Any = None,
                      predict_dataset: Any = None, batch_size: int = 1, num_workers: int = 0) -> DataModule:
        """A DataModule serving ready-made datasets (Lightning's ``from_datasets``). ``val_dataset``,
        ``test_dataset`` and ``predict_dataset`` may be lists (or dicts) of datasets: one loader each.
        The training loader shuffles; the others keep the order."""
        return _DatasetsDataModule(train_dataset, val_dataset, test_dataset, predict_dataset, batch_size, num_workers)


def overrides(obj: Any, hook: str) -> bool:
    """True when ``obj``'s class defines ``hook`` itself instead of inheriting the base's default."""
    if getattr(obj, hook, None) is None:  # Lightning's idiom: model.val_dataloader = None turns the hook off
        return False
    base = DataModule if isinstance(obj, DataModule) else TrainingModule
    return hook in vars(obj) or getattr(type(obj), hook) is not getattr(base, hook)


class _DatasetsDataModule(DataModule):
    """What :meth:`DataModule.from_datasets` returns; defined here so that spawned DDP workers can
    unpickle it."""

    def __init__(self, train: Any, val: Any, test: Any, predict: Any, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.datasets = {"train": train, "val": val, "test": test, "predict": predict}
        self.batch_size, self.num_workers = batch_size, num_workers

    def _loaders(self, kind: str) -> Any:
        datasets = self.datasets[kind]
        if isinstance(datasets, dict):
            return {name: self._loader(kind, dataset) for name, dataset in datasets.items()}
        if isinstance(datasets, (list, tuple)):
            return [self._loader(kind, dataset) for dataset in datasets]
        return None if datasets is None else self._loader(kind, datasets)

    def _loader(self, kind: str, dataset: Any) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=kind == "train", num_workers=self.num_workers)

    def train_dataloader(self) -> Any:
        return self._loaders("train")

    def val_dataloader(self) -> Any:
        return self._loaders("val")

    def test_dataloader(self) -> Any:
        return self._loaders("test")

    def predict_dataloader(self) -> Any:
        return self._loaders("predict")
