"""What a bug report needs to say about the machine: versions, devices, CPU and the environment.

    cadence env            # plain text, to paste into an issue
    cadence env --json     # for machines
    python -c "import trainer; print(trainer.environment_report())"

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
    """The report, as sections of ``name: value``; ``str()`` is the text, :meth:`to_json` the JSON."""

    versions: dict[str, str] = field(default_factory=dict)
    devices: dict[str, str] = field(default_factory=dict)
    cpu: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {"versions": self.versions, "devices": self.devices, "cpu": self.cpu, "environment": self.environment}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def __str__(self) -> str:
        lines = []
        for key, section in self.as_dict().items():
            lines.append(f"{TITLES[key]}:")
            if not section:
                lines.append("  (none of the variables a report looks for is set)")
            width = max((len(name) for name in section), default=0)
            lines += [f"  {name:<{width}}  {value}" for name, value in section.items()]
        return "\n".join(lines)


def environment_report() -> EnvironmentReport:
    """Versions (Python, torch, CUDA, cuDNN, NCCL, the dependencies, Cadence), each device (name,
    memory, compute capability, bf16), MPS, the CPU and torch's threads, and the environment
    variables that change how PyTorch and distributed runs behave."""
    return EnvironmentReport(versions=_versions(), devices=_devices(), cpu=_cpu(), environment=_variables())


def _versions() -> dict[str, str]:
    versions = {
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {platform.platform()})",
        "torch": f"{torch.__version__} ({Path(torch.__file__).parent})",
        "cuda (torch built with)": torch.version.cuda or "none (a CPU build)",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "not available",
        "nccl": _nccl_version(),
    }
    for package in PACKAGES:
        versions[package] = _installed(package)
    versions["cadence"] = f"{_installed('torchcadence')} ({Path(__file__).resolve().parents[1]})"
    return versions


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _nccl_version() -> str:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return "not available"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _devices() -> dict[str, str]:
    devices = {}
    if not torch.cuda.is_available():
        devices["cuda"] = "not available" + ("" if torch.version.cuda else " (a CPU build of torch)")
    else:
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            capability = (properties.major, properties.minor)
            devices[f"cuda:{index}"] = (
                f"{properties.name}, {properties.total_memory / 2**30:.1f} GiB, compute capability "
                f"{capability[0]}.{capability[1]}, bf16 {'yes' if capability >= (8, 0) else 'no (emulated; use fp16)'}"
            )
    mps = torch.backends.mps
    devices["mps"] = "available" if mps.is_available() else ("built, not available" if mps.is_built() else "not built")
    return devices


def _cpu() -> dict[str, str]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    backends = [name for name, available in (("gloo", torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                              ("nccl", torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                                              ("mpi", torch.distributed.is_available() and torch.distributed.is_mpi_available()))
                if available]
    return {
        "cores": f"{os.cpu_count()} ({usable} usable by this process)",
        "torch threads": f"{torch.get_num_threads()} (inter-op {torch.get_num_interop_threads()})",
        "machine": f"{platform.machine()}, {platform.processor() or 'unknown processor'}",
        "distributed backends": ", ".join(backends) or "none",
        "executable": sys.executable,
    }


def _variables() -> dict[str, str]:
    return {name: value for name, value in sorted(os.environ.items())
            if any(name.startswith(pattern) if pattern.endswith("_") else name == pattern for pattern in VARIABLES)}
