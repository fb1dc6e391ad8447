"""The file loggers write in a thread that lives only while it writes: between two hand-overs the
training process runs on its one thread (a second live thread costs every step, see
strategies/background.py), TensorBoard's own writer thread never starts, and nothing logged is lost.
"""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, CSVLogger, TensorBoardLogger
from strategies.background import BackgroundJobs
from trainer import Trainer, TrainingModule

BATCHES = 12


def writer_threads() -> list[threading.Thread]:
    """Threads a logger or TensorBoard started (pytest-xdist has threads of its own)."""
    return [thread for thread in threading.enumerate()
            if thread.name.startswith("cadence-") or type(thread).__name__ == "_AsyncWriterThread"]


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Imaged(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        if batch_idx == 5:
            self.logger.experiment.add_image("picture", torch.rand(3, 8, 8), self.global_step)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ThreadsSeen(Callback):
    """After each batch: the writer threads alive once the loggers had time to finish their work."""

    def __init__(self) -> None:
        self.idle: list[bool] = []
        self.tensorboards: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.idle.append(wait_until(lambda: not writer_threads()))
        self.tensorboards.append(sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate()))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    x = torch.randn(BATCHES * 4, 4, generator=torch.Generator().manual_seed(0))
    seen = ThreadsSeen()
    trainer = Trainer(strategy="cpu", max_epochs=1, log_every_n_steps=2, default_root_dir=root, callbacks=[seen],
                      enable_progress_bar=False, enable_checkpointing=False, report=False)
    trainer.fit(Imaged(), DataLoader(TensorDataset(x, x[:, :2]), batch_size=4))
    return trainer, seen


def test_between_hand_overs_no_writer_thread_is_alive_and_tensorboards_never_starts(run):
    trainer, seen = run
    assert [type(logger) for logger in trainer.loggers] == [TensorBoardLogger, CSVLogger]
    assert seen.idle == [True] * BATCHES  # each hand-over's thread ended after writing (at most 10 s later)
    assert seen.tensorboards == [0] * BATCHES
    assert writer_threads() == []  # and after fit


def test_every_value_and_the_image_reach_one_event_file_and_the_csv(run):
    trainer, _ = run
    files = list(Path(trainer.log_dir).glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = EventAccumulator(str(files[0]), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, BATCHES, 2))
    assert [event.step for event in events.Images("picture")] == [5]
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as file:
        assert [int(row["step"]) for row in csv.DictReader(file)] == list(range(1, BATCHES, 2))


def test_experiment_flush_waits_until_its_events_are_in_the_file(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="")
    logger.log_metrics({"loss": 1.0}, step=0)  # by hand: the writer opens its file now
    writer = logger.experiment
    writer.add_text("note", "written", 3)
    writer.flush()
    (path,) = tmp_path.glob("version_0/events.out.tfevents.*")
    events = EventAccumulator(str(path), size_guidance={"tensors": 0})
    events.Reload()
    assert [event.step for event in events.Tensors("note/text_summary")] == [3]
    logger.finalize()
    assert writer_threads() == []


def test_flush_secs_and_max_queue_set_when_tensorboard_values_are_written():
    assert TensorBoardLogger("logs", flush_secs=0.5).handover_seconds == 0.5
    assert TensorBoardLogger("logs", flush_secs=120).handover_seconds == 1.0  # never later than a second
    assert TensorBoardLogger("logs", max_queue=4).flush_every_n_steps == 4
    assert TensorBoardLogger("logs").flush_every_n_steps is None
    with pytest.raises(ValueError, match=r"TensorBoardLogger\(flush_secs=0\): use a number of seconds > 0"):
        TensorBoardLogger("logs", flush_secs=0)
    with pytest.raises(ValueError, match=r"TensorBoardLogger\(max_queue='10'\): use an int >= 1"):
        TensorBoardLogger("logs", max_queue="10")


@pytest.mark.parametrize("max_queue", [2, None])
def test_max_queue_hands_values_over_every_that_many_log_steps(tmp_path, max_queue):
    logger = TensorBoardLogger(tmp_path, name="", **({} if max_queue is None else {"max_queue": max_queue}))
    logger.handover_seconds, logger.min_handover_seconds = 3600, 0  # only the step count hands values over
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))

    class Reads(Callback):
        def __init__(self) -> None:
            self.read: list[int] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            wait_until(lambda: not writer_threads())
            (path,) = Path(logger.log_dir).glob("events.out.tfevents.*")
            events = EventAccumulator(str(path), size_guidance={"scalars": 0})
            events.Reload()
            self.read.append(len(events.Scalars("train/loss")) if "train/loss" in events.Tags()["scalars"] else 0)

    reads = Reads()
    Trainer(strategy="cpu", max_epochs=1, log_every_n_steps=1, logger=logger, callbacks=[reads], enable_progress_bar=False,
            enable_checkpointing=False, report=False).fit(Imaged(), DataLoader(TensorDataset(x, x[:, :2]), batch_size=4))
    # Step n's values are logged at n - 1, after the next batch's on_train_batch_end; once the step logged is
    # max_queue past the last hand-over (step 0 at the start), the values so far go to the file: steps 0-2, then 3-4.
    # Without max_queue they wait for the hour (the end of fit).
    assert reads.read == ([0, 0, 0, 0, 3, 3] if max_queue else [0] * 6)


def test_background_jobs_run_in_order_end_their_thread_and_drop_what_follows_a_failure():
    jobs, done = BackgroundJobs("cadence-test"), []
    for index in range(3):
        jobs.submit(f"job {index}", lambda index=index: done.append(index))
    jobs.wait()
    assert done == [0, 1, 2] and not jobs.busy and writer_threads() == []
    jobs.submit("failing", lambda: 1 / 0)
    jobs.submit("after it", lambda: done.append("after"))
    jobs.wait()
    assert isinstance(jobs.take_error(), ZeroDivisionError) and done == [0, 1, 2]
    jobs.submit("again", lambda: done.append("again"))  # once the error was taken, jobs run again
    jobs.wait()
    assert done == [0, 1, 2, "again"] and jobs.take_error() is None
