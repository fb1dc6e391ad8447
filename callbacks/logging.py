"""Loggers: CSV and TensorBoard files written by a background thread.

A logger is a callback that receives host values in ``on_log`` (at log steps, epoch ends and
after validation; never per step) and queues them, handed to its thread at most once a second;
the thread does the file I/O, so a slow disk never stalls training. ``teardown`` and
``on_exception`` drain the queue: no logged line is lost. Only rank zero writes.
"""

from __future__ import annotations

import csv
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class AsyncLogger(Callback):
    """Base of the file loggers: a queue and one writer thread per logger.

    Subclasses implement ``open(directory)``, ``write(metrics, step)`` and ``close()``; all three
    run on the writer thread.

    Log steps reach the thread in batches, at most one hand-over a second: each hand-over wakes
    the thread, which then takes the interpreter lock from the training loop, and on a 2-core VM
    that switch measured 0.75 ms per log step (15 us a step at log_every_n_steps=50;
    benchmarks/RESULTS.md). Values reach the files at most a second later; ``finish`` (teardown,
    on_exception) hands over the rest, so no line is lost.

    Args:
        save_dir: where to write; default: the trainer's log directory.
    """

    #: Seconds between two hand-overs of logged values to the writer thread.
    handover_seconds: float = 1.0

    def __init__(self, save_dir: str | os.PathLike | None = None) -> None:
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.directory: Path | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not trainer.is_global_zero or self._thread is not None:
            return
        self.directory = self.save_dir or trainer.log_dir
        self.hparams = dict(getattr(module, "hparams", {}))
        self._queue = queue.Queue()
        self._batch: list[tuple[dict[str, float], int]] = []
        self._handed_over_at = time.monotonic()
        self._thread = threading.Thread(target=self._drain, name=f"cadence-{type(self).__name__}", daemon=True)
        self._thread.start()

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        if self._queue is not None:
            if self._error is not None:
                raise RuntimeError(f"{type(self).__name__} could not write to {self.directory}: {self._error}") from self._error
            self._batch.append((dict(metrics), step))
            now = time.monotonic()
            if now - self._handed_over_at >= self.handover_seconds:
                self._queue.put(self._batch)
                self._batch, self._handed_over_at = [], now

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self.finish()

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        self.finish()

    def finish(self) -> None:
        """Write everything queued, close the files, stop the thread."""
        if self._thread is None:
            return
        self._queue.put(self._batch)
        self._batch = []
        self._queue.put(None)
        self._thread.join()
        self._thread = self._queue = None

    def _drain(self) -> None:
        try:
            self.open(self.directory)
            while (batch := self._queue.get()) is not None:
                for metrics, step in batch:
                    self.write(metrics, step)
        except BaseException as error:  # reported on the training thread at the next on_log
            self._error = error
            while self._queue.get() is not None:
                pass
        finally:
            try:
                self.close()
            except Exception:
                pass

    def open(self, directory: Path) -> None:
        raise NotImplementedError

    def write(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None: ...


class CSVLogger(AsyncLogger):
    """``metrics.csv`` in long form: one ``step,metric,value`` row per value (append-only).

    Read it with ``pandas.read_csv(path).pivot_table(index="step", columns="metric")``.
    """

    def open(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.csv"
        new = not self.path.exists()
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "metric", "value"])
        if self.hparams:
            write_hparams(directory, self.hparams)

    def write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.writerow([step, name, repr(value)])
        self._file.flush()

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None


class TensorBoardLogger(AsyncLogger):
    """TensorBoard event files; view with ``tensorboard --logdir cadence_logs``."""

    def open(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, on the writer thread

        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if getattr(self, "_writer", None) is not None:
            self._writer.close()
            self._writer = None


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


def default_loggers() -> list[Callback]:
    loggers: list[Callback] = [CSVLogger()]
    if tensorboard_available():
        loggers.append(TensorBoardLogger())
    return loggers


def write_hparams(directory: Path, hparams: dict[str, Any]) -> None:
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    plain = {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v) for k, v in hparams.items()}
    (directory / "hparams.yaml").write_text(yaml.safe_dump(plain, sort_keys=True))
