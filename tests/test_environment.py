"""The environment report (``cadence env``, ``trainer.environment_report()``): what a bug report needs."""

from __future__ import annotations

import json
import os
import platform
import re
from types import SimpleNamespace

import torch

from trainer import environment_report
from trainer.cli import main


def test_the_report_names_versions_threads_and_the_variables_that_are_set(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("SOMETHING_ELSE", "private")
    text = str(environment_report())
    for expected in (f"python                   {platform.python_version()}", f"torch                    {torch.__version__}",
                     "numpy", "tqdm", "tensorboard", "pyyaml", "cadence", "cudnn", "nccl",
                     f"torch threads         {torch.get_num_threads()} (inter-op {torch.get_num_interop_threads()})",
                     "NCCL_DEBUG       INFO", "OMP_NUM_THREADS  3"):
        assert expected in text, expected
    assert "SOMETHING_ELSE" not in text and "private" not in text


def test_each_cuda_device_is_listed_with_memory_capability_and_bf16(monkeypatch):
    devices = [SimpleNamespace(name="NVIDIA H100", total_memory=80 * 2**30, major=9, minor=0),
               SimpleNamespace(name="Tesla T4", total_memory=15 * 2**30, major=7, minor=5)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the device queries: no GPU here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: devices[index])
    report = environment_report()
    text = str(report)
    assert "cuda:0  NVIDIA H100, 80.0 GiB, compute capability 9.0, bf16 yes" in text
    assert "cuda:1  Tesla T4, 15.0 GiB, compute capability 7.5, bf16 no (emulated; use fp16)" in text
    assert json.loads(report.to_json())["devices"]["cuda"] == [
        {"index": 0, "name": "NVIDIA H100", "memory_gib": 80.0, "compute_capability": [9, 0], "bf16": True},
        {"index": 1, "name": "Tesla T4", "memory_gib": 15.0, "compute_capability": [7, 5], "bf16": False}]


def test_cadence_env_prints_text_or_json(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Versions:\n") and "CUDA_VISIBLE_DEVICES  1,0" in text
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"versions", "devices", "cpu", "environment"}
    assert report["versions"]["torch"] == torch.__version__ and report["environment"]["CUDA_VISIBLE_DEVICES"] == "1,0"


def test_the_json_has_machine_readable_keys_and_typed_values(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    report = json.loads(environment_report().to_json())
    for section in ("versions", "devices", "cpu"):
        assert all(re.fullmatch(r"[a-z][a-z0-9_]*", key) for key in report[section]), report[section]
    versions, cpu = report["versions"], report["cpu"]
    assert versions["python"] == platform.python_version() and versions["cuda"] == torch.version.cuda
    assert versions["cudnn"] is None or isinstance(versions["cudnn"], int)
    assert report["devices"] == {"cuda": [], "mps": {"built": torch.backends.mps.is_built(), "available": False}}
    assert (cpu["cores"], cpu["usable_cores"]) == (os.cpu_count(), len(os.sched_getaffinity(0)))
    assert cpu["torch_threads"] == torch.get_num_threads() and "gloo" in cpu["distributed_backends"]
