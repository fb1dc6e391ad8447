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
from typing import Any

from callbacks.async_logger import AsyncLogger
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
            raise ValueError(f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps!r}): use an int >= 1.")
        super().__init__(save_dir, name, version, prefix)
        self.flush_every_n_steps = flush_logs_every_n_steps

    @property
    def experiment(self) -> _CSVExperiment:
        """Lightning's CSV experiment writer (``log_metrics``, ``log_hparams``, ``save``). A CSV file
        holds no images, so its ``add_*`` methods (``add_image``, ``add_histogram``...) do nothing:
        Lightning code that calls them on every logger's experiment runs unchanged."""
        if self._experiment is None:
            self._experiment = _CSVExperiment(self)
        return self._experiment

    _experiment: _CSVExperiment | None = None

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


class _CSVExperiment:
    def __init__(self, logger: CSVLogger) -> None:
        self.logger = logger

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        self.logger.log_metrics(metrics_dict, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.logger.log_hyperparams(params)

    def save(self) -> None:
        self.logger.save()

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
