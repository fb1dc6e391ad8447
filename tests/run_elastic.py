"""The training script of the launcher-restart test, run by torchrun; the same file on every attempt.

    torchrun --nproc-per-node=2 --max-restarts=1 tests/run_elastic.py ROOT [--kill-rank R --kill-at-step K]

It trains ``run_resumable``'s run under DDP and never passes ``ckpt_path``: when torchrun restarts
the group after a failure, ``fit`` resumes from the newest ``last.ckpt`` by itself. On the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0), rank R SIGKILLs itself right after optimizer
step K. Rank zero writes the final weights to ``ROOT/final.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import run_resumable  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--kill-at-step", type=int)
    args = parser.parse_args()
    callbacks = []
    if args.kill_at_step is not None and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" \
            and int(os.environ["RANK"]) == args.kill_rank:
        callbacks.append(run_resumable.KillAtStep(args.kill_at_step))
    model = run_resumable.train(args.root, callbacks, ddp=True, ckpt_path=None)
    if os.environ["RANK"] == "0":
        torch.save(model.state_dict(), Path(args.root) / "final.pt")


if __name__ == "__main__":
    main()
