"""Hyperparameters and ``load_from_checkpoint`` as Lightning's: ``hparams_initial``, a subclass's
``ignore``, one config object kept and passed back under its argument's name, a DataModule rebuilt
from a checkpoint, ``from_datasets`` on a subclass, a DataModule's ``str``."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from linear_regression import LinearRegression
from trainer import DataModule, TrainingModule


class Base(LinearRegression):
    def __init__(self, arg1: int, arg2: int, arg3: int) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="arg1")


class Child(Base):
    def __init__(self, arg1: int, arg2: int, arg3: int) -> None:
        super().__init__(arg1, arg2, arg3)
        self.save_hyperparameters(ignore=("arg2", "arg3"))


def test_hparams_initial_and_a_subclass_ignore_removing_what_the_base_kept():
    module = Child(arg1=14, arg2=90, arg3=50)
    assert dict(module.hparams) == {"arg1": 14}  # the subclass kept arg1 and dropped arg2, arg3
    module.hparams.arg1 = 1
    assert module.hparams_initial == {"arg1": 14} and module.hparams.arg1 == 1
    assert TrainingModule.CHECKPOINT_HYPER_PARAMS_KEY == "hyper_parameters"
    assert DataModule.CHECKPOINT_HYPER_PARAMS_KEY == "datamodule_hyper_parameters"


def test_a_submodule_kept_as_a_hyperparameter_is_warned_about():
    class WithNet(LinearRegression):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match=r"'net' is an instance of `nn.Module`.*ignore=\['net'\]"):
        WithNet(nn.Linear(1, 1))


def test_save_hyperparameters_before_super_init_keeps_them_out_of_the_loggers_as_lightning(make_trainer, tmp_path):
    # An HDN denoiser's module calls self.save_hyperparameters() before super().__init__(). Lightning 2.6.5
    # keeps them (hparams, checkpoint, load_from_checkpoint) but its __init__ turns the logging flag back off:
    # the TensorBoard logger's hparams.yaml is {} (same for a DataModule doing the same).
    from callbacks import TensorBoardLogger

    class Early(LinearRegression):
        def __init__(self, lr: float = 0.1, width: int = 4) -> None:
            self.save_hyperparameters()
            super().__init__(lr=lr)

    class EarlyData(DataModule):
        def __init__(self, dataset, batch_size: int = 16) -> None:
            self.save_hyperparameters(ignore="dataset")
            super().__init__()
            self.dataset = dataset

        def train_dataloader(self):
            return DataLoader(self.dataset, batch_size=self.hparams.batch_size)

    module = Early(lr=0.05)
    data = EarlyData(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)
    assert dict(module.hparams) == {"lr": 0.05, "width": 4} and dict(data.hparams) == {"batch_size": 4}
    trainer = make_trainer(max_epochs=1, logger=TensorBoardLogger(tmp_path, name="run"))
    trainer.fit(module, datamodule=data)
    assert yaml.safe_load((tmp_path / "run" / "version_0" / "hparams.yaml").read_text()) == {}
    trainer.save_checkpoint(tmp_path / "early.ckpt")
    saved = torch.load(tmp_path / "early.ckpt", weights_only=True)
    assert saved["hyper_parameters"] == {"lr": 0.05, "width": 4}
    assert saved["datamodule_hyper_parameters"] == {"batch_size": 4}
    assert Early.load_from_checkpoint(tmp_path / "early.ckpt").lr == 0.05
    # lightning-bolts' VAE.from_pretrained calls it on an instance: Lightning 2.6.5 refuses that, so that
    # `model.load_from_checkpoint(path)` never looks as if it loaded `model` (Cadence returned a new module).
    with pytest.raises(TypeError, match=r"The classmethod `Early.load_from_checkpoint` cannot be called on an instance. "
                                        r"Please call it on the class type and make sure the return value is used."):
        module.load_from_checkpoint(tmp_path / "early.ckpt")
    with pytest.raises(TypeError, match=r"`EarlyData.load_from_checkpoint` cannot be called on an instance"):
        data.load_from_checkpoint(tmp_path / "early.ckpt")


class Configured(LinearRegression):
    def __init__(self, config: Namespace) -> None:
        super().__init__(lr=config.lr)
        self.save_hyperparameters(config)


class Data(DataModule):
    def __init__(self, batch_size: int = 4, num_workers: int = 0, tag: str = "a") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.epochs_seen = 0

    def state_dict(self):
        return {"epochs_seen": 7}

    def load_state_dict(self, state_dict):
        self.epochs_seen = state_dict["epochs_seen"]


def test_config_object_and_datamodule_come_back_from_a_checkpoint(make_trainer, regression_data, tmp_path):
    module = Configured(Namespace(lr=0.05))
    data = Data.from_datasets(regression_data, batch_size=16, tag="b")
    assert type(data) is Data and dict(data.hparams) == {"batch_size": 16, "num_workers": 0, "tag": "b"}
    assert len(data.train_dataloader()) == 4 and data.val_dataloader() is None
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    raw = torch.load(tmp_path / "run.ckpt", weights_only=True)
    assert raw["hparams_name"] == "config" and raw["datamodule_hyper_parameters"]["tag"] == "b"

    loaded = Configured.load_from_checkpoint(tmp_path / "run.ckpt")  # config=... passed back as one object
    assert loaded.hparams.lr == 0.05 and loaded.lr == 0.05
    assert torch.equal(loaded.layer.weight, module.layer.weight)
    rebuilt = Data.load_from_checkpoint(tmp_path / "run.ckpt", tag="c")
    assert dict(rebuilt.hparams) == {"batch_size": 16, "num_workers": 0, "tag": "c"} and rebuilt.epochs_seen == 7

    (tmp_path / "hparams.yaml").write_text(yaml.safe_dump({"lr": 0.5}))  # as a logger writes it
    assert Configured.load_from_checkpoint(tmp_path / "run.ckpt", hparams_file=tmp_path / "hparams.yaml").lr == 0.5
    with pytest.raises(ValueError, match=r"hparams_file=.*a \.yaml file is read"):
        Configured.load_from_checkpoint(tmp_path / "run.ckpt", hparams_file=tmp_path / "hparams.csv")


def test_a_datamodule_prints_its_loaders_sizes(regression_data):
    data = DataModule.from_datasets(regression_data, test_dataset=[regression_data, regression_data])
    assert str(data).splitlines() == ["{Train dataloader: size=64}", "{Validation dataloader: None}",
                                      "{Test dataloader: 1. size=64 ; 2. size=64}", "{Predict dataloader: None}"]
    data.predict_dataloader = lambda: DataLoader(range(3))  # set on the instance: counts as the hook
    assert str(data).splitlines()[-1] == "{Predict dataloader: size=3}"


def test_lightnings_phrases_are_in_the_messages_about_hyperparameters_and_checkpoint_arguments():
    class OneNumber(LinearRegression):
        def __init__(self, arg1: int) -> None:
            super().__init__()
            self.save_hyperparameters(arg1)

    with pytest.raises(ValueError, match=r"Primitives \(<class 'bool'>.*Pass the argument's name as a string"):
        OneNumber(42)
    from callbacks import ModelCheckpoint

    with pytest.raises(ValueError, match=r"Must be >= -1"):
        ModelCheckpoint(save_top_k=-3)
    with pytest.raises(ValueError, match=r"use an int >= 0 \(0: off\) or None \(Lightning's: Must be >= 0\)"):
        ModelCheckpoint(every_n_epochs=-3)
    with pytest.raises(ValueError, match=r"give one of them.*Combination of parameters every_n_train_steps"):
        ModelCheckpoint(every_n_train_steps=1, every_n_epochs=2)
    with pytest.raises(ValueError, match=r'use "min" or "max" \(`mode` can be min, max but got unknown\)'):
        ModelCheckpoint(mode="unknown")


def test_hparams_a_subclass_defines_is_the_one_read_and_searched():
    # As Lightning 2.6.5 (its hparams is a property a class attribute overrides): lightning_getattr
    # reads 2 from the class's dict, and the DataModule's the same way.
    from callbacks.search import get_attribute, has_attribute, set_attribute

    class WithDict(TrainingModule):
        hparams = {"learning_rate": 2}

    class WithDictData(DataModule):
        hparams = {"batch_size": 3}

    module = WithDict()
    assert module.hparams == {"learning_rate": 2}
    assert has_attribute(module, "learning_rate") and get_attribute(module, "learning_rate") == 2
    set_attribute(module, "learning_rate", 5)
    assert module.hparams["learning_rate"] == 5
    assert WithDictData().hparams == {"batch_size": 3}


def test_collect_init_args_and_parse_class_init_keys_as_lightnings():
    # The values Lightning 2.6.5's lightning.pytorch.utilities.parsing functions give for these classes.
    import inspect

    from trainer.hparams import collect_init_args, parse_class_init_keys

    class Parent:
        def __init__(self, anyarg, anykw=42, **kwargs):
            super().__init__()
            self.result = collect_init_args(inspect.currentframe(), [])

    class Child(Parent):
        def __init__(self, anyarg, childarg, *extra, anykw=42, **options):
            super().__init__(anyarg, anykw=anykw, **options)

    child = Child("a", "b", 1, anykw=3, other=4)
    assert child.result == [{"anyarg": "a", "anykw": 3, "other": 4}, {"anyarg": "a", "childarg": "b", "anykw": 3, "other": 4}]
    assert parse_class_init_keys(Child) == ("self", "extra", "options")
    assert parse_class_init_keys(Parent) == ("self", None, "kwargs")


class KeepsALambda(LinearRegression):
    def __init__(self, scale=2.0, transform=(lambda x: x + 1), ignore=False):
        super().__init__()
        self.save_hyperparameters(ignore=["transform"] if ignore else None)


def test_an_unpicklable_hyperparameter_is_removed_when_a_stage_starts_with_lightnings_warning(make_trainer,
                                                                                                regression_loader):
    # Lightning 2.6.5's clean_namespace at each run's start (its test_hparams_pickle_warning).
    module = KeepsALambda()
    assert "transform" in module.hparams
    with pytest.warns(UserWarning, match=r"Attribute 'transform' removed from hparams because it cannot be pickled\. "
                                         r"You can suppress this warning by setting "
                                         r"`self.save_hyperparameters\(ignore=\['transform'\]\)`"):
        make_trainer(max_epochs=1).fit(module, regression_loader)
    assert dict(module.hparams) == {"scale": 2.0, "ignore": False}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="(?!Attribute)")  # only the hparams warning is an error here
        make_trainer(max_epochs=1).fit(KeepsALambda(ignore=True), regression_loader)


class TakesAConfig(LinearRegression):
    def __init__(self, config):
        super().__init__()
        self._hparams = config  # Lightning's store behind hparams, set directly (its test_args)


class PassesEverythingUp(TakesAConfig):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_setting_lightnings_private_hparams_store_sets_hparams_and_the_checkpoint_keeps_them(make_trainer,
                                                                                              regression_loader,
                                                                                              tmp_path):
    module = PassesEverythingUp({"test": 1})
    assert module.hparams == {"test": 1} and module.hparams.test == 1
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, regression_loader)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    # As in Lightning: the saved names are passed as keywords, which the base's __init__ does not take.
    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'test'"):
        PassesEverythingUp.load_from_checkpoint(tmp_path / "model.ckpt")


def test_a_checkpoint_of_a_module_without_hyperparameters_has_no_hyperparameters_key(make_trainer, tmp_path):
    # Lightning 2.6.5 writes "hyper_parameters" (and "hparams_name") only when the module kept some
    # (the mnist-hello-world and kornia tutorials' checkpoints have neither); loading still works.
    trainer = make_trainer(max_steps=1)
    trainer.fit(LinearRegression(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert "hyper_parameters" not in checkpoint and "hparams_name" not in checkpoint
    assert isinstance(LinearRegression.load_from_checkpoint(tmp_path / "plain.ckpt"), LinearRegression)
