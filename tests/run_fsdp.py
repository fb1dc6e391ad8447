"""FSDP runs that tests/test_fsdp.py starts as two processes, the way torchrun starts a script.

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/run_fsdp.py OUT

Starting a process costs seconds (each imports torch), so one launch runs several fits in turn,
each joining the group as a torchrun script does, and rank zero writes what the tests check to
``OUT/<run>.pt``. Every fit trains the same small model on the same data, so that its weights can
be replayed in one process (``replay`` in tests/test_fsdp.py):

- ``plain``: SGD with momentum and a step LR schedule, shuffled data; then validate and test on
  the sharded model it leaves behind.
- ``accumulate_clip``: accumulation over 2 batches and clipping by total norm, with two
  ModelCheckpoints writing sharded checkpoints (epoch ends; every 3 steps, keeping 1), and the
  bytes each rank holds.
- ``resume``: the same, resumed from ``accumulate_clip``'s checkpoint at step 6 (mid-epoch), then
  validated with that checkpoint's weights (``validate(ckpt_path=...)`` on the sharded model);
  ``resume_file`` from that checkpoint converted to one file, each rank keeping its shard of it.
- ``hsdp``: ``plain`` on a (replicate 2, shard 1) mesh: hybrid sharding's other dimension.
- ``meta``: a model built on the meta device in ``configure_model``.
- ``bf16``: ``FSDP(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``.
- ``killed`` (last): ``accumulate_clip`` again, its checkpoints written in the background
  (``async_save=True``), SIGKILLed on both ranks at the start of step 7, just after the checkpoint
  of step 6 was handed to the background (so usually while it is being written).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from linear_regression import IndexedRegression  # noqa: E402
from strategies import FSDP  # noqa: E402
from strategies.checkpoint import convert_checkpoint  # noqa: E402
from trainer import Trainer, TrainingModule  # noqa: E402

SAMPLES, BATCH_SIZE, EPOCHS, LR, MOMENTUM, CLIP = 64, 4, 2, 0.1, 0.9, 0.05


class Blocks(TrainingModule):
    """Two blocks in a ModuleList (sharded member by member), a head, and a parameter of the root."""

    def __init__(self, on_meta: bool = False) -> None:
        super().__init__()
        self.on_meta = on_meta
        if not on_meta:
            self.build()
        self.seen: list = []  # [batch_idx, sample indices] of each training batch on this rank
        self.dtypes: set = set()

    def build(self) -> None:
        self.blocks = nn.ModuleList([nn.Linear(4, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def reset_parameters(self) -> None:  # the root's own parameter, when built on the meta device
        nn.init.ones_(self.scale)

    def configure_model(self) -> None:
        if self.on_meta and not hasattr(self, "head"):
            with torch.device("meta"):
                self.build()

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        out = self.head(x)
        self.dtypes.add(str(out.dtype))
        return out * self.scale

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.append([batch_idx, index.tolist()])
        loss = F.mse_loss(self(x).float(), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self.evaluate(batch, "test")

    def evaluate(self, batch, prefix: str) -> None:
        index, x, y = batch
        self.log(f"{prefix}/loss", F.mse_loss(self(x).float(), y), sync_dist=True)
        self.log(f"{prefix}/rank", torch.tensor(float(self.trainer.global_rank)), sync_dist=True)

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


def make_optimizer(parameters):
    optimizer = torch.optim.SGD(parameters, lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights from the shards (every rank takes part; plain torch.distributed API)."""
    return {key: value.full_tensor().clone() for key, value in module.state_dict().items()}


class Record(Callback):
    """Keeps, on rank zero, what the tests compare: the starting and final weights, the whole
    state at each checkpoint step, and the bytes each rank holds (parameters, gradients and
    optimizer states, counted over the local shards)."""

    def __init__(self, out: Path, name: str, at_steps: tuple[int, ...] = ()) -> None:
        self.out, self.name, self.at_steps = out, name, at_steps
        self.record: dict = {"at_step": {}, "bytes": {}}

    def on_fit_start(self, trainer, module):
        self.record["initial"] = full_weights(module)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 0:
            self.record["bytes"]["parameters"] = _local_bytes(module.parameters())
            self.record["bytes"]["gradients"] = _local_bytes(p.grad for p in module.parameters())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == 1 and "optimizer" not in self.record["bytes"]:
            states = trainer.optimizers[0].state.values()
            self.record["bytes"]["optimizer"] = _local_bytes(v for s in states for v in s.values() if torch.is_tensor(v))
        if step in self.at_steps and step not in self.record["at_step"]:
            momentum = {name: trainer.optimizers[0].state[p]["momentum_buffer"].full_tensor().clone()
                        for name, p in module.named_parameters()}
            self.record["at_step"][step] = {"weights": full_weights(module), "momentum": momentum}

    def on_fit_end(self, trainer, module):
        gathered = trainer.strategy.all_gather_object([module.seen, self.record["bytes"]])
        self.record.update(final=full_weights(module), seen=[g[0] for g in gathered], bytes=[g[1] for g in gathered],
                           dtypes=sorted(module.dtypes), global_step=trainer.global_step,
                           lr=trainer.optimizers[0].param_groups[0]["lr"],
                           callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
        if trainer.is_global_zero:
            torch.save(self.record, self.out / f"{self.name}.pt")


def _local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in tensors if t is not None)


class KillAt(Callback):
    """SIGKILL this process at the start of optimizer step ``step``'s first batch: nothing runs after.
    Rank zero first notes in ``killed_during_write`` whether a checkpoint was still being written
    (its staging directory there, the checkpoint not yet)."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step - 1 and batch_idx % 2 == 0:
            if trainer.is_global_zero:
                staging = sorted(path.name for path in self.out.rglob(".*.tmp"))
                (self.out / "killed_during_write").write_text("\n".join(staging))
            os.kill(os.getpid(), signal.SIGKILL)


def checkpoints(out: Path, async_save: bool = False) -> list[Callback]:
    return [ModelCheckpoint(dirpath=out / "epochs", save_top_k=-1, monitor=None, async_save=async_save),
            ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=3, every_n_epochs=None, save_top_k=1, monitor=None,
                            mode="max", async_save=async_save)]  # another state key than the first (no monitor: the mode is unused)


def fit(out: Path, name: str, strategy: FSDP, callbacks=(), ckpt_path=None, model=None, **options) -> Trainer:
    model = model or Blocks()
    trainer = Trainer(strategy=strategy, max_epochs=EPOCHS, seed=7, default_root_dir=out, enable_progress_bar=False,
                      logger=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), log_every_n_steps=2,
                      callbacks=[Record(out, name, at_steps=(4, 6)), *callbacks], **options)
    trainer.fit(model, DataLoader(IndexedRegression(), batch_size=BATCH_SIZE, shuffle=True),
                DataLoader(IndexedRegression(), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def main(out: Path) -> None:
    torch.manual_seed(0)  # every rank builds the same model, as a torchrun script does
    model = Blocks()
    weights_only = ModelCheckpoint(dirpath=out / "weights_only", save_weights_only=True, save_last=False)
    trainer = fit(out, "plain", FSDP(), [weights_only], model=model)
    evaluated = {"validate": trainer.validate(model, DataLoader(IndexedRegression(), batch_size=8)),
                 "test": trainer.test(model, DataLoader(IndexedRegression(), batch_size=8))}

    clip = {"accumulate_grad_batches": 2, "gradient_clip_val": CLIP}
    fit(out, "accumulate_clip", FSDP(), checkpoints(out), **clip)
    resumed = Blocks()
    trainer = fit(out, "resume", FSDP(), ckpt_path=out / "steps" / "epoch=1-step=6.ckpt", model=resumed, **clip)
    evaluated["validate_step6"] = trainer.validate(resumed, DataLoader(IndexedRegression(), batch_size=8),
                                                   ckpt_path=out / "steps" / "epoch=1-step=6.ckpt")
    if trainer.is_global_zero:
        torch.save(evaluated, out / "evaluated.pt")
    if torch.distributed.get_rank() == 0:  # the group stays up between stages under torchrun
        convert_checkpoint(out / "steps" / "epoch=1-step=6.ckpt", out / "step6.ckpt")
    torch.distributed.barrier()
    fit(out, "resume_file", FSDP(), ckpt_path=out / "step6.ckpt", **clip)
    fit(out, "hsdp", FSDP(device_mesh=(2, 1)))

    torch.manual_seed(0)
    fit(out, "meta", FSDP(), model=Blocks(on_meta=True))

    from torch.distributed.fsdp import MixedPrecisionPolicy

    fit(out, "bf16", FSDP(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))

    (out / "killed").mkdir(exist_ok=True)
    fit(out / "killed", "killed", FSDP(), [*checkpoints(out / "killed", async_save=True), KillAt(7, out / "killed")], **clip)
    raise AssertionError("the killed run was not killed")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
