"""Which directory a run writes into (logs, checkpoints, traces): ``trainer.log_dir``.

As in Lightning, it is the first logger's ``<save_dir>/<name>/version_<N>``; the loggers left
to their defaults share it. Without a logger it is ``default_root_dir`` itself (so checkpoints go
to ``<default_root_dir>/checkpoints``, as Lightning's ModelCheckpoint puts them); with only other
loggers, the first one's ``save_dir`` (else ``default_root_dir``). A run resumed from a checkpoint
in ``<...>/version_<N>/checkpoints/`` keeps that version, so rerunning one command continues one
run; any other checkpoint starts a new version.
"""

from __future__ import annotations

from pathlib import Path

from callbacks import AsyncLogger, Callback


def choose_log_dir(loggers: list[Callback], default_root_dir: str | Path, resumed_from: Path | None) -> Path:
    """Fix the loggers' directories and return the run's. ``resumed_from``: the checkpoint fit resumes."""
    root = versions_root(loggers, default_root_dir)
    resumed = version_of(resumed_from, root)
    file_loggers = [logger for logger in loggers if isinstance(logger, AsyncLogger)]
    if not file_loggers:
        return without_file_logger(loggers, default_root_dir)
    first, *others = file_loggers
    log_dir = first.resolve(default_root_dir, int(resumed[8:]) if resumed else None)
    placed = [(type(first), Path(first.log_dir))]
    for logger in others:  # the same version when they share the root (the defaults do), unless one of its class is there
        shared = Path(logger.save_dir or default_root_dir) / logger.name == root
        taken = frozenset(where for kind, where in placed if kind is type(logger))
        logger.resolve(default_root_dir, first.version if shared else None, taken)
        if Path(logger.log_dir) in taken:  # both given the same version
            raise RuntimeError(f"Two {type(logger).__name__}s write to {logger.log_dir}: they would write the same files. "
                               "Give one another version, name or save_dir (or leave its version to the run).")
        placed.append((type(logger), Path(logger.log_dir)))
    return log_dir


def without_file_logger(loggers: list[Callback], default_root_dir: str | Path) -> Path:
    """The run's directory when no logger writes files: the first logger's ``save_dir``, else
    ``default_root_dir`` (Lightning's ``trainer.log_dir``)."""
    save_dir = getattr(loggers[0], "save_dir", None) if loggers else None
    return Path(save_dir) if save_dir is not None else Path(default_root_dir)


def versions_root(loggers: list[Callback], default_root_dir: str | Path) -> Path:
    """Where the run's ``version_<N>`` directories are: the first file logger's ``<save_dir>/<name>``."""
    first = next((logger for logger in loggers if isinstance(logger, AsyncLogger)), None)
    if first is None:
        return Path(default_root_dir) / "lightning_logs"
    return Path(first.save_dir or default_root_dir) / first.name

def version_of(checkpoint: Path | None, root: Path) -> str | None:
    """``"version_<N>"`` when ``checkpoint`` lies in ``<root>/version_<N>/checkpoints/``, else None."""
    if checkpoint is None or checkpoint.parent.name != "checkpoints" or not root.exists():
        return None
    version = checkpoint.resolve().parent.parent
    if version.name.startswith("version_") and version.name[8:].isdigit() and version.parent == root.resolve():
        return version.name
    return None


def versioned_run_dir(default_root_dir: str | Path, resumed_from: Path | None) -> Path:
    """``<default_root_dir>/lightning_logs/version_<N>``, the next free one or, for a fit resumed from a checkpoint
    in one, that one: the command line's run directory when no logger writes files (it keeps one per run)."""
    root = Path(default_root_dir) / "lightning_logs"
    return root / (version_of(resumed_from, root) or f"version_{AsyncLogger.next_version(root)}")


def preview_log_dir(loggers: list[Callback], default_root_dir: str | Path) -> Path:
    """Before a stage: the directory :func:`choose_log_dir` will pick for a new run (a fit resumed from a
    checkpoint in an earlier version keeps that one instead); nothing is fixed or created."""
    first = next((logger for logger in loggers if isinstance(logger, AsyncLogger)), None)
    if first is None:
        return without_file_logger(loggers, default_root_dir)
    if first.save_dir is not None:  # it knows (and, as in Lightning, keeps) its version
        return Path(first.log_dir)
    root = versions_root(loggers, default_root_dir)
    return root / f"version_{AsyncLogger.next_version(root)}"
