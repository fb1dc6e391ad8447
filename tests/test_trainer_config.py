"""``cadence fit --config run.yaml``: a run built from YAML, checked against the signatures first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.cli.config import load_run

ROOT = Path(__file__).resolve().parents[1]

PARTS = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import TrainingModule

calls = []


class Tiny(TrainingModule):
    def __init__(self, width: int, lr: float = 0.1, tags: list[str] | None = None):
        super().__init__()
        calls.append("model")
        self.layer = nn.Linear(4, width)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.get("lr", 0.1))


def loaders(batch_size: int = 4, with_val: bool = True):
    calls.append("data")
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=batch_size)
    return (loader, loader) if with_val else loader


def three_loaders():
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    return loader, loader, loader
'''


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A module ``run_parts`` (a TrainingModule ``Tiny`` and a data function ``loaders``) on sys.path."""
    (tmp_path / "run_parts.py").write_text(PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("run_parts", None)
    import run_parts

    return run_parts


def write_config(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """
    model:
      class_path: run_parts.Tiny
      init_args: {width: 2, lr: 0.05}
    data:
      class_path: run_parts.loaders
      init_args: {batch_size: 4}
    trainer:
      max_epochs: 2
      strategy: cpu
      enable_progress_bar: false
      callbacks:
        - class_path: callbacks.ModelCheckpoint
          init_args: {monitor: val/loss, mode: min}
"""


def test_cadence_fit_trains_the_run_the_yaml_describes(parts, tmp_path, capsys):
    path = write_config(tmp_path, GOOD)
    assert main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}"]) == 0
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    err = capsys.readouterr().err
    assert f"Logs: {tmp_path / 'lightning_logs' / 'version_0'}" in err and "Best checkpoint (ModelCheckpoint):" in err
    assert f"Configuration: {tmp_path / 'lightning_logs' / 'version_0' / 'config.yaml'}" in err


def test_overrides_on_the_command_line_replace_keys_of_the_file(parts, tmp_path):
    path = write_config(tmp_path, GOOD)
    run = load_run([path], [("trainer.max_epochs", "1"), ("model.init_args.lr", "1.0e-3"),
                            ("data.init_args.with_val", "false")])
    assert run.trainer.kwargs["max_epochs"] == 1 and run.model.kwargs["lr"] == 0.001
    assert run.data.kwargs == {"batch_size": 4, "with_val": False}


def test_the_digits_config_trains_for_a_few_batches(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    code = main(["fit", "--config", str(ROOT / "examples" / "digits.yaml"), "--trainer.max_epochs", "1",
                 "--trainer.limit_train_batches=3", f"--trainer.default_root_dir={tmp_path}",
                 "--trainer.enable_progress_bar=false", "--trainer.logger=false"])
    assert code == 0
    assert list((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("epoch=0-val_acc=*.ckpt"))


def test_python_dash_m_trainer_is_the_cadence_command():
    result = subprocess.run([sys.executable, "-m", "trainer", "fit", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "--config" in result.stdout


@pytest.mark.parametrize(
    "edit, match",
    [
        (("trainer:", "trainer:\n      max_epoch: 3"),
         r"trainer has unknown key 'max_epoch' \(did you mean 'max_epochs'\?\); Trainer accepts: max_epochs, max_steps"),
        (("width: 2", "wdth: 2"),
         r"model.init_args has unknown key 'wdth' \(did you mean 'width'\?\); Tiny accepts: width, lr, tags"),
        (("{width: 2, lr: 0.05}", "{lr: 0.05}"), r"model.init_args is missing \['width'\], which Tiny requires"),
        (("lr: 0.05", "lr: 1e-3"),
         r"model.init_args.lr: got '1e-3' \(str\); Tiny takes float. YAML read '1e-3' as text"),
        (("max_epochs: 2", "max_epochs: ten"), r"trainer.max_epochs: got 'ten' \(str\); Trainer takes int \| None"),
        (("width: 2", "width: 2, tags: [a, 3]"), r"model.init_args.tags: got \['a', 3\]"),
        (("run_parts.Tiny", "run_parts.Tinny"), r"model.class_path: run_parts has no 'Tinny'; did you mean Tiny\? It also has: loaders, three_loaders\."),
        (("run_parts.Tiny", "no_such_package.Model"), r"model.class_path: cannot import 'no_such_package'"),
        (("run_parts.Tiny", "run_parts.loaders"), r"model.class_path names loaders, which is not a trainer.module.TrainingModule subclass"),
        (("callbacks.ModelCheckpoint", "callbacks.ModelCheckpoints"),
         r"trainer.callbacks\[0\].class_path: callbacks has no 'ModelCheckpoints'"),
        (("mode: min", "mode: min, every: 2"),
         r"trainer.callbacks\[0\].init_args has unknown key 'every'; ModelCheckpoint accepts: dirpath"),
        (("class_path: run_parts.loaders", "class_path: run_parts.loaders\n      args: {}"),
         r"run.yaml:7: data has unknown key 'args' \(did you mean 'init_args'\?\); it takes class_path and init_args"),
        (("model:", "modle: 1\n    model:"), r"Unknown top-level key 'modle' \(did you mean 'model'\?\)"),
        (("class_path: callbacks.ModelCheckpoint\n          init_args: {monitor: val/loss, mode: min}",
          "class_path: run_parts.Tiny\n          init_args: {width: 2}"),
         r"trainer.callbacks: got \[Tiny\(...\)\] \(list\); Trainer takes list\[Callback\] \| Callback \| None"),
    ],
    ids=["trainer-key", "model-key", "missing-required", "yaml-exponent", "trainer-type", "list-element-type",
         "no-such-class", "no-such-module", "not-a-module", "callback-class", "callback-key", "section-key",
         "top-level-key", "callback-type"],
)
def test_a_bad_config_is_refused_before_anything_is_built(parts, tmp_path, edit, match):
    old, new = edit
    assert old in GOOD
    path = write_config(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(path)])
    assert parts.calls == []  # neither the model nor the data function ran
    assert not (tmp_path / "lightning_logs").exists()


def test_a_data_function_must_return_one_or_two_loaders(parts, tmp_path):
    path = write_config(tmp_path, GOOD.replace("run_parts.loaders", "run_parts.three_loaders").replace("{batch_size: 4}", "{}"))
    with pytest.raises(SystemExit, match=r"data \(three_loaders\) returned 3 items; return train_loader or \(train_loader, val_loader\)"):
        main(["fit", "--config", str(path)])


@pytest.mark.parametrize(
    "text, match",
    [
        ("model: [unclosed", r"run.yaml:1:17: not valid YAML: expected .* but got .<stream end>. \(while parsing a flow sequence\)"),
        ("- a list", r"must be a mapping of sections \(model, data, trainer, ...\); it holds a list"),
        ("trainer: {max_epochs: 1}", "The config has no 'model' section"),
        ("model: run_parts.Tiny", r"model must be a mapping with 'class_path'"),
    ],
)
def test_a_malformed_file_names_the_problem(parts, tmp_path, text, match):
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(write_config(tmp_path, text))])


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="cadence fit: Config file .*nope.yaml does not exist"):
        main(["fit", "--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--trainer.max_epochs"], "needs a value"),
        (["max_epochs=3"], "unexpected argument 'max_epochs=3'"),
        (["--epochs=3"], "Override --epochs: it must start with one of seed_everything, trainer, model, data"),
    ],
)
def test_a_malformed_override_says_how_overrides_look(parts, tmp_path, argv, match):
    path = write_config(tmp_path, GOOD)
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(path), *argv])
