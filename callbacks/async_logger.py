"""AsyncLogger: Lightning's directory scheme and a background writer thread, for the file loggers.

Where the files go follows Lightning: ``<save_dir>/<name>/version_<N>``. Left to their defaults
(``save_dir``: the Trainer's ``default_root_dir``; ``name``: ``"lightning_logs"``; ``version``: the
next free one), every logger of a run writes into one directory, ``trainer.log_dir``, where the
checkpoints go too. A run resumed from a checkpoint in ``<...>/version_<N>/checkpoints/`` keeps
logging into ``version_<N>``.

The logged values are queued for the logger's own thread, which does the file I/O, so a slow
disk never stalls training; ``teardown`` and ``on_exception`` drain the queue, so no logged line
is lost.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import MisconfigurationException, refuse_url, warn
from callbacks.logging import (Logger, hyperparameters_to_log, logger_metrics, metric_number, saved_hyperparameters,
                               write_hparams)

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class AsyncLogger(Logger):
    """Base of the file loggers: Lightning's directory scheme and one writer thread per logger.

    Subclasses implement ``open(directory, resume_step)``, ``write(metrics, step)``,
    ``flush()`` and ``close()``, which run on the writer thread; ``write_hyperparams(params)``
    and ``write_final(params, metrics)`` (at the end of ``fit``) when they keep hyperparameters.

    Log steps reach the thread in batches, at most one hand-over a second: each hand-over wakes
    the thread, which then takes the interpreter lock from the training loop, and on a 2-core VM
    that switch measured 0.75 ms per log step (15 us a step at log_every_n_steps=50;
    benchmarks/RESULTS.md). Values reach the files at most a second later; ``finalize``
    (teardown, on_exception) hands over the rest, so no line is lost.

    Args:
        save_dir: the directory that holds the experiments; default: the Trainer's
            ``default_root_dir``.
        name: the experiment, a directory under ``save_dir`` (``""`` or None: none).
        version: an int (directory ``version_<int>``), a str (the directory's name), or None: the
            run's version (the next free ``version_<N>``, shared by the run's loggers, or the one
            a resumed run's checkpoint lies in). An existing version is overwritten by a new run
            and continued by a run resumed from its checkpoint.
        prefix: put in front of every metric name, joined with ``"-"`` (Lightning's ``prefix``).
    """

    #: Seconds between two hand-overs of logged values to the writer thread.
    handover_seconds: float = 1.0
    #: The least time between two hand-overs that ``flush_every_n_steps`` asks for.
    min_handover_seconds: float = 0.1

    def __init__(self, save_dir: str | os.PathLike | None = None, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "") -> None:
        kind = type(self).__name__
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise MisconfigurationException(
                f"{kind}(save_dir={save_dir!r}): use a directory path, or None for the Trainer's default_root_dir.")
        refuse_url(save_dir, f"{kind}(save_dir)")
        if name is not None and not isinstance(name, str):
            raise MisconfigurationException(f"{kind}(name={name!r}): use a directory name (a str), or \"\" for none.")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))
                                    or (isinstance(version, int) and version < 0) or version == ""):
            raise MisconfigurationException(
                f"{kind}(version={version!r}): use an int >= 0 (version_<N>), a directory name, "
                "or None for the next free version.")
        if not isinstance(prefix, str):
            raise MisconfigurationException(f"{kind}(prefix={prefix!r}): use a str.")
        self._save_dir = Path(save_dir) if save_dir is not None else None
        self._name = name or ""
        self._version = version
        self.prefix = prefix
        self.hparams: dict[str, Any] = {}
        self._rank_zero = True
        self._pending: list[tuple[Callable[..., None], tuple]] = []  # not yet handed to the thread
        self._handed_over_at = time.monotonic()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: set[Path] = set()  # directories this logger wrote in this process
        self._last_step = 0
        self._opened = threading.Event()  # the writer thread has opened its files (experiment waits for it)
        self._attached = False  # a Trainer's stage uses it (between setup and teardown); else it writes at once
        #: Hand the logged values over at least every this many steps (CSVLogger's flush_logs_every_n_steps).
        self.flush_every_n_steps: int | None = None
        self._handed_over_step = 0

    #: Lightning's: what joins ``prefix`` and a metric's name, and the hyperparameters' file name.
    LOGGER_JOIN_CHAR = "-"
    NAME_HPARAMS_FILE = "hparams.yaml"
    #: ``hparams.yaml`` (``{}``) in every run's directory, as Lightning's TensorBoardLogger writes it in
    #: ``save()``; False: only once ``log_hyperparams`` was called (Lightning's CSVLogger).
    EMPTY_HPARAMS_FILE = True
    _hparams_logged = False

    @property
    def state_key(self) -> str:
        """Two loggers of one class must write to different places (the key also names them in
        the error that says so)."""
        where = {"save_dir": self.save_dir, "name": self._name, "version": self._version}
        return f"{type(self).__qualname__}{where}"

    # --- Lightning's surface ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str | None:
        """The directory that holds the experiments (None until a Trainer gives its default)."""
        return str(self._save_dir) if self._save_dir is not None else None

    @property
    def root_dir(self) -> str:
        """``<save_dir>/<name>``: where the versions are."""
        if self._save_dir is None:
            raise RuntimeError(
                f"{type(self).__name__}() without save_dir logs under the Trainer's default_root_dir, so its "
                "directories are known once a Trainer runs with it. Pass save_dir=... to know them before."
            )
        return str(self._save_dir / (self.name or ""))  # the name property: a subclass may override it

    @property
    def version(self) -> int | str:
        """This run's version; the next free one under ``root_dir`` if none was given."""
        if self._version is None:
            self._version = self.next_version(Path(self.root_dir))
        return self._version

    @property
    def version_dir(self) -> str:
        """``<save_dir>/<name>/version_<N>`` (or the str version): this run's directory."""
        version = self.version
        return str(Path(self.root_dir) / (version if isinstance(version, str) else f"version_{version}"))

    @property
    def log_dir(self) -> str:
        """Where this logger's files go: the run's directory (``version_dir``)."""
        return self.version_dir

    @staticmethod
    def next_version(root: Path) -> int:
        """One more than the highest ``version_<N>`` directory under ``root`` (0 if none)."""
        numbers = [int(path.name[8:]) for path in root.glob("version_*") if path.name[8:].isdigit()]
        return max(numbers, default=-1) + 1

    def resolve(self, default_root_dir: Path, version: int | str | None = None, taken: frozenset[Path] = frozenset()) -> Path:
        """Fix ``save_dir`` (default ``default_root_dir``) and, unless given, the version
        (default ``version``, else the next free one); return the log directory. The Trainer
        calls this once per run, before any process starts. ``taken``: the log directories of the
        run's other loggers of this class: a version left to the run is not one of them (two
        identical loggers write to two versions, as Lightning's, not to the same files)."""
        if self._save_dir is None:
            self._save_dir = Path(default_root_dir)
        left = self._version is None
        if left and version is not None:
            self._version = version
        if left and taken and Path(self.log_dir) in taken:  # the next free version none of them took
            number = self.next_version(Path(self.root_dir))
            while self._set_version(number) in taken:
                number += 1
        return Path(self.version_dir)

    def _set_version(self, version: int | str) -> Path:
        self._version = version
        return Path(self.log_dir)

    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        """Write ``metrics`` at ``step`` (default: the last step written). Rank zero only; a
        tensor value is read to the host here (that is a device sync: pass floats in loops)."""
        if not self._rank_zero:
            return
        values = self._prefixed({key: metric_number(key, value) for key, value in metrics.items()})
        if step is not None:
            self._last_step = int(step)
        self._add(self.write, values, self._last_step)
        if self._attached:
            self._flush_if_due(self._last_step)
        else:
            self._write_alone()

    def log_hyperparams(self, params: Mapping[str, Any] | Any = None, *args: Any, **kwargs: Any) -> None:
        """Keep ``params`` (a dict or an argparse Namespace; None: nothing new) in ``hparams.yaml``
        (and TensorBoard's hparams at the end of fit)."""
        if not self._rank_zero:
            return
        self._hparams_logged = True
        if params is not None:
            params = vars(params) if not isinstance(params, Mapping) and hasattr(params, "__dict__") else dict(params)
            self.hparams.update(params)
            self._add(self.write_hyperparams, dict(self.hparams))
        self._write_alone()
        if not self._attached:  # by hand, hparams.yaml is there on return (also for params=None), as Lightning's
            self.save()

    def save(self) -> None:
        """Hand what was logged to the writer thread now (used without a Trainer: and wait until
        it is in the files, as Lightning's loggers write in ``save``)."""
        self._hand_over(force=True)
        if not self._attached and self._thread is not None:
            written = threading.Event()
            self._pending.append((lambda: (self.flush(), written.set()), ()))
            self._hand_over(force=True)
            while not written.wait(0.05):
                if self._error is not None:  # the writer stopped at an error: say so, never wait for ever
                    self._raise_error()

    def _write_alone(self) -> None:
        """A logger used without a Trainer (Lightning code logging by hand) creates its directory and
        files at its first call, as Lightning's do; with a Trainer, its stage starts the writer."""
        if self._thread is None and not self._attached and self._save_dir is not None and self._rank_zero:
            self._start(Path(self.log_dir), resume_step=None)
            self._opened.wait()

    def finalize(self, status: str = "success") -> None:
        """Write everything logged, close the files, stop the thread. Works without a Trainer too."""
        if self._thread is None and self._pending and self._save_dir is not None and self._rank_zero:
            self._start(Path(self.log_dir), resume_step=None)  # used on its own: write now
        if self._thread is None:
            return
        self._hand_over(force=True)
        self._queue.put(None)
        self._thread.join()
        self._thread = self._queue = None
        if self._error is not None:
            warn(f"{type(self).__name__} could not write to {self.log_dir}: {self._error}")

    # --- the callback side -----------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._rank_zero, self._attached = trainer.is_global_zero, True
        params = hyperparameters_to_log(trainer, module)  # on every rank: a conflict fails them all
        if self._rank_zero:
            self.hparams.update(params)
            self._hparams_logged = self._hparams_logged or saved_hyperparameters(trainer, module)
            if stage != "fit":  # fit starts the writer once a checkpoint is restored (on_fit_start)
                self._start(Path(self.log_dir), resume_step=None)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._rank_zero:
            self._start(Path(self.log_dir), resume_step=trainer.global_step)

    def on_log(self, trainer: Trainer, module: TrainingModule, metrics: dict[str, float], step: int) -> None:
        if self._rank_zero:
            metrics, step = logger_metrics(self._prefixed(metrics), step, trainer.current_epoch)
            self._add(self.write, metrics, step)
            self._last_step = step
            self._flush_if_due(step)

    def _prefixed(self, metrics: dict[str, float]) -> dict[str, float]:
        """Lightning's ``prefix``: ``"train"`` logs ``loss`` as ``train-loss`` (the ``epoch`` column stays)."""
        if not self.prefix:
            return metrics
        join = self.LOGGER_JOIN_CHAR
        return {f"{self.prefix}{join}{key}" if key not in ("epoch", "step") else key: value for key, value in metrics.items()}

    def _flush_if_due(self, step: int) -> None:
        """``flush_every_n_steps``: hand over once that many steps were logged since the last time, but
        not within ``min_handover_seconds`` of it (a fast loop would otherwise pay a thread switch
        every few milliseconds)."""
        if (self.flush_every_n_steps is not None and step - self._handed_over_step >= self.flush_every_n_steps
                and time.monotonic() - self._handed_over_at >= self.min_handover_seconds):
            self._handed_over_step = step
            self._hand_over(force=True)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self._rank_zero and stage == "fit" and self._thread is not None and self._error is None:
            final = self._prefixed({key: float(value) for key, value in trainer.callback_metrics.items()})
            self._add(self.write_final, dict(self.hparams), final)
        if self._attached:  # not after on_exception: finalize("failed") was the run's, as in Lightning
            self.finalize("success")
        self._attached = False

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        self.finalize("failed")
        self._attached = False

    # --- the writer thread -----------------------------------------------------------------
    def _add(self, write: Callable[..., None], *args: Any) -> None:
        if self._error is not None:
            self._raise_error()
        self._pending.append((write, args))
        self._hand_over(force=False)

    def _raise_error(self) -> None:
        """The writer thread failed: say so on the training thread."""
        raise RuntimeError(f"{type(self).__name__} could not write to {self.log_dir}: {self._error}") from self._error

    def _hand_over(self, force: bool) -> None:
        if self._queue is None or not self._pending:
            return
        now = time.monotonic()
        if force or now - self._handed_over_at >= self.handover_seconds:
            self._queue.put(self._pending)
            self._pending, self._handed_over_at = [], now

    def _start(self, directory: Path, resume_step: int | None) -> None:
        """Start the writer thread on ``directory``. ``resume_step``: fit starts at this global
        step (a directory this logger did not write itself is then continued up to that step
        when it is > 0, or overwritten when it is 0); None: append (validate, test, predict)."""
        if self._thread is not None:
            return
        if directory in self._written:
            resume_step = None  # our own files from an earlier stage of this run: append
        self._written.add(directory)
        self._queue, self._error = queue.Queue(), None
        self._opened.clear()
        self._thread = threading.Thread(target=self._drain, args=(directory, resume_step, dict(self.hparams)),
                                        name=f"cadence-{type(self).__name__}", daemon=True)
        self._thread.start()
        self._hand_over(force=True)

    def _drain(self, directory: Path, resume_step: int | None, hparams: dict[str, Any]) -> None:
        try:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                self.open(directory, resume_step)
            finally:
                self._opened.set()
            if hparams or self._hparams_logged or self.EMPTY_HPARAMS_FILE:  # an empty one too, as Lightning's
                self.write_hyperparams(hparams)
            while (batch := self._queue.get()) is not None:
                for write, args in batch:
                    write(*args)
                self.flush()
        except BaseException as error:  # reported on the training thread at the next on_log
            self._error = error
            while self._queue.get() is not None:
                pass
        finally:
            try:
                self.close()
            except Exception:
                pass

    def open(self, directory: Path, resume_step: int | None) -> None:
        raise NotImplementedError

    def write(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def write_hyperparams(self, params: dict[str, Any]) -> None:
        write_hparams(Path(self.log_dir), params)

    def write_final(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """At the end of fit: the hyperparameters with the final metrics."""

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned processes before any thread runs; never the thread, queue or open files.
        state = dict(self.__dict__)
        state.update(_queue=None, _thread=None, _pending=[], _opened=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._opened = threading.Event()
