"""The command line's run life: stages from YAML, merged files and overrides, the saved
configuration that reproduces a run, resuming without losing the first configuration, and errors
that point at the line to fix."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from trainer.cli import main
from trainer.cli.config import load_run
from trainer.cli.config_files import read_config
from trainer import DataModule, TrainingModule

PARTS = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import TrainingModule

calls = []


class Tiny(TrainingModule):
    def __init__(self, width: int = 2, lr: float = 0.1):
        super().__init__()
        calls.append("model")
        self.save_hyperparameters()
        self.layer = nn.Linear(4, width)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.layer(batch[0]).pow(2).mean())

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class NoOptimizer(TrainingModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()


class Data:
    """Loader hooks as a DataModule has them; notes each stage it is set up for."""

    def __init__(self, batch_size: int = 4, samples: int = 16):
        calls.append("data")
        self.batch_size, self.samples = batch_size, samples

    def setup(self, stage):
        calls.append(f"setup {stage}")
        self.data = TensorDataset(torch.randn(self.samples, 4, generator=torch.Generator().manual_seed(0)))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def loaders(batch_size: int = 4):
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=batch_size)
    return loader, loader


def failing_data(rows: int = 3):
    if rows < 4:
        raise ValueError(f"rows={rows}: use 4 or more")
'''

RUN = """
    seed_everything: true
    model:
      class_path: cli_parts.Tiny
      init_args: {width: 2}
    data:
      class_path: cli_parts.Data
    trainer:
      max_epochs: 1
      strategy: cpu
      enable_progress_bar: false
      logger: false
      callbacks:
        - class_path: ModelCheckpoint
          init_args: {monitor: val/loss, mode: min}
"""


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A module ``cli_parts`` on sys.path, and the working directory in ``tmp_path``."""
    (tmp_path / "cli_parts.py").write_text(PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("cli_parts", None)
    import cli_parts

    return cli_parts


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


# --- merging and overrides ------------------------------------------------------------------------
def test_config_files_merge_in_order_with_lists_replaced_then_overrides_apply(tmp_path):
    base = write(tmp_path, "base.yaml", """
        trainer:
          max_epochs: 3
          callbacks: [{class_path: A}, {class_path: B}]
        model: {class_path: m.Model, init_args: {width: 2, depth: 3}}
    """)
    top = write(tmp_path, "top.yaml", """
        trainer:
          callbacks: [{class_path: C}]
        model: {init_args: {width: 8}}
    """)
    config, origins = read_config([base, top], [("trainer.max_epochs", "5"), ("trainer.callbacks+", "{class_path: D}"),
                                                ("trainer.callbacks[0].init_args.patience", "2")])
    assert config["trainer"] == {"max_epochs": 5, "callbacks": [{"class_path": "C", "init_args": {"patience": 2}},
                                                                {"class_path": "D"}]}
    assert config["model"] == {"class_path": "m.Model", "init_args": {"width": 8, "depth": 3}}
    assert origins.of("model.init_args.depth") == f"{base}:5" and origins.of("model.init_args.width") == f"{top}:4"
    assert origins.of("trainer.callbacks[1]") == "--trainer.callbacks+ (command line)"


def test_a_file_that_names_another_class_replaces_the_old_init_args(tmp_path):
    base = write(tmp_path, "base.yaml", "model: {class_path: m.A, init_args: {only_a_takes_this: 1}}")
    other = write(tmp_path, "other.yaml", "model: {class_path: m.B, init_args: {width: 2}}")
    config, _ = read_config([base, other])
    assert config["model"] == {"class_path": "m.B", "init_args": {"width": 2}}
    config, _ = read_config([base], [("model.class_path", "m.C")])
    assert config["model"] == {"class_path": "m.C"}


def test_print_config_prints_the_resolved_configuration_and_builds_nothing(parts, tmp_path, capsys):
    path = write(tmp_path, "run.yaml", RUN.replace("class_path: cli_parts.Tiny", "class_path: cli_parts.NoOptimizer\n      init_args: {}")
                 .replace("      init_args: {width: 2}\n", "") + "    optimizer: {class_path: AdamW, init_args: {lr: 1.0e-3}}\n")
    assert main(["fit", "--config", str(path), "--print_config", "--trainer.max_epochs=4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert parts.calls == []
    assert list(printed) == ["seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path"]
    assert printed["trainer"]["max_epochs"] == 4 and printed["trainer"]["max_steps"] == -1  # a default, filled in
    assert printed["trainer"]["callbacks"][0]["class_path"] == "callbacks.ModelCheckpoint"  # spelled out
    assert printed["trainer"]["callbacks"][0]["init_args"]["save_top_k"] == 1
    assert printed["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert printed["optimizer"]["init_args"]["lr"] == 1e-3 and printed["optimizer"]["init_args"]["betas"] == [0.9, 0.999]
    assert printed["data"] == {"class_path": "cli_parts.Data", "init_args": {"batch_size": 4, "samples": 16}}


# --- the saved configuration ----------------------------------------------------------------------
def test_the_saved_config_yaml_runs_the_same_run_again(parts, tmp_path):
    path = write(tmp_path, "run.yaml", RUN)
    assert main(["fit", "--config", str(path), "--model.init_args.width=3"]) == 0
    saved = tmp_path / "lightning_logs" / "version_0" / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    assert isinstance(config["seed_everything"], int) and config["trainer"]["seed"] == config["seed_everything"]
    assert config["model"]["init_args"] == {"width": 3, "lr": 0.1}
    assert main(["fit", "--config", str(saved)]) == 0
    first, again = (weights(tmp_path / "lightning_logs" / f"version_{n}" / "checkpoints" / "last.ckpt") for n in (0, 1))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert yaml.safe_load((tmp_path / "lightning_logs" / "version_1" / "config.yaml").read_text()) == config


def test_a_resumed_run_keeps_its_config_yaml_and_saves_a_changed_one_beside_it(parts, tmp_path, capsys):
    path = write(tmp_path, "run.yaml", RUN.replace("seed_everything: true", "seed_everything: 3"))
    version = tmp_path / "lightning_logs" / "version_0"
    assert main(["fit", "--config", str(path), "--ckpt_path=last"]) == 0  # nothing to resume: one command starts it
    assert capsys.readouterr().err.startswith(
        f"cadence fit: ckpt_path: last found no last.ckpt from a run of cli_parts.Tiny in "
        f"{tmp_path / 'lightning_logs'}/version_*/checkpoints; training starts from scratch.\n")
    first = (version / "config.yaml").read_text()
    assert main(["fit", "--config", str(path), "--ckpt_path=last"]) == 0  # the same run: nothing new
    assert main(["fit", "--config", str(path), "--ckpt_path=last", "--trainer.max_epochs=2"]) == 0
    assert main(["fit", "--config", str(path), "--ckpt_path=last", "--trainer.max_epochs=2"]) == 0
    assert (version / "config.yaml").read_text() == first
    assert sorted(p.name for p in version.glob("config*.yaml")) == ["config.resumed.yaml", "config.yaml"]
    resumed = yaml.safe_load((version / "config.resumed.yaml").read_text())
    assert resumed["trainer"]["max_epochs"] == 2 and resumed["ckpt_path"] == str(version / "checkpoints" / "last.ckpt")
    err = capsys.readouterr().err
    assert err.count("whose config.yaml differs: trainer.max_epochs: 1 -> 2. Saved this configuration as config.resumed.yaml") == 1
    assert not (tmp_path / "lightning_logs" / "version_1").exists()


# --- validate, test, predict ----------------------------------------------------------------------
def test_test_validate_and_predict_load_the_best_or_last_checkpoint_of_the_model(parts, tmp_path, capsys):
    path = write(tmp_path, "run.yaml", RUN.replace("max_epochs: 1", "max_epochs: 3"))
    assert main(["fit", "--config", str(path)]) == 0
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    best = next(p for p in checkpoints.iterdir() if p.name != "last.ckpt")
    capsys.readouterr()
    assert main(["test", "--config", str(path), "--ckpt_path", "best"]) == 0
    out, err = capsys.readouterr()
    # Each command sets up the data for its own stage, as Trainer.fit(datamodule=...) does.
    assert [call for call in parts.calls if call.startswith("setup")] == ["setup fit", "setup test"]
    tiny = parts.Tiny(width=2)
    tiny.load_state_dict(weights(best))
    data = parts.Data()
    data.setup("test")
    with torch.no_grad():
        expected = torch.stack([tiny.layer(x).pow(2).mean() for (x,) in data.test_dataloader()]).mean()
    assert out == f"test/loss\t{float(expected):.6g}\n"
    assert "Logs: " + str(tmp_path / "lightning_logs" / "version_1") in err
    assert main(["validate", "--config", str(path), "--ckpt_path=last"]) == 0
    assert capsys.readouterr().out.startswith("val/loss\t")
    assert main(["validate", "--config", str(path)]) == 0
    assert capsys.readouterr().err.startswith("cadence validate: no ckpt_path: the model has the weights Tiny() gives it. "
                                              "Pass --ckpt_path best, last or a file for trained ones.\n")
    assert main(["predict", "--config", str(path), "--ckpt_path", str(best)]) == 0
    predictions = torch.load(tmp_path / "lightning_logs" / "version_4" / "predictions.pt", weights_only=True)["predictions"]
    assert len(predictions) == 4 and torch.allclose(predictions[0], tiny.layer(next(iter(data.predict_dataloader()))[0]))
    assert yaml.safe_load((tmp_path / "lightning_logs" / "version_4" / "config.yaml").read_text())["ckpt_path"] == str(best)
    assert [call for call in parts.calls if call.startswith("setup")][-2:] == ["setup validate", "setup predict"]
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100])  # damaged: best is recorded in it
    with pytest.raises(SystemExit, match=rf"cadence test: ckpt_path: best: Checkpoint {last} is truncated or corrupted"):
        main(["test", "--config", str(path), "--ckpt_path", "best"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["fit", "--ckpt_path=best"], r'ckpt_path: "best" is for validate, test and predict; fit resumes from "last" or a path'),
        (["test", "--ckpt_path=last"], r"ckpt_path: last found no last.ckpt from a run of cli_parts.Tiny in .*lightning_logs/version_\*/checkpoints"),
        (["validate", "--ckpt_path=nope.ckpt"], r"cadence validate: Checkpoint file not found: nope.ckpt does not exist"),
        (["test", "--data.class_path=cli_parts.loaders"],
         r"data \(loaders\) returns loaders for fit only; for test, name a class with test_dataloader\(\)"),
    ],
)
def test_a_stage_without_what_it_needs_says_what_to_pass(parts, tmp_path, argv, match):
    path = write(tmp_path, "run.yaml", RUN)
    with pytest.raises(SystemExit, match=match):
        main([argv[0], "--config", str(path), *argv[1:]])


def test_the_optimizer_and_lr_scheduler_sections_serve_a_module_without_configure_optimizers(parts, tmp_path):
    path = write(tmp_path, "run.yaml", """
        model: {class_path: cli_parts.NoOptimizer}
        optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.5, momentum: 0.9}}
        lr_scheduler: {class_path: ReduceLROnPlateau, init_args: {monitor: train/loss, factor: 0.5}}
    """)
    run = load_run([path])
    model, _, _ = run.build()
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"] == 0.5 and optimizer.defaults["momentum"] == 0.9
    assert [p for group in optimizer.param_groups for p in group["params"]] == list(model.parameters())
    scheduler = configured["lr_scheduler"]
    assert scheduler["monitor"] == "train/loss" and scheduler["scheduler"].factor == 0.5
    with pytest.raises(SystemExit, match=r"model Tiny defines configure_optimizers, so the optimizer section would be ignored"):
        main(["fit", "--config", str(path), "--model.class_path=cli_parts.Tiny"])


# --- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, match",
    [
        (("max_epochs: 1", "max_epoch: 1"),
         r"run.yaml:9: trainer has unknown key 'max_epoch' \(did you mean 'max_epochs'\?\); Trainer accepts: max_epochs,"),
        (("{width: 2}", "{widht: 2}"), r"run.yaml:5: model.init_args has unknown key 'widht' \(did you mean 'width'\?\)"),
        (("{monitor: val/loss, mode: min}", "{monitor: val/loss, mode: min, every: 3}"),
         r"run.yaml:15: trainer.callbacks\[0\].init_args has unknown key 'every'"),
        (("cli_parts.Tiny", "cli_parts.Tinny"),
         r"run.yaml:4: model.class_path: cli_parts has no 'Tinny'; did you mean Tiny\? It also has: Data, NoOptimizer, "
         r"failing_data, loaders\.$"),
        (("class_path: ModelCheckpoint", "class_path: ModelCheckpiont"),
         r"run.yaml:14: trainer.callbacks\[0\].class_path: 'ModelCheckpiont' is not a class of callbacks, strategies, "
         r"torch.optim, torch.optim.lr_scheduler \(did you mean 'ModelCheckpoint'\?\)"),
        (("seed_everything: true", "seed_everything: true\n    trainer:\n      seed: 1"),
         r"run.yaml:10: trainer is set twice in one mapping \(first on line 3\); YAML would keep only the last"),
        (("seed_everything: true", "seed_everything: 4\n    ckpt_pth: last"),
         r"run.yaml:3: Unknown top-level key 'ckpt_pth' \(did you mean 'ckpt_path'\?\)"),
    ],
    ids=["trainer-key", "model-key", "callback-key", "class-typo", "short-name-typo", "twice", "top-level"],
)
def test_a_mistake_in_a_file_is_reported_with_the_file_and_line(parts, tmp_path, edit, match):
    old, new = edit
    assert old in RUN
    path = write(tmp_path, "run.yaml", RUN.replace(old, new, 1))
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(path)])
    assert parts.calls == []


def test_a_stage_without_any_configuration_says_to_pass_a_file():
    with pytest.raises(SystemExit, match=r"^cadence test: no configuration given\. Pass a YAML file: cadence test --config "
                                         r"run\.yaml \(examples/digits\.yaml is one\)"):
        main(["test"])


@pytest.mark.parametrize(
    "text, match",
    [
        ("trainer:\n  max_epochs: [1\n", r"^cadence fit: .*run.yaml:3:1: not valid YAML: expected ',' or '\]', but got "
                                           r"'<stream end>' \(while parsing a flow sequence from line 2\)\.$"),
        ("trainer:\n  max_epochs: 1\n\tseed: 3\n", r"^cadence fit: .*run.yaml:3:1: not valid YAML: found character '\\t' "
                                                     r"that cannot start any token .*; indent with spaces, not tabs\.$"),
    ],
    ids=["unclosed-list", "tab"],
)
def test_a_yaml_syntax_error_is_one_line_with_the_file_line_and_column(tmp_path, text, match):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(path)])


def test_an_override_that_is_not_yaml_is_one_line(parts, tmp_path):
    path = write(tmp_path, "run.yaml", RUN)
    with pytest.raises(SystemExit, match=r"^cadence fit: Override --trainer.max_epochs=\[1: not valid YAML: expected ',' "
                                         r"or '\]', but got '<stream end>' \(while parsing a flow sequence\)\.$"):
        main(["fit", "--config", str(path), "--trainer.max_epochs=[1"])


def test_a_class_path_typo_lists_only_the_modules_own_classes_and_functions(parts, tmp_path):
    path = write(tmp_path, "run.yaml", RUN.replace("class_path: ModelCheckpoint", "class_path: callbacks.ModelCheckpont"))
    with pytest.raises(SystemExit) as raised:
        main(["fit", "--config", str(path)])
    message = str(raised.value)
    assert ("did you mean ModelCheckpoint or Checkpoint or GradientCheckpointing? It also has: AMP, AdvancedProfiler, AsyncLogger, "
            "AutoMicrobatch, BackboneFinetuning, BaseFinetuning, BasePredictionWriter, BatchSizeFinder, CSVLogger") in message
    assert not any(name in message for name in ("Any", "annotations", "base", "model_checkpoint", "typing",
                                                "cadence_shadowing", "tensorboard_available", "search", "lr_finder"))


@pytest.mark.parametrize(
    "class_path, match",
    [
        ("lightning.pytorch.callbacks.EarlyStopping", r"is PyTorch Lightning's; Cadence's is callbacks.EarlyStopping"),
        ("lightning.pytorch.cli.ReduceLROnPlateau",
         r"is PyTorch Lightning's; use torch.optim.lr_scheduler.ReduceLROnPlateau, with monitor: in its init_args"),
        ("pytorch_lightning.callbacks.SpikeDetection", r"is PyTorch Lightning's; Cadence does not have it; instead: Trainer\(on_nonfinite_loss"),
        ("lightning.pytorch.callbacks.Bogus", r"is PyTorch Lightning's; Cadence has no class of that name"),
    ],
)
def test_a_lightning_class_path_names_the_cadence_class_to_use(parts, tmp_path, class_path, match):
    path = write(tmp_path, "run.yaml", RUN.replace("class_path: ModelCheckpoint", f"class_path: {class_path}"))
    with pytest.raises(SystemExit, match=rf"run.yaml:14: trainer.callbacks\[0\].class_path: {class_path} {match}"):
        main(["fit", "--config", str(path)])


def test_a_key_typo_on_the_command_line_is_reported_as_such(parts, tmp_path):
    path = write(tmp_path, "run.yaml", RUN)
    with pytest.raises(SystemExit, match=r"--trainer.max_epoch \(command line\): trainer has unknown key 'max_epoch'"):
        main(["fit", "--config", str(path), "--trainer.max_epoch=3"])


def test_a_value_only_the_built_object_rejects_is_one_line_naming_the_section(parts, tmp_path, capsys):
    path = write(tmp_path, "run.yaml", RUN)
    with pytest.raises(SystemExit) as raised:
        main(["fit", "--config", str(path), "--trainer.strategy=gpu"])
    assert str(raised.value) == ('cadence fit: trainer (Trainer): Trainer(strategy="gpu") is not a strategy. Use "auto", '
                                 '"cpu", "cuda", "cuda:N", "mps", "ddp" (also "ddp_spawn", "ddp_fork"), "fsdp" or a '
                                 'strategies.Strategy.')
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_an_error_raised_in_user_code_while_building_names_the_line_that_raised(parts, tmp_path):
    path = write(tmp_path, "run.yaml", RUN.replace("class_path: cli_parts.Data", "class_path: cli_parts.failing_data"))
    # The file relative to the working directory, where it is under it.
    with pytest.raises(SystemExit, match=r"cadence fit: data \(failing_data\): rows=3: use 4 or more \(at cli_parts\.py:\d+, in failing_data\)"):
        main(["fit", "--config", str(path)])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seed_everything=7", "--trainer.seed=8"], r"seed_everything: 7 and trainer.seed: 8 differ; set one of them"),
        (["--seed_everything=-1"], r"seed_everything: got -1; use an int in \[0, 2\*\*32 - 1\], true \(draw one\) or false"),
        (["--trainer.callbacks[3].init_args.patience=2"], r"there is no trainer.callbacks\[3\] \(trainer.callbacks is a list of 1\)"),
        (["--epochs=3"], r"Override --epochs: it must start with one of seed_everything, trainer, model"),
    ],
)
def test_a_bad_override_names_itself(parts, tmp_path, argv, match):
    path = write(tmp_path, "run.yaml", RUN)
    with pytest.raises(SystemExit, match=match):
        main(["fit", "--config", str(path), *argv])


def test_lightning_cli_is_refused_with_the_cadence_command():
    from trainer import LightningCLI

    with pytest.raises(NotImplementedError, match=r"LightningCLI is Lightning's.*cadence fit --config run.yaml"):
        LightningCLI(TrainingModule, DataModule)
