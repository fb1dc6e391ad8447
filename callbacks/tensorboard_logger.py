"""TensorBoardLogger: event files written by a background thread; ``tensorboard --logdir lightning_logs``.

Scalars go to the event file from the writer thread. ``logger.experiment`` is the
``SummaryWriter`` itself, for what Cadence does not log for you (``add_image``,
``add_histogram``, ``add_figure``) from the training thread on rank zero; on the other ranks it
is an object whose methods do nothing (as in Lightning), so such calls need no rank check.
At the end of ``fit`` the hyperparameters are written with the final metrics (TensorBoard's
HParams tab), and to ``hparams.yaml``. With ``log_graph=True`` the module's graph, traced on its
``example_input_array``, is written when a stage starts.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.async_logger import AsyncLogger
from callbacks.console import MisconfigurationException, warn
from callbacks.logging import do_nothing, metric_number, plain_hparams
from strategies.transfer import move_to_device

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: SummaryWriter arguments a TensorBoardLogger passes on (log_dir and purge_step are its own).
WRITER_ARGUMENTS = ("comment", "max_queue", "flush_secs", "filename_suffix")


class TensorBoardLogger(AsyncLogger):
    """TensorBoard event files in ``<save_dir>/<name>/version_<N>[/<sub_dir>]``.

    Arguments as Lightning's ``TensorBoardLogger``; ``kwargs`` go to
    ``torch.utils.tensorboard.SummaryWriter`` (``max_queue``, ``flush_secs``, ...). A run resumed
    from a checkpoint of this directory continues it: TensorBoard drops the events the killed run
    wrote after the checkpoint's step (``purge_step``).

    Args:
        log_graph: write the module's graph, traced on ``example_input_array`` (a tensor, or a tuple
            of ``forward``'s positional arguments), when a stage starts.
        default_hp_metric: write the HParams session by itself: at the end of ``fit``, with the final
            value of every metric (a ``hp_metric`` you log among them). False: only when you call
            ``log_hyperparams(params, metrics)``. Lightning writes a placeholder ``hp_metric=-1`` at
            the start instead; Cadence writes the real values at the end.
        sub_dir: a directory under the version directory for this logger's files (checkpoints stay
            in the version directory).

    Example::

        logger = TensorBoardLogger("logs", name="gan", log_graph=True)
        ...
        self.logger.experiment.add_image("samples", grid, self.global_step)  # in a hook, on rank zero
    """

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(WRITER_ARGUMENTS))
        if unknown:
            raise MisconfigurationException(
                f"TensorBoardLogger got {unknown}. It takes Lightning's save_dir, name, version, log_graph, "
                f"default_hp_metric, prefix and sub_dir, and passes on {list(WRITER_ARGUMENTS)} to SummaryWriter.")
        for flag, value in (("log_graph", log_graph), ("default_hp_metric", default_hp_metric)):
            if not isinstance(value, bool):
                raise MisconfigurationException(f"TensorBoardLogger({flag}={value!r}): use True or False.")
        if sub_dir is not None and not isinstance(sub_dir, (str, os.PathLike)):
            raise MisconfigurationException(f"TensorBoardLogger(sub_dir={sub_dir!r}): use a directory name, or None.")
        super().__init__(save_dir, name, version, prefix)
        self._log_graph, self._default_hp_metric = log_graph, default_hp_metric
        self._sub_dir = os.fspath(sub_dir) if sub_dir is not None else None
        self.writer_arguments = kwargs
        self._writer: Any = None
        self._writer_lock = threading.Lock()
        self._session_written = False  # log_hyperparams(params, metrics) wrote the HParams session
        self._graph_logged = False  # FSDP's no-graph warning given

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        """``<save_dir>/<name>/version_<N>``, then ``sub_dir`` if given (``~`` and ``$VARS`` expanded)."""
        log_dir = self.version_dir if self._sub_dir is None else os.path.join(self.version_dir, self._sub_dir)
        return os.path.expanduser(os.path.expandvars(log_dir))

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` of this run (rank zero), or a do-nothing stand-in on other ranks."""
        if not self._rank_zero:
            return _NoExperiment()
        if self._thread is not None:  # the writer thread opens it (continuing a resumed run's events)
            self._opened.wait()
        return self._summary_writer(purge_step=None)

    def _summary_writer(self, purge_step: int | None) -> Any:
        with self._writer_lock:  # the training thread (experiment) and the writer thread may both ask
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter  # heavy: loaded on first use

                self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step, **self.writer_arguments)
            return self._writer

    # --- Lightning's surface -----------------------------------------------------------------
    def log_hyperparams(self, params: Mapping[str, Any] | Any, metrics: Mapping[str, Any] | float | None = None,
                        step: int | None = None) -> None:
        """Keep ``params`` (``hparams.yaml``); with ``metrics`` (a dict, or one number for ``hp_metric``),
        also write the HParams session now, with those metrics logged at ``step``."""
        super().log_hyperparams(params)
        if metrics is None or not self._rank_zero:
            return
        values = dict(metrics) if isinstance(metrics, Mapping) else {"hp_metric": metrics}
        values = {key: metric_number(key, value) for key, value in values.items()}
        self.log_metrics(values, step)
        self._session_written = True
        self._add(self.write_session, dict(self.hparams), self._prefixed(values))

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Write ``model``'s graph, traced on ``input_array`` (default: its ``example_input_array``),
        when ``log_graph=True``. Rank zero only."""
        if not self._log_graph or not self._rank_zero:
            return
        example = getattr(model, "example_input_array", None) if input_array is None else input_array
        if example is None:
            warn("Could not log computational graph to TensorBoard: The `model.example_input_array` attribute "
                 "is not set or `input_array` was not given. Set self.example_input_array in the module's "
                 "__init__ (a tensor shaped like a batch).")
        elif not isinstance(example, (torch.Tensor, tuple)):
            warn(f"Could not log computational graph to TensorBoard: The `input_array` or "
                 f"`model.example_input_array` has type {type(example)} which can't be traced by TensorBoard. "
                 "Make the input array a tuple representing the positional arguments to the model's "
                 "`forward()` implementation.")
        else:
            device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
            self.experiment.add_graph(model, move_to_device(example, device, non_blocking=False))

    # --- the callback side -------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        super().on_fit_start(trainer, module)
        self._graph_at_stage_start(trainer, module)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.stage == "validate":
            self._graph_at_stage_start(trainer, module)

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._graph_at_stage_start(trainer, module)

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._graph_at_stage_start(trainer, module)

    def _graph_at_stage_start(self, trainer: Trainer, module: TrainingModule) -> None:
        # At the start of every fit, validate, test and predict, as Lightning: tracing runs the forward,
        # so a forward that draws random numbers leaves the streams where Lightning's run leaves them.
        if not self._log_graph or not self._rank_zero:
            return
        if not trainer.strategy.whole_state_on_rank_zero:
            if self._graph_logged:
                return
            self._graph_logged = True  # the warning once
            warn("TensorBoardLogger(log_graph=True): the module is sharded over the processes (FSDP), so rank "
                 "zero alone cannot trace it; no graph is written. Log it from a run on one device.")
            return
        self.log_graph(module)

    # --- the writer thread -------------------------------------------------------------------
    def open(self, directory: Path, resume_step: int | None) -> None:
        # A fit into a directory with events continues after its step: TensorBoard then shows
        # none of the earlier events from that step on (a resumed run logs them again).
        purge = None
        earlier = list(directory.glob("events.out.tfevents.*"))
        if resume_step is not None and earlier:
            purge = resume_step  # what was logged from it on came after the checkpoint (step n's values are at n - 1)
            # TensorBoard reads the files in name order, which starts with the second they were opened
            # in: a file opened within the same second as an earlier one could be read before it.
            opened = [path.name.split(".")[3] for path in earlier]  # events.out.tfevents.<second>.<host>...
            newest = max((int(second) for second in opened if second.isdigit()), default=0)
            while int(time.time()) <= newest:
                time.sleep(0.05)
        self._summary_writer(purge_step=purge)

    def write(self, metrics: dict[str, float], step: int) -> None:
        # One event per log step holding every value, as SummaryWriter.add_scalar would write each
        # (a float, no new_style): one record to encode and checksum instead of one per metric.
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self._writer.file_writer.add_summary(Summary(value=values), step)

    def write_final(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """At the end of fit, the HParams session with the final metrics (unless written already)."""
        if params and self._default_hp_metric and not self._session_written:
            self.write_session(params, metrics)

    def write_session(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """The HParams tab's session: the hyperparameters and the metrics to compare runs by."""
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
        super().__setstate__(state)
        self._writer_lock = threading.Lock()


class _NoExperiment:
    """``logger.experiment`` on ranks other than zero: every method call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return do_nothing


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None
