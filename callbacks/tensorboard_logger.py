"""TensorBoardLogger: event files written by a background thread; ``tensorboard --logdir cadence_logs``.

Scalars go to the event file from the writer thread. ``logger.experiment`` is the
``SummaryWriter`` itself, for what Cadence does not log for you (``add_image``,
``add_histogram``, ``add_figure``) from the training thread on rank zero; on the other ranks it
is an object whose methods do nothing (as in Lightning), so such calls need no rank check.
At the end of ``fit`` the hyperparameters are written with the final metrics (TensorBoard's
HParams tab), and to ``hparams.yaml``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from callbacks.async_logger import AsyncLogger
from callbacks.logging import do_nothing, plain_hparams

#: SummaryWriter arguments a TensorBoardLogger passes on (log_dir and purge_step are its own).
WRITER_ARGUMENTS = ("comment", "max_queue", "flush_secs", "filename_suffix")


class TensorBoardLogger(AsyncLogger):
    """TensorBoard event files in ``<save_dir>/<name>/version_<N>``.

    Arguments as Lightning's ``TensorBoardLogger(save_dir, name, version, prefix, **kwargs)``;
    ``kwargs`` go to ``torch.utils.tensorboard.SummaryWriter`` (``max_queue``, ``flush_secs``, ...).
    A run resumed from a checkpoint of this directory continues it: TensorBoard drops the
    events the killed run wrote after the checkpoint's step (``purge_step``).

    Example::

        logger = TensorBoardLogger("logs", name="gan")
        ...
        self.logger.experiment.add_image("samples", grid, self.global_step)  # in a hook, on rank zero
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "cadence_logs",
                 version: int | str | None = None, prefix: str = "", **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(WRITER_ARGUMENTS))
        if unknown:
            lightning = {"log_graph", "default_hp_metric", "sub_dir"} & set(unknown)
            note = (f" ({', '.join(sorted(lightning))}: Lightning options Cadence does not have; call "
                    "logger.experiment.add_graph(...) yourself for a graph)") if lightning else ""
            raise ValueError(f"TensorBoardLogger got {unknown}{note}. It passes on {list(WRITER_ARGUMENTS)} "
                             "to SummaryWriter.")
        super().__init__(save_dir, name, version, prefix)
        self.writer_arguments = kwargs
        self._writer: Any = None
        self._writer_lock = threading.Lock()

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` of this run (rank zero), or a do-nothing stand-in on other ranks."""
        if not self._rank_zero:
            return _NoExperiment()
        return self._summary_writer(purge_step=None)

    def _summary_writer(self, purge_step: int | None) -> Any:
        with self._writer_lock:  # the training thread (experiment) and the writer thread may both ask
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter  # heavy: loaded on first use

                self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step, **self.writer_arguments)
            return self._writer

    def open(self, directory: Path, resume_step: int | None) -> None:
        # A fit into a directory with events continues after its step: TensorBoard then shows
        # none of the earlier events from that step on (a resumed run logs them again).
        purge = None
        if resume_step is not None and any(directory.glob("events.out.tfevents.*")):
            purge = resume_step + 1 if resume_step > 0 else 0  # a new run (step 0) hides them all
        self._summary_writer(purge_step=purge)

    def write(self, metrics: dict[str, float], step: int) -> None:
        # One event per log step holding every value, as SummaryWriter.add_scalar would write each
        # (a float, no new_style): one record to encode and checksum instead of one per metric.
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self._writer.file_writer.add_summary(Summary(value=values), step)

    def write_final(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """The HParams tab's session: the hyperparameters and the metrics to compare runs by."""
        if not params:
            return
        from torch.utils.tensorboard.summary import hparams

        values = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
                  for key, value in plain_hparams(params).items()}
        for summary in hparams(values, metrics):
            self._writer.file_writer.add_summary(summary)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        with self._writer_lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_writer=None, _writer_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._writer_lock = threading.Lock()


class _NoExperiment:
    """``logger.experiment`` on ranks other than zero: every method call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return do_nothing


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None
