"""The ``cadence`` command line (also ``python -m trainer``).

Each subcommand is one small ``add_*_command`` function that adds its parser and sets ``run`` to
the function that carries it out; ``build_parser`` lists them::

    cadence fit --config examples/digits.yaml
    cadence fit --config examples/digits.yaml --trainer.max_epochs=5 --model.init_args.lr=1.0e-3
    cadence test --config examples/digits.yaml --ckpt_path best
    cadence fit --config examples/charlm.yaml --print_config
    cadence diagnose comm --devices 2
    cadence convert-checkpoint lightning_logs/version_0/checkpoints/last.ckpt model.ckpt
    cadence env --json

``fit``, ``validate``, ``test`` and ``predict`` read one or more YAML files (trainer/cli/config.py),
merged in order, then the ``--section.key=value`` overrides; each saves the run's resolved
configuration as ``config.yaml`` in its log directory (trainer/cli/runs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

STAGE_HELP = {
    "fit": "train a model described by YAML files",
    "validate": "run validation_step over the validation data",
    "test": "run test_step over the test data",
    "predict": "run predict_step over the predict data; saves the outputs as predictions.pt",
}


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
    for stage in STAGE_HELP:
        add_stage_command(commands, stage)
    add_diagnose_command(commands)
    add_convert_checkpoint_command(commands)
    add_env_command(commands)
    return parser


# --- cadence fit | validate | test | predict ------------------------------------------------------
def add_stage_command(commands: Any, stage: str) -> None:
    command = commands.add_parser(
        stage, help=STAGE_HELP[stage], allow_abbrev=False,
        description=f"{STAGE_HELP[stage][0].upper()}{STAGE_HELP[stage][1:]}. The files hold seed_everything, "
                    "trainer, model, data, optimizer, lr_scheduler and ckpt_path (see trainer/cli/config.py); any "
                    "key can be overridden after them: --trainer.max_epochs=5 --model.init_args.lr=1.0e-3 "
                    "--trainer.callbacks[0].init_args.patience=3, or appended to a list: --trainer.callbacks+=...",
    )
    command.add_argument("--config", action="append", default=[], metavar="FILE",
                         help="a YAML file; give several to merge them in order (later keys win, lists are replaced)")
    command.add_argument("--print_config", action="store_true",
                         help="print the resolved configuration as YAML and exit without building anything")
    command.add_argument("--ckpt_path", default=None,
                         help='resume from a checkpoint: a path or "last" (of the newest run of this model)' if stage == "fit"
                         else 'the checkpoint to load: a path, "last" or "best" (of the newest run of this model)')
    command.set_defaults(run=run_stage_command, stage=stage, takes_overrides=True)


def run_stage_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `cadence --help` and `cadence diagnose` stay fast.
    from trainer.cli.config import BuildError, load_run, stage_arguments, to_yaml
    from trainer.cli.config_files import ConfigError
    from callbacks import AsyncLogger
    from trainer.cli.runs import SaveConfig, checkpoint_for, note
    from trainer.log_dir import versioned_run_dir

    stage = args.stage
    if not args.config and not args.overrides:
        raise SystemExit(f"cadence {stage}: no configuration given. Pass a YAML file: cadence {stage} --config run.yaml "
                         "(examples/digits.yaml is one), or --print_config with it to see every key.")
    overrides = parse_overrides(args.overrides, stage)
    if args.ckpt_path is not None:
        overrides.append(("ckpt_path", args.ckpt_path))
    try:
        run = load_run(args.config, overrides)
        if args.print_config:
            print(to_yaml(run.resolved()), end="")
            return 0
        run = run.with_seed()
        save_config = SaveConfig({}, stage, run.seed_drawn)
        model, data, trainer = run.build(extra_callbacks=[save_config])
        ckpt_path = checkpoint_for(run.ckpt_path, stage, trainer, run.model.class_path)
        if not any(isinstance(logger, AsyncLogger) for logger in trainer.loggers):  # one directory per run, still
            resumed = Path(ckpt_path) if ckpt_path is not None and stage == "fit" else None
            trainer.log_dir = versioned_run_dir(trainer.default_root_dir, resumed)  # not default_root_dir itself
        save_config.config = run.resolved() | {"ckpt_path": ckpt_path}
        loaders = stage_arguments(stage, model, data, run.data)
    except (ConfigError, BuildError, FileNotFoundError) as error:  # the message, not a traceback
        raise SystemExit(f"cadence {stage}: {error}") from None
    if ckpt_path is None and stage != "fit":
        note(stage, f"no ckpt_path: the model has the weights {run.model.class_path.rsplit('.', 1)[-1]}() gives it. "
                    "Pass --ckpt_path best, last or a file for trained ones.")
    quiet = {"verbose": False} if stage in ("validate", "test") else {}  # report() prints the metrics, one per line
    output = getattr(trainer, stage)(model, **loaders, ckpt_path=ckpt_path, **quiet)  # an error keeps its traceback
    if trainer.is_global_zero:
        report(stage, trainer, output)
    return 0


def report(stage: str, trainer: Any, output: Any) -> None:
    """What a stage leaves behind: where its files are, its metrics, and the predictions file."""
    print(f"Logs: {trainer.log_dir}", file=sys.stderr)
    if stage == "fit":
        for callback in trainer.callbacks:
            best = getattr(callback, "best_model_path", "")
            if best:
                print(f"Best checkpoint ({type(callback).__name__}): {best}", file=sys.stderr)
    elif stage == "predict":
        from strategies.checkpoint import save_atomic

        path = save_atomic({"predictions": output}, Path(trainer.log_dir) / "predictions.pt")
        print(f"Predictions ({len(output)} batches; torch.load(path)['predictions']): {path}", file=sys.stderr)
    elif output and any(output):
        for values in output:  # one dict per loader; several loaders' names end in /dataloader_idx_N
            for name, value in sorted(values.items()):
                print(f"{name}\t{value:.6g}")
    else:
        step = "validation_step" if stage == "validate" else "test_step"
        print(f"No metrics: the module's {step} logged none (self.log).", file=sys.stderr)


def parse_overrides(tokens: list[str], command: str = "fit") -> list[tuple[str, str]]:
    """``["--trainer.max_epochs=5", "--model.init_args.lr", "0.01"]`` -> ``[("trainer.max_epochs", "5"), ...]``."""
    overrides, index = [], 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or len(token) == 2:
            raise SystemExit(f"cadence {command}: unexpected argument {token!r}; overrides look like --trainer.max_epochs=5.")
        key, equals, value = token[2:].partition("=")
        if not equals:
            if index + 1 >= len(tokens):
                raise SystemExit(f"cadence {command}: {token} needs a value, e.g. {token}=5.")
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
    from strategies.checkpoint import convert_checkpoint

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
