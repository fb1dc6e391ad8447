"""CSVLogger: ``metrics.csv`` in Lightning's wide layout, written by a background thread.

One row per log step, epoch end or validation (each ``on_log``), columns ``epoch``, ``step``
and one per metric name, all sorted by name as Lightning's are, rows in the order they were logged::

    epoch,step,train/loss,train/loss_epoch,val/loss
    0,50,0.693,,
    0,100,0.412,,
    0,125,,0.455,0.398

Read it with ``pandas.read_csv(path)`` (``.set_index("step")``, ``.groupby("epoch")``...). When a
new metric appears the header grows: the file is rewritten with the new column in its place, into a temporary
file that then replaces it, so a process killed at any moment leaves valid CSV holding every row
the writer had received (rows reach it at most a second after they are logged).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch

from callbacks.async_logger import AsyncLogger
from callbacks.console import MisconfigurationException, warn
from callbacks.logging import do_nothing

FIXED_COLUMNS = ["step"]  # every row has one; the rest (epoch included) as the metrics come
INTEGERS = ("epoch", "step")


class CSVLogger(AsyncLogger):
    """``<save_dir>/<name>/version_<N>/metrics.csv`` (wide) and ``hparams.yaml``.

    Arguments as Lightning's ``CSVLogger(save_dir, name, version, prefix, flush_logs_every_n_steps)``;
    see :class:`~callbacks.async_logger.AsyncLogger`. Rows reach the file at most a second after
    they are logged, and at most ``flush_logs_every_n_steps`` steps after, unless that many steps
    take under 0.1 s (Lightning writes them every that many steps, from the training loop).

    Example::

        Trainer(logger=CSVLogger("logs", name="mnist"))  # logs/mnist/version_0/metrics.csv
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        if isinstance(flush_logs_every_n_steps, bool) or not isinstance(flush_logs_every_n_steps, int) or (
                flush_logs_every_n_steps < 1):
            raise MisconfigurationException(
                f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}): use an int >= 1.")
        super().__init__(save_dir, name, version, prefix)
        self.flush_every_n_steps = flush_logs_every_n_steps

    @property
    def experiment(self) -> ExperimentWriter:
        """Lightning's CSV experiment writer (``metrics``, ``metrics_file_path``, ``log_dir``,
        ``log_metrics``, ``log_hparams``, ``save``). Made by hand (without a Trainer), as Lightning's
        at the logger's first call, it warns when ``log_dir`` exists and is not empty and removes the
        ``metrics.csv`` there (Lightning's), unless this logger wrote that directory itself. A CSV file
        holds no images, so its ``add_*`` methods (``add_image``...) do nothing."""
        if self._experiment is None:
            self._experiment = ExperimentWriter._of(self)
            if (not self._attached and self._save_dir is not None and self._rank_zero
                    and Path(self.log_dir) not in self._written):
                self._experiment._check_log_dir_exists()
        return self._experiment

    _experiment: ExperimentWriter | None = None
    EMPTY_HPARAMS_FILE = False  # Lightning's CSVLogger writes hparams.yaml in log_hyperparams only

    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """As :meth:`AsyncLogger.log_metrics`; by hand (without a Trainer), as Lightning's: ``save()``
        when ``(step + 1) % flush_logs_every_n_steps == 0`` (``step`` None: the rows not yet saved)."""
        if self._attached or not self._rank_zero or self._save_dir is None:
            return super().log_metrics(metrics, step)
        writer = self.experiment
        self._write_alone()  # the writer first: the rows then wait for save() (Lightning's experiment.metrics)
        due = (step if step is not None else len(writer.metrics)) + 1
        super().log_metrics(metrics, step)
        if due % self.flush_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any] | Any = None, *args: Any, **kwargs: Any) -> None:
        if not self._attached and self._rank_zero and self._save_dir is not None:
            self.experiment  # by hand, Lightning's experiment is made (the directory checked) first
        super().log_hyperparams(params, *args, **kwargs)

    def open(self, directory: Path, resume_step: int | None) -> None:
        self.path = directory / "metrics.csv"
        self.columns = list(FIXED_COLUMNS)
        if self.path.exists():
            with open(self.path, newline="") as file:
                header, *rows = list(csv.reader(file)) or [[]]
            if not set(FIXED_COLUMNS) <= set(header):  # not a file of this layout: keep it, start a new one
                os.replace(self.path, self.path.with_name("metrics.previous.csv"))
            elif resume_step is None:  # validate/test after fit: append
                self.columns = header
            else:  # fit: continue up to the checkpoint's step (the resumed run logs what followed again)
                step = header.index("step")
                kept = [row for row in rows if resume_step > 0 and _number(row[step]) < resume_step]  # step n - 1: step n's
                self.columns = header if resume_step > 0 else self.columns  # or, at step 0, start over
                self._replace(kept, self.columns)
        self._file = None  # metrics.csv is made by the first row, as Lightning's: a run that logs nothing leaves none

    def write(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self._file = open(self.path, "a", newline="")
            self._csv = csv.writer(self._file)
            if self._file.tell() == 0:
                self._csv.writerow(self.columns)
        new = [name for name in metrics if name not in self.columns]
        if new:
            previous, self.columns = self.columns, sorted(self.columns + new)
            self._file.close()
            with open(self.path, newline="") as file:
                rows = list(csv.reader(file))[1:]
            self._replace(rows, previous)
            self._file = open(self.path, "a", newline="")
            self._csv = csv.writer(self._file)
        values = {**metrics, "step": step}
        self._csv.writerow([_text(name, values[name]) if name in values else "" for name in self.columns])

    def _replace(self, rows: list[list[str]], columns: list[str]) -> None:
        """Write the header and ``rows`` (whose columns are ``columns``) to a temporary file that
        replaces ``metrics.csv``: the file on disk is the old one or the new one, never half of either."""
        temporary = self.path.with_name(".metrics.csv.tmp")
        with open(temporary, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(self.columns)
            for row in rows:
                by_name = dict(zip(columns, row))
                writer.writerow([by_name.get(name, "") for name in self.columns])
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(_file=None, _csv=None)
        return state


class ExperimentWriter:
    """``CSVLogger.experiment``: Lightning's ``ExperimentWriter`` surface over the logger's writer thread.

    ``metrics`` are the rows logged and not yet handed to the writer thread (``save()`` hands them
    over and returns once they are in the file; the thread also takes them within a second)."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str | os.PathLike) -> None:
        """Lightning's ``ExperimentWriter(log_dir)`` on its own: a ``CSVLogger`` that writes into ``log_dir``
        (a directory that exists and is not empty warns, and its ``metrics.csv`` goes, as Lightning's)."""
        directory = Path(log_dir)
        self.logger = CSVLogger(directory.parent, name="", version=directory.name)
        self.logger._experiment = self
        self._check_log_dir_exists()
        directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def _of(cls, logger: CSVLogger) -> ExperimentWriter:
        writer = cls.__new__(cls)
        writer.logger = logger
        return writer

    @property
    def log_dir(self) -> str:
        return self.logger.log_dir

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, self.NAME_METRICS_FILE)

    @property
    def metrics(self) -> list[dict[str, float]]:
        """The rows not yet handed over, each with its ``"step"`` (a copy: read-only)."""
        write = self.logger.write
        return [{**args[0], "step": args[1]} for function, args in self.logger._pending if function == write]

    @property
    def hparams(self) -> dict[str, Any]:
        return self.logger.hparams

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        self.logger.log_metrics(metrics_dict, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.logger.log_hyperparams(params)

    def save(self) -> None:
        self.logger.save()

    def _check_log_dir_exists(self) -> None:
        directory = Path(self.log_dir)
        if directory.is_dir() and any(directory.iterdir()):
            warn(f"Experiment logs directory {self.log_dir} exists and is not empty. "
                 "Previous log files in this directory will be deleted when the new ones are saved!")
            Path(self.metrics_file_path).unlink(missing_ok=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("add_"):
            return do_nothing
        raise AttributeError(f"CSVLogger.experiment has no {name!r}: it writes metrics (log_metrics) and "
                             "hyperparameters (log_hparams); images and histograms go to a TensorBoardLogger.")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")


def _text(name: str, value: Any) -> str:
    return str(value) if name in INTEGERS else repr(float(value))  # epoch and step as the ints they are
