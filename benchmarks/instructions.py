"""Per-step overhead in CPU instructions, counted by valgrind: a figure that a busy machine does not blur.

Run from the repository root (valgrind must be installed; about 10 minutes on 2 cores for three contenders)::

    python benchmarks/instructions.py                       # every installed contender, tiny
    python benchmarks/instructions.py cadence-lean cadence-users

Wall-clock microseconds on a shared VM move by tens of percent from one second to the next;
instructions executed do not. Each contender trains the tiny workload twice under
``valgrind --tool=cachegrind`` (with address-space randomisation off, one thread, a fixed hash
seed), for ``--short`` and ``--long`` steps; the difference divided by the extra steps is its
instructions per step, start-up and fixed costs cancelled. Overhead = contender minus its hand loop
(``workloads.baseline_of``: the plain one, or the one under the same autocast for ``cadence-bf16-lean``).
The loggers' writer threads get the values at the end of the run, not once a second of valgrind's
slowed-down clock (``run_steps`` says why; ``--raw-handover`` counts as before). Importing torch and
the rest is about 9.7G instructions, a step about 1.9M, so the fixed part must be the same in the short
and the long run to a few million instructions: every run gets the same minimal environment and reads
the same bytecode, written before the runs (:func:`measured_environment`, :func:`compile_sources`).
Even so, the fixed part of two runs of the same code differs by up to ~4.5M instructions (the heap's
layout: glibc's malloc, CPython's pymalloc, pybind11's type cache; benchmarks/RESULTS.md round 10),
which is +-9k a step over 500 extra steps and +-2k over the default 2000: the same code measured twice
agrees to about 2k instructions a step. Instructions are not time: Python interpreter code
runs fewer instructions per microsecond than PyTorch's kernels, so read the microseconds from
``overhead.py`` and use this table to compare versions of Cadence and to see what an edit saved.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_steps(name: str, steps: int, raw_handover: bool = False) -> None:
    """The measured program: ``steps`` steps of ``name`` on the tiny workload, nothing else.

    The file loggers hand logged values to their writer threads at most once a second
    (``callbacks/async_logger.py``): in a real tiny run that is every ~2000 steps, but valgrind runs
    the program ~50 times slower, so a second passes every ~40 steps and the threads' wake-ups and
    file flushes would be counted per step ~50 times as often as they happen. Unless
    ``raw_handover``, the values are handed over at the end of the run instead: writing each of
    them still counts, the flush of a hand-over (once a second in a real run) does not.
    """
    import torch

    from workloads import TINY, Workload, contenders, make_loader, run_once

    if not raw_handover:
        from callbacks.async_logger import AsyncLogger

        AsyncLogger.handover_seconds = float("inf")
    torch.set_num_threads(1)
    workload = Workload("tiny", TINY.width, TINY.depth, TINY.batch_size, steps, steps, TINY.segment, 1)
    run_once(contenders(variants=True)[name], workload, make_loader(workload))


def measured_environment() -> dict[str, str]:
    """The measured process's whole environment, the same in every run and session.

    Only what it needs is passed on: the size of the environment moves the stack, and a variable
    one shell has and another lacks (``PYTHONDONTWRITEBYTECODE``, say) changes what Python does.
    No bytecode is written during the runs: :func:`compile_sources` wrote it before them.
    """
    env = {name: os.environ[name] for name in ("PATH", "HOME", "PYTHONPATH") if name in os.environ}
    return dict(env, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")


def compile_sources() -> None:
    """Write the bytecode of every module of the checkout before the runs, so that none of them
    compiles one (a module compiled in one run and read from ``__pycache__`` in the next moved a
    contender by millions of instructions: tens of thousands a step)."""
    for path in (HERE.parent, HERE):
        compileall.compile_dir(path, maxlevels=0 if path == HERE.parent else 10, quiet=1)
    for package in ("trainer", "callbacks", "strategies"):
        compileall.compile_dir(HERE.parent / package, quiet=1)


def count(name: str, steps: int, raw_handover: bool = False, keep: Path | None = None) -> int:
    """Instructions of a whole process that runs ``steps`` steps of ``name``; with ``keep``, its
    cachegrind file is kept there as ``<name>-<steps>.out`` (per function: ``cg_annotate``, ``cg_diff``, or ``--compare A B``)."""
    env = measured_environment()
    with tempfile.TemporaryDirectory() as scratch:
        command = ["setarch", "-R", "valgrind", "--tool=cachegrind", "--cache-sim=no",
                   f"--cachegrind-out-file={scratch}/out", sys.executable, str(Path(__file__).resolve()),
                   "--run", name, str(steps), *(["--raw-handover"] if raw_handover else [])]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE.parent, check=True)
        if keep is not None:
            shutil.copy(f"{scratch}/out", keep / f"{name}-{steps}.out")
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"valgrind printed no instruction count for {name}:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_function(path: Path) -> dict[str, int]:
    """Instructions per function (``fn=`` name) in a cachegrind file, summed over its lines."""
    totals: dict[str, int] = {}
    function = ""
    for line in path.read_text().splitlines():
        if line.startswith("fn="):
            function = line[3:]
        elif line[:1].isdigit() and len(fields := line.split()) > 1:
            totals[function] = totals.get(function, 0) + int(fields[1])
    return totals


def compare(keep: Path, first: str, second: str, short: int, long: int, rows: int = 30) -> None:
    """Per function, instructions a step of ``first`` minus ``second`` from files kept by ``--keep``
    (``(long-step file - short-step file) / (long - short)`` each), largest differences first."""
    def per_step(name: str) -> dict[str, float]:
        at_long, at_short = per_function(keep / f"{name}-{long}.out"), per_function(keep / f"{name}-{short}.out")
        return {key: (at_long.get(key, 0) - at_short.get(key, 0)) / (long - short) for key in {*at_long, *at_short}}

    a, b = per_step(first), per_step(second)
    difference = {key: a.get(key, 0.0) - b.get(key, 0.0) for key in {*a, *b}}
    print(f"{first} {sum(a.values()):,.0f} - {second} {sum(b.values()):,.0f} = {sum(difference.values()):+,.0f} a step")
    for key, value in sorted(difference.items(), key=lambda item: -abs(item[1]))[:rows]:
        print(f"{value:+9,.0f} {a.get(key, 0.0):10,.0f} {b.get(key, 0.0):10,.0f}  {key[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("contenders", nargs="*", help="default: every installed contender")
    parser.add_argument("--short", type=int, default=100)
    parser.add_argument("--long", type=int, default=2100)
    parser.add_argument("--raw-handover", action="store_true",
                        help="hand logged values to the writer threads once a second of valgrind's slow time "
                             "(see run_steps), not at the end")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep each run's cachegrind file in DIR, for cg_annotate/cg_diff per function")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"),
                        help="with --keep DIR of an earlier run: per function, A's instructions a step minus B's")
    parser.add_argument("--run", nargs=2, metavar=("NAME", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.run:
        run_steps(args.run[0], int(args.run[1]), args.raw_handover)
        return
    if args.compare:
        if args.keep is None:
            sys.exit("--compare A B reads the cachegrind files of an earlier run: give its --keep DIR.")
        compare(args.keep, *args.compare, args.short, args.long)
        return
    if shutil.which("valgrind") is None or shutil.which("setarch") is None:
        sys.exit("instructions.py needs valgrind and setarch (apt-get install valgrind util-linux).")

    from workloads import baseline_of, contenders

    chosen = args.contenders or [name for name in contenders() if name not in ("hand", "hand-again")]
    names = list(dict.fromkeys(["hand", *(baseline_of(name) for name in chosen), *chosen]))
    jobs = [(name, steps) for name in names for steps in (args.short, args.long)]
    compile_sources()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job, args.raw_handover, args.keep), jobs)))
    per_step = {name: (counts[name, args.long] - counts[name, args.short]) / (args.long - args.short) for name in names}
    print(f"## instructions per step: tiny, {args.long} - {args.short} steps, valgrind cachegrind\n")
    print("| contender | instructions/step | over its hand loop | share of a hand-loop step |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        baseline = baseline_of(name)
        extra = per_step[name] - per_step[baseline]
        label = name if baseline == "hand" else f"{name} (vs {baseline})"
        print(f"| {label} | {per_step[name]:,.0f} | {extra:+,.0f} | {extra / per_step[baseline]:+.1%} |")


if __name__ == "__main__":
    main()
