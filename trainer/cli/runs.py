"""Runs on disk, for the command line: the ``config.yaml`` each run saves, and which checkpoint
``--ckpt_path last`` or ``best`` means.

Every ``cadence`` stage saves its fully resolved configuration as ``config.yaml`` in its log
directory (rank zero writes it), so ``cadence fit --config <log_dir>/config.yaml`` runs it again.
A resumed run keeps its log directory: when its configuration is the first one's (the checkpoint
it resumed from aside), ``config.yaml`` stays as it is; when it differs, the new one is written
beside it as ``config.resumed.yaml`` (then ``config.resumed.2.yaml``, ...) and the differences are
printed. Nothing is overwritten.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks import Callback, ModelCheckpoint
from strategies.checkpoint import check_exists, is_checkpoint, newest_last, read_checkpoint, run_checkpoint_directories
from trainer.cli.config_files import ConfigError

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

#: Keys that may differ between a run and its resumption without counting as a new configuration.
RESUME_KEYS = ("ckpt_path",)


class SaveConfig(Callback):
    """Write the run's resolved configuration into its log directory when a stage sets up (rank zero).

    Args:
        config: the plain configuration (``Run.resolved()``).
        command: the subcommand that runs it (``"fit"``), for the file's header.
        seed_drawn: the seed was drawn for ``seed_everything: true``; a resumed run draws another,
            which is no difference worth a new file.
    """

    def __init__(self, config: dict[str, Any], command: str, seed_drawn: bool = False) -> None:
        self.config, self.command, self.seed_drawn = config, command, seed_drawn
        self.path: Path | None = None  # the file this run's configuration is in, once set up

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        self.path = self._save(Path(trainer.log_dir))
        # Said here, by the process that wrote it (after a DDP spawn, not the one that launched it).
        print(f"Configuration: {self.path}", file=sys.stderr, flush=True)

    def _save(self, directory: Path) -> Path:
        from trainer.cli.config import to_yaml

        first = directory / "config.yaml"
        if not first.exists():
            return _write(first, self._header(first) + to_yaml(self.config))
        earlier = [first, *sorted(directory.glob("config.resumed*.yaml"), key=_resumed_number)]
        for path in earlier:
            if not _differences(_read(path), self.config, self._ignored()):
                return path  # the same configuration: nothing new to write
        path = directory / ("config.resumed.yaml" if len(earlier) == 1 else f"config.resumed.{len(earlier)}.yaml")
        _write(path, self._header(path) + to_yaml(self.config))
        changes = _differences(_read(first), self.config, self._ignored())
        print(f"cadence {self.command}: this run continues {directory}, whose config.yaml differs: "
              f"{'; '.join(changes[:5])}{' ...' if len(changes) > 5 else ''}. Saved this configuration as {path.name}.",
              file=sys.stderr, flush=True)
        return path

    def _ignored(self) -> tuple[str, ...]:
        return (*RESUME_KEYS, "seed_everything", "trainer.seed") if self.seed_drawn else RESUME_KEYS

    def _header(self, path: Path) -> str:
        when = datetime.datetime.now().isoformat(timespec="seconds")
        return (f"# Written by `cadence {self.command}` on {when}: the run's whole configuration.\n"
                f"# Run it again with: cadence fit --config {path}\n")


def _write(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _resumed_number(path: Path) -> int:
    middle = path.name[len("config.resumed"):-len(".yaml")]
    return int(middle[1:]) if middle[1:].isdigit() else 1


def _differences(old: Any, new: Any, ignored: tuple[str, ...], key: str = "") -> list[str]:
    """``["trainer.max_epochs: 3 -> 5", ...]``: where ``new`` differs from ``old``, except ``ignored`` keys."""
    if key in ignored:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        changes = []
        for name in [*old, *(name for name in new if name not in old)]:
            child = f"{key}.{name}" if key else str(name)
            changes += _differences(old.get(name), new.get(name), ignored, child)
        return changes
    return [] if old == new else [f"{key}: {old!r} -> {new!r}"]


# =============================================================================================
# Which checkpoint --ckpt_path last / best means
# =============================================================================================
def note(command: str, text: str) -> None:
    """Print ``cadence <command>: <text>`` on standard error, once. Before launch every torchrun
    process runs the whole command; the one whose ``RANK`` is 0 (or unset: no torchrun) says it."""
    if os.environ.get("RANK", "0") == "0":
        print(f"cadence {command}: {text}", file=sys.stderr, flush=True)


def checkpoint_for(ckpt_path: str | None, stage: str, trainer: Trainer, model_class_path: str) -> str | None:
    """The checkpoint file a command-line run of ``stage`` loads.

    ``last``: the newest ``last.ckpt`` in the ModelCheckpoint's ``dirpath`` if the config gives one,
    else under ``<default_root_dir>/lightning_logs/version_*/checkpoints/`` among the runs of the same
    model class (by their ``config.yaml``; runs started from Python count too). ``best``: the best
    checkpoint recorded by the ModelCheckpoint in that ``last.ckpt``. ``fit`` with no ``last.ckpt``
    starts from scratch (saying so), so one command both starts and resumes a run.
    """
    if ckpt_path is None:
        return None
    if ckpt_path not in ("last", "best"):
        try:  # here, so that a wrong path is one line, not a traceback
            return str(check_exists(ckpt_path, hint="Check the path, or pass --ckpt_path last."))
        except ValueError as error:  # an incomplete sharded checkpoint
            raise ConfigError(f"ckpt_path: {error}", "ckpt_path") from None
    if ckpt_path == "best" and stage == "fit":
        raise ConfigError('ckpt_path: "best" is for validate, test and predict; fit resumes from "last" or a path.',
                          "ckpt_path")
    last, where = _newest_last(trainer, model_class_path)
    if last is None:
        if stage == "fit":
            note("fit", f"ckpt_path: last found no last.ckpt from a run of {model_class_path} in {where}; training "
                        "starts from scratch.")
            return None
        raise ConfigError(f"ckpt_path: {ckpt_path} found no last.ckpt from a run of {model_class_path} in {where}. "
                          "Train one first (cadence fit with the same config), or pass a checkpoint path.", "ckpt_path")
    if ckpt_path == "last":
        return str(last)
    return str(_best_recorded_in(last, trainer))


def _newest_last(trainer: Trainer, model_class_path: str) -> tuple[Path | None, str]:
    directories = [Path(c.dirpath) for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
    if directories:
        return newest_last(directories), " or ".join(map(str, directories))
    root = Path(trainer.default_root_dir) / "lightning_logs"
    runs = [d for d in run_checkpoint_directories(root) if _model_of(d.parent) in (None, model_class_path)]
    return newest_last(runs), f"{root}/version_*/checkpoints"


def _model_of(run_directory: Path) -> str | None:
    config = _read(run_directory / "config.yaml")
    try:
        return config["model"]["class_path"]
    except (TypeError, KeyError):
        return None


def _best_recorded_in(last: Path, trainer: Trainer) -> Path:
    try:
        state = read_checkpoint(last, weights=False)  # the callbacks' states; no tensor is read
    except ValueError as error:  # damaged: one line, not a traceback
        raise ConfigError(f"ckpt_path: best: {error}", "ckpt_path") from None
    recorded = {key: value for key, value in state.get("callbacks", {}).items()
                if key.startswith("ModelCheckpoint") and value.get("best_model_path")}
    ours = next((c.state_key for c in trainer.checkpoint_callbacks if hasattr(c, "best_model_path")), None)  # a ModelCheckpoint
    chosen = recorded.get(ours) if ours in recorded else next(iter(recorded.values()), None) if len(recorded) == 1 else None
    if chosen is None:
        found = ", ".join(recorded) or "none"
        raise ConfigError(f"ckpt_path: best: {last} does not say which checkpoint is best for {ours or 'this run'} "
                          f"(ModelCheckpoints recorded: {found}). Pass a checkpoint path.", "ckpt_path")
    best = Path(chosen["best_model_path"])
    if not is_checkpoint(best):
        raise ConfigError(f"ckpt_path: best: the best checkpoint recorded in {last}, {best}, no longer exists. "
                          "Pass another checkpoint path, or ckpt_path: last.", "ckpt_path")
    return best
