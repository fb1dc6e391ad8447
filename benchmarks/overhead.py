"""Per-step cost of Cadence (and PyTorch Lightning) over a hand-written loop.

Run from the repository root::

    python benchmarks/overhead.py tiny            # 32->32->1 MLP, batch 32, 1 thread
    python benchmarks/overhead.py medium          # 1024-wide 4-layer MLP, batch 256, 2 threads
    python benchmarks/overhead.py tiny --profile cadence-users   # where the time goes (cProfile)

Method: in each repeat every contender trains one epoch in lockstep with a hand-loop run: two
forked processes take turns every ``segment`` steps (50 for tiny, so each segment holds one log
step), so each interleaved pair of segments meets the same machine even when the host is busy.
Fixed costs (Trainer construction, logger threads, the end-of-epoch checkpoint) fall outside
the timed segments. Per repeat, overhead = median over segment pairs of (contender - hand) per
step, and ratio likewise; the table gives the median and range over repeats, and beside it the
difference of the 10th percentiles of all segments, which keeps only the quiet moments of a
noisy machine. The contender ``hand-again`` is the hand loop paired with itself: its row is the
noise floor of the method. A contender doing other math than the hand loop is paired with the
hand loop doing the same (``cadence-bf16-lean`` with ``hand-bf16``: both under bfloat16 autocast).

Output goes to a pseudo-terminal during the runs, so progress bars draw as they do for a user.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys

import torch

from workloads import (WORKLOADS, Workload, baseline_of, contenders, import_lazy_modules, lightning_version,
                       make_loader, run_once, terminal_output, time_pair)


def measure(workload: Workload, names: list[str], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per contender and repeat: its and the hand loop's segment times per step (seconds)."""
    runs = contenders()
    import_lazy_modules()
    results: dict[str, dict[str, list]] = {name: {"segments": [], "hand_segments": []} for name in names}
    for repeat in range(repeats):
        for name in names:
            steps, hands = time_pair(runs[name], workload, contender_first=repeat % 2 == 1, baseline=baseline_of(name))
            results[name]["segments"].append(steps)
            results[name]["hand_segments"].append(hands)
    return results


def quantile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[round(share * (len(ordered) - 1))]


def report(workload: Workload, results: dict[str, dict[str, list]], repeats: int) -> str:
    lines = [
        f"## {workload.name}: {workload.depth}-layer MLP, width {workload.width}, batch {workload.batch_size}, "
        f"{workload.threads} thread(s); {workload.steps} steps per run, timed in segments of {workload.segment} "
        f"after {workload.warmup_steps}; {repeats} repeats",
        "",
        "| contender | us/step | hand us/step | overhead us/step: median of repeats | range | ratio | "
        "overhead, quiet segments (pooled 10th percentiles) |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for name, series in results.items():
        pairs = list(zip(series["segments"], series["hand_segments"]))
        overheads = [statistics.median(c - h for c, h in zip(mine, hand)) * 1e6 for mine, hand in pairs]
        ratios = [statistics.median(c / h for c, h in zip(mine, hand)) for mine, hand in pairs]
        everything = [seconds for mine in series["segments"] for seconds in mine]
        hand_everything = [seconds for hand in series["hand_segments"] for seconds in hand]
        quiet = (quantile(everything, 0.1) - quantile(hand_everything, 0.1)) * 1e6
        label = name if baseline_of(name) == "hand" else f"{name} (vs {baseline_of(name)})"
        lines.append(
            f"| {label} | {statistics.median(everything) * 1e6:.1f} | {statistics.median(hand_everything) * 1e6:.1f} "
            f"| {statistics.median(overheads):+.1f} | {min(overheads):+.1f} .. {max(overheads):+.1f} "
            f"| {statistics.median(ratios):.3f}x | {quiet:+.1f} |"
        )
    lines += ["", f"torch {torch.__version__}, Python {platform.python_version()}, "
                  f"lightning {lightning_version() or 'not installed'}, {platform.machine()}, "
                  f"{os.cpu_count()} CPUs"]
    return "\n".join(lines)


def profile(workload: Workload, name: str, top: int) -> None:
    contender = contenders()[name]
    run_once(contender, workload, make_loader(workload))  # warm-up
    profiler = cProfile.Profile()
    with terminal_output():
        profiler.enable()
        run_once(contender, workload, make_loader(workload))
        profiler.disable()
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contenders", nargs="*", help="default: every installed contender but hand")
    parser.add_argument("--profile", metavar="CONTENDER", help="cProfile one long run of CONTENDER instead")
    parser.add_argument("--top", type=int, default=30, help="rows of the profile to print")
    parser.add_argument("--json", metavar="PATH", help="also write the raw per-repeat seconds here")
    args = parser.parse_args()

    workload = WORKLOADS[args.workload]
    torch.set_num_threads(workload.threads)
    if args.profile:
        profile(workload, args.profile, args.top)
        return
    names = args.contenders or [name for name in contenders() if name != "hand"]
    with terminal_output() as out:
        results = measure(workload, names, args.repeats)
        print(report(workload, results, args.repeats), file=out)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"workload": workload.name, "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
