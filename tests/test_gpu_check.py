"""``benchmarks/gpu_check.py``, the one GPU check, on a machine without a GPU: it runs, says every
part needs one, and writes its two summaries; the comparison at its heart (fit against a hand loop,
bit for bit) holds on the CPU. The GPU itself: see benchmarks/RESULTS.md once the check has run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_on_a_machine_without_a_gpu_every_part_says_so_and_both_summaries_are_written(tmp_path):
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as in CI, also on a machine with a GPU
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), str(tmp_path / "out")], env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(report["parts"]) == ["gpu_dataset", "memory", "profiler", "fsdp_offload", "cuda_graphs", "report", "sync",
                                     "amp", "prefetch", "fsdp", "microbatch"]
    assert {part["status"] for part in report["parts"].values()} == {"skipped: no GPU"} and report["ok"]
    text = (tmp_path / "out" / "gpu_check.txt").read_text()
    assert text.startswith("gpu_check ") and "no GPU x0" in text and text.count("skipped: no GPU  ") == 11
    assert done.stdout.strip() == text.strip()


def test_the_amp_part_finds_fit_and_the_hand_loop_bit_equal_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])  # put back after the test
    import gpu_check
    import gpu_probes  # noqa: F401  (the probes import cleanly; they run on a GPU only)
    import microbatch_gpu  # noqa: F401  (likewise)

    result = gpu_check.amp(tmp_path, device="cpu", configs=("fp32", "fp16", "bf16-true"), width=8, depth=1, batch=4, steps=4, warmup=1)
    assert result["status"] == "passed", result["summary"]
    assert [(row["config"], row["bit_equal"]) for row in result["rows"]] == [("fp32", True), ("fp16", True),
                                                                                   ("bf16-true", True)]
