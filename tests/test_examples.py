"""Every example runs, briefly, with the command the README and docs/ give for it, so none can rot.

Each command below appears verbatim in README.md or a page of docs/ (tests/test_docs.py checks
that, and that the docs give no other command but those marked as needing hardware); a test runs
it with a few arguments appended that make it short (a few steps, a temporary log directory) or,
for torchrun, with the machine names of the loopback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import yaml

import callbacks
from processes import free_port, run_together, torchrun
from trainer.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

DIGITS_SCRIPT = "python examples/digits.py"
DIGITS_SCRIPT_DDP = "python examples/digits.py --strategy ddp --devices 2"
DIGITS_FIT = "cadence fit --config examples/digits.yaml"
DIGITS_TEST = "cadence test --config examples/digits.yaml --ckpt_path best"
DIGITS_DDP = "cadence fit --config examples/digits.yaml --config examples/digits_ddp.yaml"
TORCHRUN_ONE_MACHINE = "torchrun --nproc-per-node=4 -m trainer fit --config examples/digits.yaml"
TORCHRUN_TWO_MACHINES = ("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 "
                         "--rdzv-id=digits -m trainer fit --config examples/digits.yaml")
CHARLM = "cadence fit --config examples/charlm.yaml"
CHARLM_SPEED = "cadence fit --config examples/charlm.yaml --config examples/charlm_speed.yaml --trainer.strategy=cuda"
GAN = "cadence fit --config examples/gan.yaml"
COMMANDS = (DIGITS_SCRIPT, DIGITS_SCRIPT_DDP, DIGITS_FIT, DIGITS_TEST, DIGITS_DDP, TORCHRUN_ONE_MACHINE,
            TORCHRUN_TWO_MACHINES, CHARLM, CHARLM_SPEED, GAN)

#: Appended to every cadence command: quiet, and writing under the test's directory.
QUIET = ["--trainer.enable_progress_bar=false"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The repository importable (``examples.*``) and the working directory in ``tmp_path``."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cadence(command: str, *extra: str) -> int:
    """Run a README ``cadence ...`` command (its files relative to the repository) in this process."""
    words = shlex.split(command)
    assert words[0] == "cadence"
    arguments = [str(ROOT / word) if word.startswith("examples/") else word for word in words[1:]]
    return main([*arguments, *QUIET, *extra])


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def test_the_digits_data_is_the_uci_test_set(in_tmp):
    from examples.digits import load_digits

    images, labels = load_digits()
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    assert 0.0 <= images.min() and images.max() == 1.0
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_the_digits_script_and_yaml_train_identical_weights_and_test_them(in_tmp, capsys):
    from examples import digits

    digits.main([*shlex.split(DIGITS_SCRIPT)[2:], "--max-epochs", "2", "--root-dir", str(in_tmp / "script")])
    out = capsys.readouterr().out
    script_dir = in_tmp / "script" / "lightning_logs" / "version_0"
    assert f"Logs (metrics.csv, TensorBoard events): {script_dir}" in out
    script_best = Path(re.search(r"Best checkpoint: (.*)", out).group(1))
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)", out).group(1))
    assert accuracy > 0.8  # two epochs; the full run reaches about 0.97

    assert cadence(DIGITS_FIT, "--trainer.max_epochs=2", "--trainer.default_root_dir=yaml") == 0
    yaml_best = Path(re.search(r"Best checkpoint \(ModelCheckpoint\): (.*)", capsys.readouterr().err).group(1))
    assert yaml_best.name == script_best.name
    script_weights, yaml_weights = state_dict(script_best), state_dict(yaml_best)
    assert all(torch.equal(script_weights[key], yaml_weights[key]) for key in script_weights)

    assert cadence(DIGITS_TEST, "--trainer.default_root_dir=yaml") == 0
    tested = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert float(tested["test/acc"]) == pytest.approx(accuracy, abs=1e-4)  # the same weights on the same test set


#: Appended to the multi-process cadence runs: one epoch, no logger.
ONE_EPOCH = ["--trainer.max_epochs=1", "--trainer.limit_val_batches=1", "--trainer.logger=false"]
#: ... and for torchrun, three batches of it.
BRIEF_RUN = [*ONE_EPOCH, *QUIET, "--trainer.limit_train_batches=3"]


@contextlib.contextmanager
def output_into(path: Path):
    """Everything written to stdout and stderr, by this process and the workers it starts, goes to ``path``."""
    with open(path, "w") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        sys.stdout.flush()
        saved = [os.dup(1), os.dup(2)]
        for descriptor in (1, 2):
            os.dup2(file.fileno(), descriptor)
        try:
            yield
        finally:
            file.flush()
            for descriptor, copy in zip((1, 2), saved):
                os.dup2(copy, descriptor)
                os.close(copy)


@pytest.fixture(scope="module")
def multi_process_runs(tmp_path_factory):
    """The four multi-process README commands: the script and the config under DDP, run in this
    process as the single-process tests above run them (their two spawned workers each), while
    torchrun on one machine and torchrun on two "machines" of the loopback run as commands.

    Returns each run's directory and output (both "machines" of the loopback: node0 and node1)."""
    root = tmp_path_factory.mktemp("multi_process")
    script = shlex.split(DIGITS_SCRIPT_DDP)
    config = shlex.split(DIGITS_DDP)
    one_machine = shlex.split(TORCHRUN_ONE_MACHINE.replace("--nproc-per-node=4", "--nproc-per-node=2"))
    two_machines = shlex.split(TORCHRUN_TWO_MACHINES.replace("--nproc-per-node=8", "--nproc-per-node=1").replace(
        "node0:29400", f"127.0.0.1:{free_port()}"))
    assert (script[:2], config[0], one_machine[0], two_machines[0]) == (["python", "examples/digits.py"], "cadence",
                                                                         "torchrun", "torchrun")
    commands = {
        "one_machine": torchrun(*one_machine[1:], *BRIEF_RUN, f"--trainer.default_root_dir={root / 'one_machine'}"),
        "node0": torchrun(*two_machines[1:], *BRIEF_RUN, f"--trainer.default_root_dir={root / 'two_machines'}"),
    }
    commands["node1"] = commands["node0"]
    # Five processes train on two cores: one thread each (torchrun with more than one process per
    # machine sets that itself; DDP's spawned workers too). torchrun on one machine rendezvouses on
    # port 29500 unless told otherwise: another, free one.
    env = [{"OMP_NUM_THREADS": "1", **({"PET_MASTER_PORT": str(free_port())} if name == "one_machine" else {})}
           for name in commands]
    with concurrent.futures.ThreadPoolExecutor(1) as background, pytest.MonkeyPatch.context() as patch:
        torchruns = background.submit(run_together, list(commands.values()), cwd=ROOT, env=env)
        patch.syspath_prepend(str(ROOT))  # the workers unpickle examples.digits
        from examples import digits

        with output_into(root / "script.txt"):
            digits.main([*script[2:], "--max-epochs", "1", "--root-dir", str(root / "script")])
        with output_into(root / "config.txt"):
            assert cadence(DIGITS_DDP, *ONE_EPOCH, f"--trainer.default_root_dir={root / 'config'}") == 0
        results = torchruns.result()
    for name, (status, output) in zip(commands, results):
        assert status == 0, f"{name} failed:\n{output}"
    runs = {name: (root / name, (root / f"{name}.txt").read_text()) for name in ("script", "config")}
    directories = {"one_machine": "one_machine", "node0": "two_machines", "node1": "two_machines"}
    return {**runs, **{name: (root / directories[name], output) for name, (_, output) in zip(commands, results)}}


def test_the_digits_script_and_config_train_the_same_weights_in_two_ddp_processes(multi_process_runs):
    _, script_output = multi_process_runs["script"]
    assert script_output.count("DDP: 2 processes on 1 machine(s), spawned, backend gloo") == 2  # fit, then test
    assert float(re.search(r"Test accuracy: ([\d.]+)", script_output).group(1)) > 0.5  # one epoch
    directory, config_output = multi_process_runs["config"]
    assert "DDP: 2 processes on 1 machine(s), spawned, backend gloo" in config_output
    version = directory / "lightning_logs" / "version_0"
    assert f"Configuration: {version / 'config.yaml'}" in config_output  # said by rank zero, which wrote it
    config = yaml.safe_load((version / "config.yaml").read_text())
    assert config["trainer"]["strategy"] == "ddp" and config["trainer"]["devices"] == 2
    script_best = Path(re.search(r"Best checkpoint: (.*)", script_output).group(1))
    config_best = Path(re.search(r"Best checkpoint \(ModelCheckpoint\): (.*/epoch=0-val_acc=0\.\d+\.ckpt)", config_output).group(1))
    assert config_best.name == script_best.name
    script_weights, config_weights = state_dict(script_best), state_dict(config_best)
    assert all(torch.equal(script_weights[key], config_weights[key]) for key in script_weights)  # still in step


@pytest.mark.parametrize("run, machines", [("one_machine", 1), ("node0", 2)])
def test_the_torchrun_commands_run_the_digits_config_on_the_loopback(multi_process_runs, run, machines):
    directory, output = multi_process_runs[run]
    nodes_output = output + (multi_process_runs["node1"][1] if run == "node0" else "")
    assert nodes_output.count(f"DDP: 2 processes on {machines} machine(s), joined from torchrun") == 1  # rank zero
    version = directory / "lightning_logs" / "version_0"
    assert yaml.safe_load((version / "config.yaml").read_text())["trainer"]["strategy"] == "auto"
    assert (version / "checkpoints" / "last.ckpt").is_file() and not (directory / "lightning_logs" / "version_1").exists()


def test_the_character_language_model_reports_perplexity_and_samples_text(in_tmp, capsys):
    brief = ["--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2",
             "--data.init_args.max_chars=200000", "--model.init_args.sample_chars=30", "--trainer.logger=false"]
    assert cadence(CHARLM, *brief) == 0
    out = capsys.readouterr().out
    perplexity, loss = map(float, re.search(r"Validation perplexity ([\d.]+) \(loss ([\d.]+) nats", out).groups())
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-2)
    assert 1 < perplexity < 2 * 97  # four steps from uniform guessing among 97 characters
    samples = out.split("Samples (temperature 0.8):\n")[1].split("---\n")[1:]
    prompts = ["def ", "class ", "    if "]
    assert [sample[:len(prompt)] for sample, prompt in zip(samples, prompts)] == prompts
    assert [len(sample.rstrip("\n")) for sample in samples] == [len(prompt) + 30 for prompt in prompts]


SPEED_CALLBACKS = ("GradientCheckpointing", "Compile", "AMP")


@pytest.mark.skipif(not all(hasattr(callbacks, name) for name in SPEED_CALLBACKS),
                    reason="needs the speed callbacks: callbacks.GradientCheckpointing, Compile and AMP")
def test_the_speed_config_adds_checkpointing_compile_and_amp_to_the_language_model(in_tmp, capsys):
    assert cadence(CHARLM_SPEED, "--print_config") == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert [c["class_path"] for c in config["trainer"]["callbacks"]] == [
        f"callbacks.{name}" for name in SPEED_CALLBACKS]
    assert config["trainer"]["strategy"] == "cuda" and config["model"]["init_args"]["depth"] == 2


def test_the_gan_steps_two_optimizers_and_draws_digits(in_tmp, capsys):
    assert cadence(GAN, "--trainer.max_steps=6", "--trainer.logger=false") == 0
    out = capsys.readouterr().out
    assert "8 generated digits after 6 optimizer steps:" in out  # two optimizer steps per batch
    drawing = out.split("optimizer steps:\n")[1].split("\n\n")[:2]
    assert [len(block.splitlines()) for block in drawing] == [8, 8]  # two rows of four 8x8 digits
    assert all(len(line) == 4 * 16 + 3 * 3 for block in drawing for line in block.splitlines())


def test_the_readme_training_module_example_runs_as_written(in_tmp, capsys):
    code = re.search(r"## What you write\n\n```python\n(.*?)```", README, re.S).group(1)
    assert "max_epochs=20" in code
    exec(compile(code.replace("max_epochs=20", "max_epochs=1"), "README.md", "exec"), {"__name__": "__main__"})
    tested = eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(tested[0]) == ["test/acc"] and tested[0]["test/acc"] > 0.5
