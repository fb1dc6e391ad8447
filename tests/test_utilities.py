"""trainer.utilities: Lightning's lightning.pytorch.utilities names, with Lightning's meaning."""

from __future__ import annotations

import logging
import subprocess
import sys
import types
import warnings

import pytest
import torch
from linear_regression import LinearRegression
from torch import nn

from trainer import utilities
from trainer.utilities import (
    AttributeDict, GradClipAlgorithmType, LightningEnum, disable_possible_user_warnings,
    find_shared_parameters, grad_norm, is_picklable, is_shared_filesystem, measure_flops, move_data_to_device,
    rank_zero_deprecation, rank_zero_info, rank_zero_only, rank_zero_warn, set_shared_parameters,
    suggested_max_num_workers,
)


def test_grad_norm_gives_each_parameters_norm_and_the_total_as_tensors():
    module = LinearRegression()
    module.layer.weight.grad = torch.full((2, 4), 3.0)
    norms = grad_norm(module, 2)
    assert set(norms) == {"grad_2.0_norm/layer.weight", "grad_2.0_norm_total"}  # no gradient on the bias: left out
    assert norms["grad_2.0_norm/layer.weight"].item() == pytest.approx(torch.full((8,), 3.0).norm().item())
    assert norms["grad_2.0_norm_total"].item() == pytest.approx(norms["grad_2.0_norm/layer.weight"].item())
    assert set(grad_norm(module, "inf", group_separator=".")) == {"grad_inf_norm.layer.weight", "grad_inf_norm_total"}
    with pytest.raises(ValueError, match=r"grad_norm\(norm_type=0.0\): use a positive number or 'inf'"):
        grad_norm(module, 0)
    with pytest.raises(ValueError, match=r"`norm_type` must be a positive number or 'inf'"):  # Lightning 2.6.5's test
        grad_norm(module, -1)


def test_rank_zero_helpers_speak_on_rank_zero_only(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="cadence"), pytest.warns(UserWarning, match="careful"):
        rank_zero_info("hello %s", "there")
        rank_zero_warn("careful")
    assert "hello there" in caplog.text
    with pytest.warns(DeprecationWarning, match="old"):
        rank_zero_deprecation("old")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail here
        rank_zero_warn("careful")
        rank_zero_info("hello")
    assert caplog.text == ""
    assert rank_zero_only(lambda: 5, default=0)() == 0


def test_attribute_dict_and_lightning_enum():
    config = AttributeDict(lr=0.1, batch_size=32)
    config.layers = 2
    assert (config.lr, config["layers"]) == (0.1, 2)
    assert repr(config) == '"batch_size": 32\n"layers":     2\n"lr":         0.1'
    with pytest.raises(AttributeError, match="'AttributeDict' object has no attribute 'momentum'"):
        config.momentum
    assert GradClipAlgorithmType.NORM == "Norm" and GradClipAlgorithmType.from_str("VALUE") is GradClipAlgorithmType.VALUE
    assert issubclass(GradClipAlgorithmType, LightningEnum)
    assert GradClipAlgorithmType.supported_types() == ["value", "norm"]  # Lightning's order
    assert GradClipAlgorithmType.supported_type("norm") and not GradClipAlgorithmType.supported_type("norm2")
    with pytest.raises(ValueError, match=r"GradClipAlgorithmType: no member named 'max'; use one of value, norm"):
        GradClipAlgorithmType.from_str("max")


def test_tied_parameters_are_found_and_tied_again():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.decoder.weight = self.encoder.weight

    module = Tied()
    shared = find_shared_parameters(module)
    assert shared == [["encoder.weight", "decoder.weight"]]
    module.decoder.weight = nn.Parameter(module.decoder.weight.detach().clone())  # untied, as a copy may do
    assert find_shared_parameters(module) == []
    assert set_shared_parameters(module, shared).decoder.weight is module.encoder.weight


def test_the_small_helpers():
    moved = move_data_to_device({"x": [torch.ones(1)], "n": 3}, "cpu")
    assert moved["n"] == 3 and moved["x"][0].device.type == "cpu"
    assert is_picklable([1, "a"]) and not is_picklable(lambda: 0)
    assert not is_picklable(torch.jit.script(nn.Linear(2, 2)))  # torch raises RuntimeError there
    linear = nn.Linear(4, 2)
    assert measure_flops(linear, lambda: linear(torch.ones(8, 4))) == 2 * 8 * 4 * 2
    assert suggested_max_num_workers(1) >= 1
    with pytest.raises(ValueError, match=r"suggested_max_num_workers\(local_world_size=0\): use an int >= 1"):
        suggested_max_num_workers(0)
    one_process = type("OneProcess", (), {"world_size": 1})()
    assert is_shared_filesystem(one_process)


class _ValidatesWithoutLoader(LinearRegression):
    def validation_step(self, batch, batch_idx):
        pass


def _fit_without_val_loader():
    from torch.utils.data import DataLoader, TensorDataset

    from trainer import Trainer

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(_ValidatesWithoutLoader(), DataLoader(data, batch_size=4))


def test_disable_possible_user_warnings_silences_the_warnings_that_may_be_false_positives():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_without_val_loader()
    possible = [w for w in caught if issubclass(w.category, utilities.PossibleUserWarning)]
    assert len(possible) == 1 and str(possible[0].message).startswith(
        "You defined a `validation_step` but have no `val_dataloader`")
    assert issubclass(utilities.PossibleUserWarning, UserWarning)  # pytest.warns(UserWarning) still sees them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        _fit_without_val_loader()
        warnings.warn("not a possible one", UserWarning)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == ["not a possible one"]


@pytest.mark.parametrize("setting", ["0", "off", "OFF"])
def test_possible_user_warnings_environment_variable_silences_them_when_trainer_is_imported(setting):
    """Lightning's POSSIBLE_USER_WARNINGS switch (its test_disable_possible_user_warnings_from_environment)."""
    code = ("import warnings, trainer\nfrom trainer.utilities import PossibleUserWarning\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.warn('test', PossibleUserWarning)\n    warnings.warn('kept', UserWarning)\n"
            "print([str(w.message) for w in caught])")
    for value, shown in ((setting, "['kept']"), ("1", "['test', 'kept']")):
        run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                             check=True, env={**utilities.os.environ, "POSSIBLE_USER_WARNINGS": value})
        assert run.stdout.strip() == shown


def test_lightning_utilities_rank_is_set_when_that_package_is_installed(tmp_path):
    """A project that uses lightning_utilities' rank_zero_only directly (the hydra template's logger)."""
    package = tmp_path / "lightning_utilities" / "core"
    package.mkdir(parents=True)
    (tmp_path / "lightning_utilities" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "rank_zero.py").write_text("def rank_zero_only(fn):\n    return fn\n")  # rank unset, as there
    code = ("import trainer.utilities\nfrom lightning_utilities.core.rank_zero import rank_zero_only\n"
            "print(rank_zero_only.rank)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**utilities.os.environ, "PYTHONPATH": utilities.os.pathsep.join(
                             [str(tmp_path), *filter(None, [utilities.os.environ.get("PYTHONPATH")])]),
                              "RANK": "3"})
    assert run.stdout.strip() == "3"


def test_cli_lightning_logo_imports_from_trainer_and_prints_the_frameworks_name(capsys):
    from trainer import cli_lightning_logo  # Lightning's examples: from lightning.pytorch import cli_lightning_logo

    cli_lightning_logo()
    assert capsys.readouterr().out == "\nCadence\n\n"


def test_get_torchvision_model_builds_torchvisions_model_by_name(monkeypatch):
    # torchvision is not a dependency: a stand-in package with torchvision's get_model (the machine lacks it)
    built = []
    models = types.ModuleType("torchvision.models")
    models.get_model = lambda name, **kwargs: built.append((name, kwargs)) or nn.Linear(2, 2)
    torchvision = types.ModuleType("torchvision")
    torchvision.models = models
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    assert isinstance(utilities.get_torchvision_model("resnet50", weights="DEFAULT"), nn.Linear)
    assert built == [("resnet50", {"weights": "DEFAULT"})]


def test_get_torchvision_model_without_torchvision_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # importing it fails, installed or not
    with pytest.raises(ImportError, match="needs torchvision: pip install torchvision"):
        utilities.get_torchvision_model("resnet50")
