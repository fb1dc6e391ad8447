"""On a CUDA machine: what AMP, torch.compile, gradient checkpointing and the prefetcher buy.

Run from the repository root on a machine with a GPU (about 5 minutes with the defaults;
max-autotune compiles for several minutes more)::

    python benchmarks/cuda_speed.py                                   # every configuration
    python benchmarks/cuda_speed.py --configs fp32 bf16 bf16+compile --steps 40 --json out.json

Every configuration trains the same GPT-style model (pre-norm blocks with scaled-dot-product
attention; 12 blocks of width 1024, sequence 1024, batch 16, vocabulary 32768, fused AdamW) through
``Trainer.fit`` on one GPU, and is compared with plain float32 training of the same model:

    fp32, bf16, fp16                    AMP off / AMP("bf16") / AMP("fp16") (GradScaler)
    bf16+compile, bf16+compile-blocks   Compile() on the whole forward / Compile(modules=Block)
    bf16+autotune, bf16+autotune-blocks the same with mode="max-autotune"
    bf16+checkpointing                  GradientCheckpointing(modules=Block)
    prefetch-off, prefetch-on           the strategy's side-stream prefetcher off and on
                                        (SingleDevice("cuda", prefetch=...)) on a copy-heavy step: an
                                        MLP on 3x64x64 float images, batch 2048 (100 MB a batch, about
                                        2 ms to copy), a step of a few milliseconds, from batches
                                        collated and pinned once, so the rows measure the copy stream,
                                        not the DataLoader; the final weights must be bit-identical

Per configuration: step time (median of timed steps, CUDA-synchronized at the edges of the timed
window only), samples and tokens per second, peak memory (``torch.cuda.max_memory_allocated``), the
first step's time (compilation included), and the sync-debug check: after the warm-up, every
non-log step runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that
makes the host wait for the GPU (``.item()``, a blocking copy, ``nonzero``...). float16 uses a fused
AdamW, whose GradScaler step needs no host read. Without a GPU the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, too

from callbacks import AMP, Callback, Compile, GradientCheckpointing  # noqa: E402
from strategies import SingleDevice  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

CONFIGS = ("fp32", "bf16", "fp16", "bf16+compile", "bf16+compile-blocks", "bf16+autotune", "bf16+autotune-blocks",
           "bf16+checkpointing", "prefetch-off", "prefetch-on")


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(TrainingModule):
    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=True)


class PixelMLP(TrainingModule):
    """A step of a few milliseconds on a large input: the batch's copy to the GPU is a visible part of it."""

    def __init__(self, pixels: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(pixels, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                 nn.Linear(4096, 10))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class PinnedBatches(Dataset):
    """``length`` batches cycling through ``pool`` batches collated and pinned once: handing one out
    costs the loader nothing, so the prefetch rows measure the copy, not the DataLoader."""

    def __init__(self, length: int, pool: int, batch_size: int, generator: torch.Generator) -> None:
        self.length = length
        self.batches = [(torch.randn(batch_size, 3, 64, 64, generator=generator).pin_memory(),
                         torch.randint(0, 10, (batch_size,), generator=generator).pin_memory()) for _ in range(pool)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        return self.batches[index % len(self.batches)]


def copy_ms(batch: torch.Tensor) -> float:
    """Milliseconds one pinned batch takes to copy to the GPU (the median of five, timed with events)."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch.to("cuda", non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def weights_digest(module: nn.Module) -> str:
    """A digest of the module's weights, to compare runs bit for bit."""
    digest = hashlib.sha256()
    for parameter in module.parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class Measure(Callback):
    """First-step time, the timed window (synchronized at its edges only) and the sync-debug windows."""

    def __init__(self, warmup: int, log_every: int) -> None:
        self.warmup, self.log_every = warmup, log_every
        self.first_step_s = math.nan
        self.window: list[float] = []
        self.checked_steps = 0
        self._started = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            torch.cuda.synchronize()
            self._started = time.perf_counter()
        if batch_idx == self.warmup:
            torch.cuda.synchronize()
            self.window = [time.perf_counter()]
        if batch_idx >= self.warmup:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            torch.cuda.synchronize()
            self.first_step_s = time.perf_counter() - self._started
        if batch_idx < self.warmup:
            return
        last = batch_idx + 1 == trainer.num_training_batches
        if trainer.global_step % self.log_every == 0 or last:
            torch.cuda.set_sync_debug_mode("default")  # the log step reads values: allowed
        else:
            self.checked_steps += 1
        if last:
            torch.cuda.synchronize()
            self.window.append(time.perf_counter())

    def on_exception(self, trainer, module, error):
        torch.cuda.set_sync_debug_mode("default")


def strategy_with_prefetch(prefetch: bool | None) -> tuple[SingleDevice, str]:
    """SingleDevice("cuda", prefetch=...) when this Cadence has the option; else the default."""
    if prefetch is None:
        return SingleDevice("cuda"), "default"
    if "prefetch" not in inspect.signature(SingleDevice).parameters:
        return SingleDevice("cuda"), "option absent in this Cadence"
    return SingleDevice("cuda", prefetch=prefetch), "on" if prefetch else "off"


def callbacks_for(config: str) -> list[Callback]:
    extra: list[Callback] = []
    if "bf16" in config:
        extra.append(AMP("bf16"))
    if config == "fp16":
        extra.append(AMP("fp16"))
    if "checkpointing" in config:
        extra.insert(0, GradientCheckpointing(modules=Block))
    if "compile" in config or "autotune" in config:
        mode = "max-autotune" if "autotune" in config else None
        extra.insert(0, Compile(mode=mode, modules=Block if config.endswith("-blocks") else None))
    return extra


def run(config: str, args: argparse.Namespace) -> dict:
    import torch._dynamo

    torch._dynamo.reset()  # each configuration compiles from scratch
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    generator = torch.Generator().manual_seed(0)
    batches = args.steps
    extra: dict = {}
    if config.startswith("prefetch"):
        batch_size, tokens_per_sample = 2048, 0
        data = PinnedBatches(batches, 8, batch_size, generator)
        module: TrainingModule = PixelMLP(3 * 64 * 64)
        strategy, prefetch = strategy_with_prefetch(config == "prefetch-on")
        loader = DataLoader(data, batch_size=None, pin_memory=True)  # pinned already: nothing to do a batch
        extra["copy_ms"] = copy_ms(data.batches[0][0])
    else:
        batch_size, tokens_per_sample = args.batch, args.seq
        tokens = torch.randint(0, args.vocab, (batches * batch_size, args.seq + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        module = GPT(args.vocab, args.width, args.depth, args.heads)
        strategy, prefetch = strategy_with_prefetch(None)
        loader = DataLoader(data, batch_size=batch_size, shuffle=True, pin_memory=True, num_workers=2)
    measure = Measure(args.warmup, args.log_every)
    result = {"config": config, "prefetch": prefetch, "sync_check": "passed", "error": None, **extra}
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(max_epochs=1, strategy=strategy, default_root_dir=root, log_every_n_steps=args.log_every,
                          callbacks=[measure, *callbacks_for(config)], logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, num_sanity_val_steps=0)
        try:
            trainer.fit(module, loader)
        except RuntimeError as error:  # the sync debug mode's error names the call that synced
            result["sync_check"], result["error"] = "FAILED", f"{type(error).__name__}: {error}"[:500]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if config.startswith("prefetch"):
        result["weights"] = weights_digest(module)
    timed_steps = batches - args.warmup
    step_s = (measure.window[1] - measure.window[0]) / timed_steps if len(measure.window) == 2 else math.nan
    result.update({
        "step_ms": step_s * 1e3, "samples_per_s": batch_size / step_s, "tokens_per_s": batch_size * tokens_per_sample / step_s,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "first_step_s": measure.first_step_s,
        "checked_steps": measure.checked_steps,
    })
    return result


def report(results: list[dict], args: argparse.Namespace) -> str:
    baselines = {"gpt": next((r for r in results if r["config"] == "fp32"), None),
                 "pixels": next((r for r in results if r["config"] == "prefetch-off"), None)}
    lines = [
        f"## cuda_speed: {datetime.date.today()}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}",
        "",
        f"GPT: {args.depth} blocks, width {args.width}, {args.heads} heads, sequence {args.seq}, batch {args.batch}, "
        f"vocabulary {args.vocab}; {args.steps} steps, {args.steps - args.warmup} timed. Pixels: MLP on 3x64x64, "
        "batch 2048 from pinned batches.",
        "",
        "| configuration | step ms | vs baseline | samples/s | tokens/s | peak GiB | first step s | sync check (steps) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        base = baselines["pixels" if r["config"].startswith("prefetch") else "gpt"]
        speedup = f"{base['step_ms'] / r['step_ms']:.2f}x" if base and r["step_ms"] == r["step_ms"] else "-"
        label = r["config"] + (f" (prefetch {r['prefetch']})" if r["config"].startswith("prefetch") else "")
        lines.append(f"| {label} | {r['step_ms']:.1f} | {speedup} | {r['samples_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_memory_gib']:.2f} | {r['first_step_s']:.1f} | {r['sync_check']} ({r['checked_steps']}) |")
    prefetch = {r["config"]: r for r in results if r["config"].startswith("prefetch") and r["step_ms"] == r["step_ms"]}
    if len(prefetch) == 2:
        off, on = prefetch["prefetch-off"], prefetch["prefetch-on"]
        hidden = (off["step_ms"] - on["step_ms"]) / off["copy_ms"] if off["copy_ms"] > 0 else math.nan
        lines.append(f"\nPrefetch: a batch copies in {off['copy_ms']:.2f} ms; the side stream hid {hidden:.0%} of it "
                     f"({off['step_ms']:.2f} -> {on['step_ms']:.2f} ms a step); final weights "
                     f"{'bit-identical' if off['weights'] == on['weights'] else 'DIFFERENT'} ({off['weights']}, {on['weights']}).")
    for r in results:
        if r["error"]:
            lines.append(f"\n{r['config']}: {r['error']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"SKIPPED: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              "benchmarks/cuda_speed.py measures GPU training and needs one.")
        return 2
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    torch.backends.cuda.matmul.allow_tf32 = True  # the float32 baseline as people run it on this GPU
    torch.backends.cudnn.allow_tf32 = True
    results = []
    for config in args.configs:
        print(f"running {config} ...", file=sys.stderr, flush=True)
        results.append(run(config, args))
    print(report(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if all(r["sync_check"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
