"""One GPU check: what only a GPU can prove about Cadence, in at most 8 minutes on one GPU.

Run from the repository root on a machine with an NVIDIA GPU::

    python benchmarks/gpu_check.py OUT_DIR                        # every part
    python benchmarks/gpu_check.py OUT_DIR --parts amp prefetch   # some of them

It writes ``OUT_DIR/gpu_check.json`` (every figure) and ``OUT_DIR/gpu_check.txt`` (one line per
part, then its details; also printed). Each part runs in a process of its own under its own
timeout (a hung NCCL group or a compiler that never returns costs that part, not the check), and
the parts together stop at ``--budget`` seconds (480): a part that would start after that is
reported as not run. The exit status is 0 when no part failed. On a machine without CUDA every
part reports "skipped: no GPU" (``tests/test_gpu_check.py`` runs it so, and one part's code on
the CPU).

The parts, cheapest first (issue 19 names the items; ``benchmarks/gpu_probes.py`` holds 2-10):

    gpu_dataset      item 2: a dataset that yields CUDA tensors trains (only CPU tensors are pinned)
    memory           item 10: after fit the module is off the GPU, what stays there; the peak is per fit
    profiler         item 3: the Profiler's verdict counts each batch once, device busy below 100%
    fsdp_offload     item 7: FSDP(cpu_offload=True) with gradient clipping trains
    cuda_graphs      item 6: Compile(mode="reduce-overhead"): the sanity check and validation, then
                     training, then predict keeps every batch's outputs
    report           item 4: the performance report under Compile + AMP, and under FSDP bf16,
                     recommends neither
    sync             item 1: no host sync between log steps, one GPU and DDP (benchmarks/cuda_sync_check.py)
    amp              AMP fp32/bf16/fp16, regional compile and "bf16-true" (TruePrecision) through fit against
                     a hand loop on the same model and batches: step time, peak memory, bit-equality
    prefetch         item 9: the side-stream prefetcher off and on: copy time, how much of it is hidden,
                     bit-identical weights (benchmarks/cuda_speed.py's copy-heavy step)
    fsdp             DDP and FSDP through fit with NCCL on the GPUs present (benchmarks/fsdp_bench.py)
    microbatch       issue 18: memory capped so a whole batch runs out of it; AutoMicrobatch catches the real
                     error, trains as microbatches, the weights equal the uncapped run's (benchmarks/microbatch_gpu.py)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # run from a checkout, too
sys.path.insert(1, str(BENCHMARKS))  # cuda_speed, cuda_sync_check, fsdp_bench, gpu_probes, microbatch_gpu

from callbacks import AMP, Callback, Compile, TruePrecision  # noqa: E402
from strategies import DDP, SingleDevice  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

#: Seconds all parts together may take on one GPU.
BUDGET_S = 480


# --- what the parts share -------------------------------------------------------------------------
def quiet_trainer(root: Path, **settings: Any) -> Trainer:
    """A Trainer that prints no bars, summary or report and writes only under ``root``."""
    for name, value in (("logger", False), ("enable_progress_bar", False), ("enable_checkpointing", False),
                        ("enable_model_summary", False), ("report", False), ("num_sanity_val_steps", 0)):
        settings.setdefault(name, value)
    return Trainer(default_root_dir=root, **settings)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Window(Callback):
    """Times the training steps after ``warmup``, synchronizing the device at the window's edges only."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.seen, self.started, self.step_ms = warmup, 0, 0.0, math.nan

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.seen == self.warmup:
            synchronize(module.device)
            self.started = time.perf_counter()
        self.seen += 1

    def on_train_end(self, trainer, module):
        synchronize(module.device)
        if self.seen > self.warmup:
            self.step_ms = 1000 * (time.perf_counter() - self.started) / (self.seen - self.warmup)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --- amp: AMP and regional compile through fit, against a hand loop ----------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Blocks(TrainingModule):
    """Residual MLP blocks; ``hand_compiled`` is the hand loop's compiled ``Block.forward``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)
        self.hand_compiled: Callable | None = None

    def forward(self, x):
        for block in self.blocks:
            x = self.hand_compiled(block, x) if self.hand_compiled is not None else block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


AMP_CONFIGS = ("fp32", "bf16", "fp16", "bf16+compile-blocks", "bf16-true")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-true": None}


def blocks_loader(width: int, batch: int, steps: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, width, generator=generator)
    return DataLoader(TensorDataset(x, torch.tanh(x)), batch_size=batch)


def fit_blocks(config: str, device: torch.device, root: Path, sizes: dict) -> dict:
    """``config`` through ``Trainer.fit``: its final weights, step time and peak memory."""
    dtype = DTYPES[config.split("+")[0]]
    callbacks: list[Callback] = [Window(sizes["warmup"])]
    if "compile" in config:
        callbacks.append(Compile(modules=Block))
    if dtype is not None:
        callbacks.append(AMP(dtype))
    if config == "bf16-true":  # Trainer(precision="bf16-true"): bfloat16 weights, inputs and optimizer state
        callbacks.append(TruePrecision("bf16"))
    module = Blocks(sizes["width"], sizes["depth"])
    reset_peak(device)
    trainer = quiet_trainer(root, max_epochs=1, strategy=SingleDevice(device), callbacks=callbacks)
    trainer.fit(module, blocks_loader(sizes["width"], sizes["batch"], sizes["steps"]))
    return {"weights": [p.detach().cpu() for p in module.parameters()], "step_ms": callbacks[0].step_ms,
            "peak_mib": peak_mib(device)}


def hand_blocks(config: str, device: torch.device, sizes: dict) -> dict:
    """The same training written by hand: autocast, GradScaler, compiled blocks as Compile makes them,
    or for "bf16-true" the module and each batch in bfloat16."""
    dtype = DTYPES[config.split("+")[0]]
    weights_dtype = torch.bfloat16 if config == "bf16-true" else torch.float32
    module = Blocks(sizes["width"], sizes["depth"]).to(device, weights_dtype)
    if "compile" in config:
        import torch._functorch.config as functorch_config

        functorch_config.force_non_lazy_backward_lowering = True  # as Compile sets it
        module.hand_compiled = torch.compile(Block.forward)
    optimizer = module.configure_optimizers()
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    reset_peak(device)
    started = 0.0
    loader = blocks_loader(sizes["width"], sizes["batch"], sizes["steps"])
    for index, (x, y) in enumerate(loader):
        if index == sizes["warmup"]:
            synchronize(device)
            started = time.perf_counter()
        x, y = x.to(weights_dtype).to(device, non_blocking=True), y.to(weights_dtype).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = F.mse_loss(module(x).float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    step_ms = 1000 * (time.perf_counter() - started) / (sizes["steps"] - sizes["warmup"])
    return {"weights": [p.detach().cpu() for p in module.parameters()], "step_ms": step_ms, "peak_mib": peak_mib(device)}


def amp(out: Path, device: str = "cuda", configs: tuple[str, ...] = AMP_CONFIGS, width: int = 2048, depth: int = 4,
        batch: int = 256, steps: int = 30, warmup: int = 10) -> dict:
    """Each configuration through fit and by hand: bit-equal weights expected, step time, peak memory."""
    sizes = {"width": width, "depth": depth, "batch": batch, "steps": steps, "warmup": warmup}
    target, rows = torch.device(device), []
    for config in configs:
        fitted, by_hand = fit_blocks(config, target, out / config, sizes), hand_blocks(config, target, sizes)
        difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(fitted["weights"], by_hand["weights"]))
        rows.append({"config": config, "bit_equal": difference == 0.0, "max_abs_difference": difference,
                     "fit_step_ms": fitted["step_ms"], "hand_step_ms": by_hand["step_ms"],
                     "fit_peak_mib": fitted["peak_mib"], "hand_peak_mib": by_hand["peak_mib"]})
    # Compiled kernels may legitimately differ between two compilations; the eager ones may not.
    failed = [row["config"] for row in rows if not row["bit_equal"] and "compile" not in row["config"]]
    lines = [f"{row['config']}: fit {row['fit_step_ms']:.2f} ms/step vs hand {row['hand_step_ms']:.2f}, peak "
             f"{_mib(row['fit_peak_mib'])} vs {_mib(row['hand_peak_mib'])}, weights "
             f"{'bit-equal' if row['bit_equal'] else 'differ by up to %.3g' % row['max_abs_difference']}" for row in rows]
    return {"status": "failed" if failed else "passed", "rows": rows, "lines": lines,
            "summary": (f"weights differ from the hand loop: {', '.join(failed)}" if failed else
                        f"{len(rows)} configurations match the hand loop; " + "; ".join(lines))}


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


# --- prefetch: the copy stream --------------------------------------------------------------------
def prefetch(out: Path, steps: int = 40, warmup: int = 10) -> dict:
    """The prefetcher off and on over a copy-heavy step: copy time, share hidden, identical weights."""
    import cuda_speed

    rows = {}
    for on in (False, True):
        data = cuda_speed.PinnedBatches(steps, 8, 2048, torch.Generator().manual_seed(0))
        module, window = cuda_speed.PixelMLP(3 * 64 * 64), Window(warmup)
        trainer = quiet_trainer(out / f"prefetch-{on}", max_epochs=1, strategy=SingleDevice("cuda", prefetch=on),
                                callbacks=[window])
        trainer.fit(module, DataLoader(data, batch_size=None, pin_memory=True))
        rows["on" if on else "off"] = {"step_ms": window.step_ms, "weights": cuda_speed.weights_digest(module)}
    copy = cuda_speed.copy_ms(data.batches[0][0])
    hidden = (rows["off"]["step_ms"] - rows["on"]["step_ms"]) / copy if copy > 0 else math.nan
    same = rows["off"]["weights"] == rows["on"]["weights"]
    summary = (f"a 100 MB batch copies in {copy:.2f} ms; step {rows['off']['step_ms']:.2f} ms off, "
               f"{rows['on']['step_ms']:.2f} ms on: {hidden:.0%} of the copy hidden; weights "
               f"{'bit-identical' if same else 'DIFFERENT'}")
    return {"status": "passed" if same else "failed", "copy_ms": copy, "hidden_share": hidden, "rows": rows,
            "summary": summary}


# --- sync and fsdp: the existing GPU benchmarks, shortened ---------------------------------------------
def sync(out: Path) -> dict:
    """benchmarks/cuda_sync_check.py's two runs: one GPU, and DDP over the GPUs present (up to 2)."""
    import cuda_sync_check

    args = argparse.Namespace(steps=60, epochs=2, log_every=20, width=512, warmup=12, prefetch="on")
    gpus = min(2, torch.cuda.device_count())
    runs = [cuda_sync_check.check("cuda:0", SingleDevice("cuda"), args),
            cuda_sync_check.check(f"DDP on {gpus} GPU(s), NCCL", DDP(devices=gpus), args)]
    failed = [run for run in runs if not run["ok"]]
    return {"status": "failed" if failed else "passed", "runs": runs,
            "summary": "; ".join(f"{run['run']}: {'ok' if run['ok'] else run['error'][:300]} "
                                 f"({run['checked_steps']} steps checked)" for run in runs)}


def fsdp(out: Path, steps: int = 12, warmup: int = 3) -> dict:
    """benchmarks/fsdp_bench.py once each way, NCCL, one process per GPU."""
    import fsdp_bench

    devices = torch.cuda.device_count()
    results = {kind: fsdp_bench.run(kind, devices, "nccl", steps, warmup, str(out)) for kind in ("ddp", "fsdp")}
    held = {kind: sum(result["ranks"][0][key] for key in ("parameters", "gradients", "optimizer")) / 2**20
            for kind, result in results.items()}
    return {"status": "passed", "results": results,
            "summary": "; ".join(f"{kind} {result['steps_per_s']:.1f} steps/s, {held[kind]:.1f} MiB held per rank, peak "
                                 f"{max(r['peak'] for r in result['ranks']) / 2**20:.0f} MiB"
                                 for kind, result in results.items()) + f" ({devices} GPU(s))"}


def microbatch(out: Path) -> dict:
    """benchmarks/microbatch_gpu.py: a real out-of-memory error, split into microbatches."""
    import microbatch_gpu

    return microbatch_gpu.check(out)


# --- running the parts ----------------------------------------------------------------------------
@dataclass
class Part:
    run: Callable[[Path], dict]
    timeout_s: int


def parts() -> dict[str, Part]:
    import gpu_probes

    return {
        "gpu_dataset": Part(gpu_probes.gpu_dataset, 40), "memory": Part(gpu_probes.memory, 45),
        "profiler": Part(gpu_probes.profiler, 45), "fsdp_offload": Part(gpu_probes.fsdp_offload, 75),
        "cuda_graphs": Part(gpu_probes.cuda_graphs, 100), "report": Part(gpu_probes.report, 120),
        "sync": Part(sync, 100), "amp": Part(amp, 150), "prefetch": Part(prefetch, 60), "fsdp": Part(fsdp, 100),
        "microbatch": Part(microbatch, 90),
    }


PART_NAMES = ("gpu_dataset", "memory", "profiler", "fsdp_offload", "cuda_graphs", "report", "sync", "amp", "prefetch",
              "fsdp", "microbatch")


def run_part(name: str, out: Path, result_path: Path) -> int:
    """In the part's own process: run it, write its result (or its error) as JSON."""
    started = time.perf_counter()
    try:
        result = parts()[name].run(out)
    except Exception as error:  # the part failed: what and where, for the summary
        result = {"status": "failed", "summary": f"{type(error).__name__}: {str(error)[:500]}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - started, 1)
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0


def launch_part(name: str, out: Path, timeout_s: float) -> dict:
    """Run one part in a new process group; kill the group (DDP workers included) at the timeout."""
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / f"{name}.result.json"
    log_path = out / f"{name}.log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), str(out.parent), "--run-part", name]
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 cwd=BENCHMARKS.parent)
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return {"status": "failed", "summary": f"timed out after {timeout_s:.0f} s (log: {log_path.name})",
                    "seconds": round(time.perf_counter() - started, 1), "log_tail": _tail(log_path)}
    if result_path.exists():
        return json.loads(result_path.read_text())
    return {"status": "failed", "summary": f"the part's process exited with status {child.returncode} before writing a "
                                           f"result (log: {log_path.name})",
            "seconds": round(time.perf_counter() - started, 1), "log_tail": _tail(log_path)}


def _tail(path: Path, characters: int = 3000) -> str:
    return path.read_text(errors="replace")[-characters:] if path.exists() else ""


def check(out: Path, names: list[str], budget_s: float) -> dict:
    """Every part in ``names``, each in its own process, within ``budget_s`` seconds in all."""
    has_gpu = torch.cuda.is_available()
    deadline = time.perf_counter() + budget_s
    results: dict[str, dict] = {}
    table = parts() if has_gpu else {}
    for name in names:
        if not has_gpu:
            results[name] = {"status": "skipped: no GPU", "summary": f"no CUDA device (torch {torch.__version__}, CUDA "
                                                                     f"build: {torch.version.cuda or 'no'})"}
            continue
        left = deadline - time.perf_counter()
        if left < 15:
            results[name] = {"status": "not run", "summary": f"the {budget_s:.0f} s budget ran out before it started"}
            continue
        print(f"gpu_check: {name} (up to {min(table[name].timeout_s, left):.0f} s) ...", file=sys.stderr, flush=True)
        results[name] = launch_part(name, out / name, min(table[name].timeout_s, left))
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _commit(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if has_gpu else None, "gpus": torch.cuda.device_count() if has_gpu else 0,
        "budget_s": budget_s, "parts": results, "ok": not any(r["status"] == "failed" for r in results.values()),
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=BENCHMARKS.parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def summary_text(report: dict) -> str:
    lines = [f"gpu_check {report['date']}: {report['gpu'] or 'no GPU'} x{report['gpus']}, torch {report['torch']}, "
             f"CUDA {report['cuda']}, Python {report['python']}, commit {report['commit']}: "
             f"{'OK' if report['ok'] else 'FAILED'}", ""]
    for name, result in report["parts"].items():
        seconds = f" ({result['seconds']:.0f} s)" if "seconds" in result else ""
        lines.append(f"{result['status'].upper() if result['status'] in ('passed', 'failed') else result['status']}"
                     f"  {name}{seconds}: {result.get('summary', '')}")
    for name, result in report["parts"].items():
        details = result.get("lines") or []
        if details:
            lines += ["", f"{name}:"] + [f"  {line}" for line in details]
        if result.get("traceback") or result.get("log_tail"):
            lines += ["", f"{name}, the end of its output:", result.get("traceback") or result["log_tail"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory for gpu_check.json, gpu_check.txt and each part's log")
    parser.add_argument("--parts", nargs="+", choices=PART_NAMES, default=list(PART_NAMES))
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts together")
    parser.add_argument("--run-part", choices=PART_NAMES, help=argparse.SUPPRESS)  # inside a part's own process
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the parts run from the repository root
    if args.run_part:
        return run_part(args.run_part, args.out / args.run_part, args.out / args.run_part / f"{args.run_part}.result.json")
    args.out.mkdir(parents=True, exist_ok=True)
    report = check(args.out, args.parts, args.budget)
    text = summary_text(report)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_check.txt").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
