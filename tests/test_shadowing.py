"""A user's file named like a Cadence package (``callbacks.py`` next to the script) is named in the
error, with what to do, instead of a puzzling ``cannot import name 'Callback' from 'callbacks'``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(directory: Path, source: str) -> subprocess.CompletedProcess:
    """``python train.py`` in ``directory``, with Cadence importable as when it is installed."""
    (directory / "train.py").write_text(source)
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "train.py"], cwd=directory, env=environment, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("own_file, script", [
    ("callbacks.py", "from trainer import Trainer\n"),  # the case: Cadence's trainer imports callbacks
    ("strategies.py", "from trainer import Trainer\n"),
    ("trainer.py", "from callbacks import ModelCheckpoint\nfrom trainer import Trainer\n"),  # isort's order
])
def test_a_users_file_that_shadows_a_cadence_package_is_named_with_the_fix(tmp_path, own_file, script):
    (tmp_path / own_file).write_text("VALUE = 1\n")
    done = run_script(tmp_path, script)
    package = own_file.removesuffix(".py")
    assert done.returncode == 1
    assert (f"ImportError: {tmp_path / own_file} shadows Cadence's package '{package}' ({ROOT / package}): Python "
            f"finds it first because it is in the script's directory or the current one. Rename it (e.g. "
            f"my_{package}.py)") in done.stderr


def test_files_with_other_names_pass_the_check(tmp_path):
    (tmp_path / "my_callbacks.py").write_text("VALUE = 1\n")
    (tmp_path / "callbacks").mkdir()  # a directory without __init__.py: a regular package wins over it
    # The check alone (importing the packages would import torch: seconds, for nothing more here).
    done = run_script(tmp_path, "import _cadence_shadowing\n_cadence_shadowing.check_packages()\nprint('checked')\n")
    assert (done.returncode, done.stdout.strip()) == (0, "checked"), done.stderr
