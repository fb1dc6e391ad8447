"""What each way of keeping the training loss for the non-finite check costs per step, in CPU
instructions counted by valgrind (see ``trainer/guards.py`` for why the choice matters).

Run from the repository root (valgrind and setarch must be installed; about 20 minutes on 2 cores)::

    python benchmarks/loss_guard_cost.py

Each option runs a tiny step (a 4-element product summed to a 0-dim loss, with autograd) for 200
and for 1200 steps under ``valgrind --tool=cachegrind``; the difference divided by 1000 is its
instructions per step, start-up cancelled. "none" keeps nothing: the other rows minus it are what
the option adds to a step.

    list       the loss itself in a list (what the loop does where no CUDA graph can replay; wrong under them)
    clone      a copy of the loss in a list (what the loop does where one can: on CUDA, under a graph-replaying Compile)
    isfinite   the loss's isfinite() in a list (batch known, value lost)
    flag       a device-side "all finite so far" flag, updated in place (which batch is lost)
    sum        a running float64 sum of the losses, non-finite once any loss is (which batch is lost)
"""

from __future__ import annotations

import re
import subprocess
import sys

OPTIONS = ("none", "list", "clone", "isfinite", "flag", "sum")


def steps(option: str, count: int) -> None:
    """The measured program: ``count`` steps keeping the loss the ``option`` way."""
    import torch

    torch.set_num_threads(1)
    weight = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    kept: list = []
    flag = torch.ones((), dtype=torch.bool)
    total = torch.zeros((), dtype=torch.float64)
    for index in range(count):
        loss = (weight * x).sum()
        if option == "list":
            kept.append((loss.detach(), index, index))
        elif option == "clone":
            kept.append((loss.detach().clone(), index, index))
        elif option == "isfinite":
            kept.append((torch.isfinite(loss.detach()), index, index))
        elif option == "flag":
            flag.logical_and_(torch.isfinite(loss.detach()))
            kept.append((index, index))
        elif option == "sum":
            total.add_(loss.detach())
            kept.append((index, index))
        if len(kept) == 50:  # a log step checks and clears the list
            kept = []


def instructions(option: str, count: int) -> int:
    command = ["setarch", "-R", "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, __file__, "--run", option, str(count)]
    env = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return int(re.search(r"I\s+refs:\s+([\d,]+)", done.stderr).group(1).replace(",", ""))


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        steps(sys.argv[2], int(sys.argv[3]))
        return
    per_step = {option: (instructions(option, 1200) - instructions(option, 200)) / 1000 for option in OPTIONS}
    print("| option | instructions per step | added to a step |\n| --- | ---: | ---: |")
    for option in OPTIONS:
        print(f"| {option} | {per_step[option]:,.0f} | {per_step[option] - per_step['none']:+,.0f} |")


if __name__ == "__main__":
    main()
