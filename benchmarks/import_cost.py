"""What importing Cadence (and PyTorch Lightning) costs on top of ``import torch``.

Run from the repository root::

    python benchmarks/import_cost.py            # 7 fresh interpreters per row, median
    python benchmarks/import_cost.py --repeats 15

Each measurement is a fresh interpreter that imports torch, then the framework, and reports the
seconds and the number of modules each import added. Bytecode is compiled once beforehand into a
temporary cache (``PYTHONPYCACHEPREFIX``), as an installed package has it. The rows alternate between frameworks, so
a slow moment of the machine does not land on one of them only. The modules that must load
lazily (torch._dynamo, tensorboard, yaml, tqdm) are listed when the framework import added them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAZY = ("torch._dynamo", "torch.utils.tensorboard", "tensorboard", "yaml", "tqdm")

PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
torch_seconds = time.perf_counter() - start
torch_modules = set(sys.modules)
start = time.perf_counter()
{imports}
seconds = time.perf_counter() - start
added = set(sys.modules) - torch_modules
lazy = {lazy!r}
print(json.dumps({{
    "torch_seconds": torch_seconds, "seconds": seconds, "torch_modules": len(torch_modules),
    "added_modules": len(added),
    "lazy_loaded": [name for name in lazy if name in added],
}}))
"""

FRAMEWORKS = {
    "cadence": "import trainer, callbacks, strategies",
    "lightning": "import lightning",
}


def probe(imports: str, bytecode_cache: str) -> dict:
    code = PROBE.format(imports=imports, lazy=LAZY)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONPYCACHEPREFIX=bytecode_cache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def lightning_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("lightning") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    names = [name for name in FRAMEWORKS if name != "lightning" or lightning_installed()]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    # Users import compiled bytecode (pip writes it at install). A first, untimed round compiles
    # every module into a temporary cache outside the tree, which the timed rounds then read.
    with tempfile.TemporaryDirectory() as bytecode_cache:
        for name in names:
            probe(FRAMEWORKS[name], bytecode_cache)
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(probe(FRAMEWORKS[name], bytecode_cache))
    print(f"## import: fresh interpreter, median of {args.repeats}\n")
    print("| import | `import torch` s | extra s, median | extra s, range | modules added | lazy modules it loaded |")
    print("| --- | ---: | ---: | --- | ---: | --- |")
    for name in names:
        extra = [run["seconds"] for run in runs[name]]
        print(f"| `{FRAMEWORKS[name]}` | {statistics.median(run['torch_seconds'] for run in runs[name]):.3f} "
              f"| {statistics.median(extra):.3f} | {min(extra):.3f} .. {max(extra):.3f} "
              f"| {runs[name][0]['added_modules']} | {', '.join(runs[name][0]['lazy_loaded']) or 'none'} |")
    print(f"\n`import torch` itself loads {runs[names[0]][0]['torch_modules']} modules.")


if __name__ == "__main__":
    main()
