"""Stop signals: Ctrl-C, SIGTERM, SIGUSR1 finish the step, save last.ckpt, flush the logs and end the process.

``fit`` then raises ``SystemExit(128 + signal)``; running the same command again resumes. The
subprocess tests signal the whole process group, as a terminal's Ctrl-C and a scheduler do, so the
DataLoader workers get the signal too and must survive it until the step is done, also while they
are still starting.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import run_resumable
from callbacks import Callback, CSVLogger, ModelCheckpoint
from linear_regression import LinearRegression
from strategies import DDP
from trainer.preemption import workers_ignore_preemption


class Regressor(LinearRegression):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        return loss


def logged_steps(path: Path, metric: str) -> list[str]:
    """The steps of ``metrics.csv`` rows that hold a value of ``metric``."""
    with open(path, newline="") as file:
        return [row["step"] for row in csv.DictReader(file) if row.get(metric)]


class SignalAt(Callback):
    """Send ``number`` to this process (``times`` times) after training batch ``batch_idx`` of the first epoch."""

    def __init__(self, number: int, batch_idx: int, times: int = 1) -> None:
        self.number, self.batch_idx, self.times = number, batch_idx, times

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            for _ in range(self.times):
                os.kill(os.getpid(), self.number)


def test_ctrl_c_to_the_whole_job_saves_exits_130_and_the_same_command_resumes_bit_identically(tmp_path, capsys,
                                                                                             resumable_reference):
    reference = resumable_reference
    root = tmp_path / "interrupted"
    command = [sys.executable, run_resumable.__file__, str(root), "--ready-at-step", "3"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if child.stdout.readline() != "ready\n":
        child.kill()
        pytest.fail(f"the child failed before training: {child.communicate()[1]}")
    os.killpg(child.pid, signal.SIGINT)  # Ctrl-C: the main process and its two DataLoader workers
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGINT, stderr
    assert stderr.count("press Ctrl-C again to stop now without saving") == 1 and "Traceback" not in stderr
    assert "Ctrl-C (SIGINT) received; stopped after global step" in stderr
    assert f"run the same command (python {run_resumable.__file__} {root} --ready-at-step 3)" in stderr
    version = root / "lightning_logs" / "version_0"
    saved = torch.load(version / "checkpoints" / "last.ckpt", weights_only=True)["loops"]
    assert saved["global_step"] >= 3 and saved["batches_done"] % 2 == 0  # a whole accumulation window
    assert str(saved["global_step"] - 1) in logged_steps(version / "metrics.csv", "train/loss")  # flushed (Lightning's step)
    capsys.readouterr()
    resumed = run_resumable.train(root)  # the same command again
    assert all(torch.equal(resumed.state_dict()[key], value) for key, value in reference.items())
    assert [path.name for path in (root / "lightning_logs").iterdir()] == ["version_0"]
    assert (f"Cadence: resuming from {version / 'checkpoints' / 'last.ckpt'} at epoch {saved['epoch']}, global step "
            f"{saved['global_step']}, after batch {saved['batches_done'] - 1} of the epoch.") in capsys.readouterr().err


def test_a_second_ctrl_c_stops_at_once_without_saving_and_without_a_traceback(make_trainer, regression_loader, capfd):
    seen = []

    class SeesTheError(Callback):
        def on_exception(self, trainer, module, error):
            seen.append(type(error))

    handler_before = signal.getsignal(signal.SIGINT)
    trainer = make_trainer(max_epochs=2, callbacks=[SignalAt(signal.SIGINT, 1, times=2), SeesTheError()])
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Regressor(), regression_loader)
    assert exited.value.code == 128 + signal.SIGINT and exited.value.__suppress_context__  # no chained traceback
    assert trainer.interrupted and seen == [KeyboardInterrupt]  # as in Lightning: on_exception, then interrupted
    assert trainer.global_step == 2  # the second Ctrl-C came before the end of the step that was to save
    assert not (Path(trainer.log_dir) / "checkpoints").exists()
    err = capfd.readouterr().err  # the first line is written to file descriptor 2 by the signal handler
    assert "press Ctrl-C again to stop now without saving" in err
    assert "fit stopped at once by Ctrl-C (KeyboardInterrupt); nothing was saved" in err
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_a_ctrl_c_that_comes_after_the_launchers_sigterm_is_still_reported_and_exits_as_a_ctrl_c(
        make_trainer, regression_loader, capfd):
    # Ctrl-C reaches a spawned rank twice: from the terminal and, as SIGTERM, from the launcher; either may come first.
    class LauncherFirst(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)

    trainer = make_trainer(max_epochs=2, callbacks=[LauncherFirst()])
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Regressor(), regression_loader)
    assert exited.value.code == 128 + signal.SIGINT
    err = capfd.readouterr().err
    assert "Ctrl-C (SIGINT) received; stopped after global step" in err and "SIGTERM received" not in err
    assert (Path(trainer.log_dir) / "checkpoints" / "last.ckpt").exists()


def test_a_keyboard_interrupt_raised_in_a_hook_ends_the_stage_with_status_130_as_lightning_ends_it(make_trainer,
                                                                                                   regression_loader):
    class Interrupts(Callback):
        times = 1

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if self.times:
                self.times -= 1
                raise KeyboardInterrupt

    trainer = make_trainer(max_epochs=1, callbacks=[Interrupts()])
    assert not trainer.interrupted
    with pytest.raises(SystemExit, match="130"):
        trainer.fit(Regressor(), regression_loader)
    assert trainer.interrupted
    trainer.fit(Regressor(), regression_loader)
    assert not trainer.interrupted  # the next stage ended normally


def test_a_sigterm_while_the_dataloader_workers_start_kills_none_of_them_and_the_step_is_saved(tmp_path):
    # Workers started with "spawn" import torch for a second or more before their init function can
    # take SIGTERM over; the signal comes from another process (kill), as a scheduler's does.
    stopper = run_resumable.SignalWhenWorkersStart(signal.SIGTERM, epoch=0, group=False)
    with pytest.raises(SystemExit) as exited:
        run_resumable.train(tmp_path, [stopper], worker_start_method="spawn")
    assert exited.value.code == 128 + signal.SIGTERM
    saved = torch.load(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (saved["loops"]["epoch"], saved["loops"]["batches_done"]) == (0, 2)  # the window the signal came in


def test_ctrl_c_to_a_spawned_ddp_job_while_its_workers_start_saves_and_the_launcher_exits_130_in_one_line(tmp_path):
    # A terminal's Ctrl-C reaches the launcher, both ranks and their DataLoader workers (as they start).
    child = subprocess.run([sys.executable, run_resumable.__file__, str(tmp_path), "--ddp",
                            "--signal-when-workers-start", "SIGINT", "0"], capture_output=True, text=True, timeout=300,
                           start_new_session=True)  # the job's own process group, as a terminal gives it
    assert child.returncode == 128 + signal.SIGINT, child.stderr
    assert "Traceback" not in child.stderr and child.stderr.count("press Ctrl-C again") == 1
    assert child.stderr.count("Ctrl-C (SIGINT) received; stopped after global step") == 1
    saved = torch.load(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["loops"]["global_step"] >= 1 and len(saved["rng"]) == 2  # every rank's state


def test_sigusr1_finishes_the_accumulation_window_then_saves_and_exits(make_trainer, regression_loader, tmp_path, capsys):
    handler_before = signal.getsignal(signal.SIGUSR1)
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=3, log_every_n_steps=100, logger=CSVLogger(),
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt"), SignalAt(signal.SIGUSR1, 3)])
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Regressor(), regression_loader)
    assert exited.value.code == 128 + signal.SIGUSR1
    assert trainer.should_stop and trainer.global_step == 2  # batches 3-5 form the window the signal came in
    loops = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["loops"]
    assert (loops["epoch"], loops["batches_done"], loops["global_step"]) == (0, 6, 2)
    assert "1" in logged_steps(Path(trainer.log_dir) / "metrics.csv", "train/loss")  # step 2's, after the last log step
    assert "SIGUSR1 received; stopped after global step 2 (epoch 0, batch 5)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is handler_before
    assert trainer.interrupted  # as Lightning's Trainer after a SIGTERM


def test_without_a_model_checkpoint_the_state_goes_to_the_log_directory(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, callbacks=[SignalAt(signal.SIGTERM, 1)])
    with pytest.raises(SystemExit):
        trainer.fit(Regressor(), regression_loader)
    assert torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)["loops"]["global_step"] == 2


def test_handlers_are_restored_after_a_failed_fit_and_not_installed_off_the_main_thread(make_trainer, regression_loader):
    class Fails(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # installed while fit runs
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        make_trainer(max_epochs=1, callbacks=[Fails()]).fit(Regressor(), regression_loader)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    seen = []

    class Observes(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=make_trainer(max_epochs=1, callbacks=[Observes()]).fit, args=(Regressor(), regression_loader))
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL] * 8  # Python allows handlers in the main thread only: fit runs without


def test_dataloader_workers_ignore_a_schedulers_sigterm_but_end_on_their_parents():
    data = TensorDataset(torch.arange(64.0))
    loader = DataLoader(data, batch_size=8, num_workers=2, worker_init_fn=workers_ignore_preemption(None))
    iterator = iter(loader)
    next(iterator), next(iterator)  # batches 0 and 1 come from workers 0 and 1: both ran their init function
    for worker, name in zip(iterator._workers, ("TERM", "USR1")):
        subprocess.run(["kill", f"-{name}", str(worker.pid)], check=True)  # sent by another process
    time.sleep(0.3)
    assert [worker.is_alive() for worker in iterator._workers] == [True, True]
    assert len(list(iterator)) == 6  # the epoch completes
    iterator = iter(loader)
    next(iterator)
    iterator._workers[0].terminate()  # the parent's SIGTERM (DataLoader shutdown, exit cleanup)
    iterator._workers[0].join(timeout=5)
    assert not iterator._workers[0].is_alive()
    iterator._shutdown_workers()


class SignalsOnRankOne(Regressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.current_epoch == 0 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().training_step(batch, batch_idx)


def test_under_ddp_a_signal_on_one_rank_stops_every_rank_after_the_same_batch(tmp_path, regression_data):
    trainer = make_ddp_trainer(tmp_path)
    with pytest.raises(SystemExit) as exited:
        trainer.fit(SignalsOnRankOne(), DataLoader(regression_data, batch_size=4))
    assert exited.value.code == 128 + signal.SIGTERM  # the caller's rank zero stopped for another rank's signal
    assert trainer.global_step == 3  # the ranks agreed at the next log step (batch 2 of 8 per rank)
    saved = torch.load(Path(trainer.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["loops"]["global_step"] == 3 and len(saved["rng"]) == 2  # every rank's RNG states


def make_ddp_trainer(root: Path):
    from trainer import Trainer

    return Trainer(strategy=DDP(devices=2), max_epochs=2, log_every_n_steps=3, default_root_dir=root,
                   enable_progress_bar=False, logger=False)
