"""The digits example keeps working: it loads the shipped data, trains, and says where its files went."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def digits(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from examples import digits

    return digits


def test_the_digits_data_is_the_uci_test_set(digits):
    images, labels = digits.load_digits()
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    assert 0.0 <= images.min() and images.max() == 1.0
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_the_digits_example_learns_and_prints_where_logs_and_checkpoints_went(digits, tmp_path, capsys):
    digits.main(["--max-epochs", "3", "--strategy", "cpu", "--root-dir", str(tmp_path)])
    out = capsys.readouterr().out
    version = tmp_path / "cadence_logs" / "version_0"
    assert f"Logs (metrics.csv, TensorBoard events): {version}" in out
    best = next(line for line in out.splitlines() if line.startswith("Best checkpoint: ")).split(": ", 1)[1]
    assert Path(best).is_file() and Path(best).parent == version / "checkpoints"
    accuracy = float(out.split("Best validation accuracy: ")[1].split()[0])
    assert accuracy > 0.85  # three short epochs; the full run reaches about 0.98
    assert (version / "metrics.csv").is_file()
