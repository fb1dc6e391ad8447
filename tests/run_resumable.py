"""A small training run that the resume and preemption tests start in a child process and kill.

    python tests/run_resumable.py ROOT [--kill-at-step N | --kill-while-saving-step N | --ready-at-step N] [--fp16]
        [--ddp] [--signal-when-workers-start SIGNAL EPOCH]

Every run calls ``fit(..., ckpt_path="last")``, so running the same command again resumes; the
final weights go to ``ROOT/final.pt``. The run has everything exact resume must survive: a
shuffled loader with two worker processes, dropout, an LR scheduler stepped per optimizer step,
gradient accumulation, and validation right after some checkpoints (3 epochs of 10 batches,
5 optimizer steps each; a checkpoint every 4 steps, so steps 4 and 12 are followed by
validation in the same batch). ``--fp16`` trains under ``AMP("fp16")`` with a loss scale too
large at first (the first steps are skipped while it backs off), so a resumed run takes the same
steps only if the scaler's state came back with the checkpoint. ``--ddp`` trains on 2 spawned
processes; ``--signal-when-workers-start`` sends a signal to the whole job (as a terminal's Ctrl-C
or a scheduler does) while the workers of an epoch start, under the "spawn" start method (each
worker imports torch first: seconds in which it has not yet taken the signal over; one worker then).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from callbacks import AMP, Callback, ModelCheckpoint  # noqa: E402
from strategies import DDP  # noqa: E402
from trainer import Trainer, TrainingModule, seed_everything  # noqa: E402


class Net(TrainingModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def workers(worker_start_method: str | None) -> int:
    """The training loader's worker processes: two, or one under "spawn", where each imports torch
    first (seconds of a busy machine's cores) and one is enough to be caught while it starts."""
    return 1 if worker_start_method == "spawn" else 2


def loaders(worker_start_method: str | None = None) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(56, 4, generator=generator)
    y = x @ torch.randn(4, 2, generator=generator)
    train = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=4, shuffle=True,
                       num_workers=workers(worker_start_method), multiprocessing_context=worker_start_method)
    return train, DataLoader(TensorDataset(x[40:], y[40:]), batch_size=8)


def train(root: str | os.PathLike, callbacks: list[Callback] = (), ddp: bool = False,
          worker_start_method: str | None = None, ckpt_path: str | None = "last") -> Net:
    """Build the model and fit it, resuming from ROOT's last.ckpt when there is one (``ckpt_path``)."""
    seed_everything(0)
    model = Net()
    trainer = Trainer(
        strategy=DDP(devices=2) if ddp else "cpu", max_epochs=3, accumulate_grad_batches=2, val_check_interval=4, log_every_n_steps=3,
        default_root_dir=root, enable_progress_bar=False, seed=7,
        callbacks=[ModelCheckpoint(every_n_train_steps=4, every_n_epochs=None), *callbacks],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*found no last.ckpt.*")  # the first run starts fresh
        trainer.fit(model, *loaders(worker_start_method), ckpt_path=ckpt_path)
    return model


def fp16_amp() -> AMP:
    """float16 AMP whose first steps overflow and are skipped until the scale has backed off."""
    return AMP("fp16", init_scale=2.0**20)


class KillAtStep(Callback):
    """SIGKILL this process right after optimizer step ``step``: no cleanup of any kind runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_while_saving(step: int) -> None:
    """SIGKILL this process halfway through writing the checkpoint of ``step``."""
    save = torch.save

    def dying_save(state, file, *args, **kwargs):
        if isinstance(state, dict) and state.get("loops", {}).get("global_step") == step:
            file.write(b"PK\x03\x04 half a checkpoint")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        save(state, file, *args, **kwargs)

    torch.save = dying_save


class ReadyAtStep(Callback):
    """Print "ready" after optimizer step ``step``, then slow down so a signal finds the run training."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and batch_idx % 2 == 1:
            print("ready", flush=True)
        if trainer.global_step >= self.step:
            time.sleep(0.05)


class SignalWhenWorkersStart(Callback):
    """When epoch ``epoch``'s iterator is made (rank zero), once the training loader's workers are started
    and before they can have imported torch (start method "spawn"), send signal ``number`` from
    another process (``kill``), as a scheduler or a terminal does: to this whole process group
    (``group``), or to this process and the workers."""

    def __init__(self, number: int, epoch: int, group: bool) -> None:
        self.number, self.epoch, self.group = number, epoch, group

    def on_fit_start(self, trainer, module):  # epoch 0's workers start before on_train_start, as in Lightning's loop
        if self.epoch == trainer.current_epoch == 0:
            self._watch(trainer)

    def on_train_epoch_start(self, trainer, module):  # a later epoch's start after it
        if trainer.current_epoch == self.epoch > 0:
            self._watch(trainer)

    def _watch(self, trainer) -> None:
        if trainer.is_global_zero:
            before = {process.pid for process in multiprocessing.active_children()}
            threading.Thread(target=self._send, args=(before,), daemon=True).start()

    def _send(self, before: set[int]) -> None:
        deadline, started = time.monotonic() + 60, []
        while len(started) < workers("spawn") and time.monotonic() < deadline:  # the loader's workers
            started = [process.pid for process in multiprocessing.active_children() if process.pid not in before]
            time.sleep(0.002)
        targets = [f"-{os.getpgrp()}"] if self.group else [str(os.getpid()), *map(str, started)]
        # Its own session: kill is then not one of the processes it signals.
        subprocess.run(["kill", f"-{signal.Signals(self.number).name[3:]}", "--", *targets], start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-while-saving-step", type=int)
    parser.add_argument("--ready-at-step", type=int)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--signal-when-workers-start", nargs=2, metavar=("SIGNAL", "EPOCH"))
    args = parser.parse_args()
    callbacks: list[Callback] = [fp16_amp()] if args.fp16 else []
    if args.kill_at_step is not None:
        callbacks.append(KillAtStep(args.kill_at_step))
    if args.kill_while_saving_step is not None:
        kill_while_saving(args.kill_while_saving_step)
    if args.ready_at_step is not None:
        callbacks.append(ReadyAtStep(args.ready_at_step))
    worker_start_method = None
    if args.signal_when_workers_start is not None:
        name, epoch = args.signal_when_workers_start
        callbacks.append(SignalWhenWorkersStart(getattr(signal, name), int(epoch), group=True))
        worker_start_method = "spawn"
    model = train(args.root, callbacks, ddp=args.ddp, worker_start_method=worker_start_method)
    torch.save(model.state_dict(), Path(args.root) / "final.pt")


if __name__ == "__main__":
    main()
