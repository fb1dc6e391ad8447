"""The ``cadence`` command line (also ``python -m trainer``).

Each subcommand is one small ``add_*_command`` function that adds its parser and sets ``run`` to
the function that carries it out::

    cadence fit --config examples/digits.yaml
    cadence fit --config examples/digits.yaml --trainer.max_epochs=5 --model.init_args.lr=1.0e-3
    cadence diagnose comm --devices 2
    cadence convert-checkpoint cadence_logs/version_0/checkpoints/last.ckpt model.ckpt
    cadence env --json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    return args.run(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", description="Cadence: train PyTorch models with one readable loop.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_fit_command(commands)
    add_diagnose_command(commands)
    add_convert_checkpoint_command(commands)
    add_env_command(commands)
    return parser


# --- cadence fit ----------------------------------------------------------------------------------
def add_fit_command(commands: Any) -> None:
    fit = commands.add_parser(
        "fit", help="train a model described by a YAML file",
        description="Train the model, data and Trainer named in a YAML file (see trainer/config.py). "
                    "Any key can be overridden: --trainer.max_epochs=5 --model.init_args.lr=1.0e-3.",
    )
    fit.add_argument("--config", required=True, help="the YAML file: model, data, trainer, ckpt_path")
    fit.set_defaults(run=run_fit, takes_overrides=True)


def run_fit(args: argparse.Namespace) -> int:
    from trainer.config import check_config, load_config  # lazily: `cadence --help` stays fast

    try:
        run = check_config(load_config(args.config, parse_overrides(args.overrides)))
    except (ValueError, FileNotFoundError) as error:  # a bad file: the message, not a traceback
        raise SystemExit(f"cadence fit: {error}") from None
    trainer = run.fit()  # an error while training keeps its traceback
    print(f"Logs: {trainer.log_dir}", file=sys.stderr)
    for callback in trainer.callbacks:
        best = getattr(callback, "best_model_path", "")
        if best:
            print(f"Best checkpoint ({type(callback).__name__}): {best}", file=sys.stderr)
    return 0


def parse_overrides(tokens: list[str]) -> list[tuple[str, str]]:
    """``["--trainer.max_epochs=5", "--model.init_args.lr", "0.01"]`` -> ``[("trainer.max_epochs", "5"), ...]``."""
    overrides, index = [], 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or len(token) == 2:
            raise SystemExit(f"cadence fit: unexpected argument {token!r}; overrides look like --trainer.max_epochs=5.")
        key, equals, value = token[2:].partition("=")
        if not equals:
            if index + 1 >= len(tokens):
                raise SystemExit(f"cadence fit: {token} needs a value, e.g. {token}=5.")
            index += 1
            value = tokens[index]
        overrides.append((key, value))
        index += 1
    return overrides


# --- cadence diagnose comm ------------------------------------------------------------------------
def add_diagnose_command(commands: Any) -> None:
    diagnose = commands.add_parser("diagnose", help="check the machine before a long run")
    checks = diagnose.add_subparsers(dest="check", required=True, metavar="CHECK")
    comm = checks.add_parser(
        "comm", help="all_reduce across processes: verify the numbers, measure latency and bandwidth",
        description="Run all_reduce over a range of sizes across the group, verify the results and print "
                    "latency and bus bandwidth per size. Spawns --devices processes, or joins the group "
                    "under torchrun (torchrun ... -m trainer diagnose comm) to check links between machines.",
    )
    comm.add_argument("--devices", default="auto", help='processes to spawn on this machine (default "auto": every GPU, else 1)')
    comm.add_argument("--backend", default=None, choices=("nccl", "gloo"), help="default: nccl with CUDA, else gloo")
    comm.add_argument("--sizes", default=None, help="comma-separated sizes, e.g. 4K,1M,64M (default 4K to 64M)")
    comm.add_argument("--iterations", type=int, default=None, help="timed all_reduces per size")
    comm.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait for a missing rank")
    comm.set_defaults(run=run_diagnose_comm)


def run_diagnose_comm(args: argparse.Namespace) -> int:
    import os

    from strategies.diagnose import DEFAULT_SIZES, check_communication, parse_size

    if args.devices != "auto" and not args.devices.isdigit():
        raise SystemExit(f'cadence diagnose comm: --devices {args.devices}: use a number of processes or "auto".')
    devices = args.devices if args.devices == "auto" else int(args.devices)
    try:
        sizes = tuple(parse_size(part) for part in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    except ValueError as error:
        raise SystemExit(f"cadence diagnose comm: {error}") from None
    report = check_communication(devices=devices, sizes=sizes, backend=args.backend,
                                 iterations=args.iterations, timeout=args.timeout)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank has a report; one prints it
        print(report)
    return 0 if report.ok else 1


# --- cadence convert-checkpoint -------------------------------------------------------------------
def add_convert_checkpoint_command(commands: Any) -> None:
    convert = commands.add_parser(
        "convert-checkpoint", help="write a sharded (FSDP) checkpoint directory as one file",
        description="Gather a sharded checkpoint directory (written under FSDP by any number of processes) into "
                    "one checkpoint file holding the whole weights and training state, in one process. The file "
                    "loads into the plain module on one device and resumes training under any strategy.",
    )
    convert.add_argument("source", help="the checkpoint directory (or file) to read")
    convert.add_argument("target", help="the checkpoint file to write")
    convert.set_defaults(run=run_convert_checkpoint)


def run_convert_checkpoint(args: argparse.Namespace) -> int:
    from trainer.checkpoint import convert_checkpoint

    try:
        written = convert_checkpoint(args.source, args.target)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise SystemExit(f"cadence convert-checkpoint: {error}") from None
    print(f"Wrote {written} ({written.stat().st_size / 2**20:.1f} MiB) from {args.source}.", file=sys.stderr)
    return 0


# --- cadence env ----------------------------------------------------------------------------------
def add_env_command(commands: Any) -> None:
    env = commands.add_parser(
        "env", help="print what a bug report needs: versions, devices, CPU, environment variables",
        description="Print the versions of Python, torch, CUDA, cuDNN, NCCL, the dependencies and Cadence; each "
                    "device's name, memory, compute capability and bf16 support; the CPU and torch threads; and "
                    "the environment variables that change how PyTorch and distributed runs behave.",
    )
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.set_defaults(run=run_env)


def run_env(args: argparse.Namespace) -> int:
    from trainer.environment import environment_report

    report = environment_report()
    print(report.to_json() if args.json else report)
    return 0
