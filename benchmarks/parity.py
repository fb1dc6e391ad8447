"""Cadence's trained weights against the hand-written loop's, bit for bit.

Run from the repository root::

    python benchmarks/parity.py               # tiny workload, one epoch of 2000 steps

Every contender starts from the same seeded weights and trains one epoch on an ordinary
``DataLoader(shuffle=True)`` that draws its order from torch's global RNG, seeded the same way
before each run: a framework that draws from that RNG, or changes the math in any way (a loss
scaled, a step reordered), ends with different weights. ``identical`` means ``torch.equal`` on
every parameter. ``cadence-bf16-lean`` is compared with the hand loop under the same autocast.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from torch.utils.data import DataLoader

from workloads import TINY, baseline_of, contenders, initial_network, lightning_version, make_loader, terminal_output


def train(name: str, steps: int) -> dict[str, torch.Tensor]:
    runs = contenders()
    dataset = make_loader(TINY).dataset
    network = initial_network(TINY)  # seeds torch's RNG, then draws the weights
    torch.manual_seed(1)  # the loader's shuffle draws from here
    loader = DataLoader(torch.utils.data.Subset(dataset, range(steps * TINY.batch_size)),
                        batch_size=TINY.batch_size, shuffle=True)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs[name](network, loader, root)
    return {key: value.detach().clone() for key, value in network.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=TINY.steps)
    args = parser.parse_args()
    torch.set_num_threads(TINY.threads)
    names = [name for name in contenders() if name not in ("hand", "hand-again", "hand-bf16", "hand-clipped")]
    with terminal_output() as out:
        references = {"hand": train("hand", args.steps)}
        rows = []
        for name in names:
            if baseline_of(name) not in references:
                references[baseline_of(name)] = train(baseline_of(name), args.steps)
            reference = references[baseline_of(name)]
            weights = train(name, args.steps)
            identical = all(torch.equal(weights[key], reference[key]) for key in reference)
            largest = max((weights[key] - reference[key]).abs().max().item() for key in reference)
            rows.append(f"| {name} | {'yes' if identical else 'NO'} | {largest:.3g} |")
        print(f"## parity: tiny, {args.steps} steps, final weights vs the hand loop\n", file=out)
        print("| contender | bit-identical | largest abs difference |", file=out)
        print("| --- | --- | ---: |", file=out)
        print("\n".join(rows), file=out)
        print(f"\ntorch {torch.__version__}, lightning {lightning_version() or 'not installed'}", file=out)


if __name__ == "__main__":
    main()
