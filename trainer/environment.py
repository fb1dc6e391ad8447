"""What a bug report needs to say about the machine: versions, devices, CPU and the environment.

    cadence env            # plain text, to paste into an issue
    cadence env --json     # for scripts and bug-report templates
    python -c "import trainer; print(trainer.environment_report())"

The JSON has snake_case keys and typed values: numbers are numbers, flags are booleans, lists are
lists, and what does not exist is ``null`` (``versions.cuda`` on a CPU build, a package that is not
installed)::

    {"versions": {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.8", "cudnn": 91002, "nccl": "2.27.3", ...},
     "devices": {"cuda": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2,
                           "compute_capability": [9, 0], "bf16": true}],
                 "mps": {"built": false, "available": false}},
     "cpu": {"cores": 32, "usable_cores": 16, "torch_threads": 16, "interop_threads": 16, ...},
     "environment": {"CUDA_VISIBLE_DEVICES": "0,1", ...}}

Nothing here initializes CUDA beyond the device queries, or imports NumPy, TensorBoard or YAML:
package versions come from the installed metadata.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

#: Packages whose versions a report lists (the runtime dependencies).
PACKAGES = ("numpy", "tqdm", "tensorboard", "pyyaml")
#: Environment variables a report shows when they are set: names, and prefixes ending in "_".
VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "TORCHELASTIC_", "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ENABLE_MPS_FALLBACK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID",
)

TITLES = {"versions": "Versions", "devices": "Devices", "cpu": "CPU", "environment": "Environment variables"}


@dataclass
class EnvironmentReport:
    """The report as typed sections; ``str()`` is the text for people, :meth:`to_json` the JSON."""

    versions: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, Any] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {"versions": self.versions, "devices": self.devices, "cpu": self.cpu, "environment": self.environment}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def __str__(self) -> str:
        lines = []
        for key, section in (("versions", _versions_text(self.versions)), ("devices", _devices_text(self.devices)),
                             ("cpu", _cpu_text(self.cpu)), ("environment", self.environment)):
            lines.append(f"{TITLES[key]}:")
            if not section:
                lines.append("  (none of the variables a report looks for is set)")
            width = max((len(name) for name in section), default=0)
            lines += [f"  {name:<{width}}  {value}" for name, value in section.items()]
        return "\n".join(lines)


def environment_report() -> EnvironmentReport:
    """Versions (Python, torch, CUDA, cuDNN, NCCL, the dependencies, Cadence), each device (name,
    memory, compute capability, native bf16), MPS, the CPU and torch's threads, and the environment
    variables that change how PyTorch and distributed runs behave."""
    return EnvironmentReport(versions=_versions(), devices=_devices(), cpu=_cpu(), environment=_variables())


# --- the typed values ------------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    versions: dict[str, Any] = {
        "python": platform.python_version(), "python_implementation": platform.python_implementation(),
        "platform": platform.platform(), "torch": torch.__version__, "torch_path": str(Path(torch.__file__).parent),
        "cuda": torch.version.cuda,  # the CUDA torch was built with; None in a CPU build
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version(),
    }
    for package in PACKAGES:
        versions[package] = _installed(package)
    versions["cadence"] = _installed("torchcadence")
    versions["cadence_path"] = str(Path(__file__).resolve().parents[1])
    return versions


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _devices() -> dict[str, Any]:
    cuda = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            capability = [properties.major, properties.minor]
            cuda.append({"index": index, "name": properties.name, "memory_gib": round(properties.total_memory / 2**30, 1),
                         "compute_capability": capability, "bf16": capability >= [8, 0]})  # earlier GPUs emulate it
    mps = torch.backends.mps
    return {"cuda": cuda, "mps": {"built": mps.is_built(), "available": mps.is_available()}}


def _cpu() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    distributed = torch.distributed.is_available()
    backends = [name for name, available in (("gloo", distributed and torch.distributed.is_gloo_available()),
                                              ("nccl", distributed and torch.distributed.is_nccl_available()),
                                              ("mpi", distributed and torch.distributed.is_mpi_available()))
                if available]
    return {
        "cores": os.cpu_count(), "usable_cores": usable,
        "torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "machine": platform.machine(), "processor": platform.processor() or None,
        "distributed_backends": backends, "executable": sys.executable,
    }


def _variables() -> dict[str, str]:
    return {name: value for name, value in sorted(os.environ.items())
            if any(name.startswith(pattern) if pattern.endswith("_") else name == pattern for pattern in VARIABLES)}


# --- the text for people -----------------------------------------------------------------------------
def _versions_text(versions: dict[str, Any]) -> dict[str, str]:
    if not versions:
        return {}
    text = {
        "python": f"{versions['python']} ({versions['python_implementation']}, {versions['platform']})",
        "torch": f"{versions['torch']} ({versions['torch_path']})",
        "cuda (torch built with)": versions["cuda"] or "none (a CPU build)",
        "cudnn": str(versions["cudnn"]) if versions["cudnn"] is not None else "not available",
        "nccl": versions["nccl"] or "not available",
    }
    for package in PACKAGES:
        text[package] = versions[package] or "not installed"
    text["cadence"] = f"{versions['cadence'] or 'not installed'} ({versions['cadence_path']})"
    return text


def _devices_text(devices: dict[str, Any]) -> dict[str, str]:
    if not devices:
        return {}
    text = {}
    if not devices["cuda"]:
        text["cuda"] = "not available" + ("" if torch.version.cuda else " (a CPU build of torch)")
    for device in devices["cuda"]:
        major, minor = device["compute_capability"]
        text[f"cuda:{device['index']}"] = (f"{device['name']}, {device['memory_gib']:.1f} GiB, compute capability "
                                           f"{major}.{minor}, bf16 {'yes' if device['bf16'] else 'no (emulated; use fp16)'}")
    mps = devices["mps"]
    text["mps"] = "available" if mps["available"] else ("built, not available" if mps["built"] else "not built")
    return text


def _cpu_text(cpu: dict[str, Any]) -> dict[str, str]:
    if not cpu:
        return {}
    return {
        "cores": f"{cpu['cores']} ({cpu['usable_cores']} usable by this process)",
        "torch threads": f"{cpu['torch_threads']} (inter-op {cpu['interop_threads']})",
        "machine": f"{cpu['machine']}, {cpu['processor'] or 'unknown processor'}",
        "distributed backends": ", ".join(cpu["distributed_backends"]) or "none",
        "executable": cpu["executable"],
    }
