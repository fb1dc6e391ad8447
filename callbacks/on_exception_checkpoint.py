"""OnExceptionCheckpoint: save the training state when a stage fails (Lightning's).

On an error (or Ctrl-C) inside ``fit``, it writes ``<dirpath>/<filename>.ckpt`` through
``trainer.save_checkpoint``, so the same script run again continues from there: as in Lightning,
``fit`` without ``ckpt_path`` resumes from that file when it exists (``trainer/stage.py``). As in
Lightning, a batch that failed before it was trained (its ``on_train_batch_start`` hooks or its
step) is trained again by the resumed run, and one that failed after (``on_train_batch_end``)
counts as done (``trainer/resume.py``, ``failed_before_batch_end``). A stage that ends normally
removes a file left by an earlier failure.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from callbacks.console import MisconfigurationException
from callbacks.base import Checkpoint

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class OnExceptionCheckpoint(Checkpoint):
    """Write ``<dirpath>/<filename>.ckpt`` when a stage raises.

    A ``callbacks.Checkpoint``, as in Lightning: it is in ``trainer.checkpoint_callbacks``, runs after the
    other callbacks, and no default ``ModelCheckpoint`` is added beside it (add one to the callbacks for
    periodic checkpoints). ``fit`` without ``ckpt_path`` resumes from its file when one is there
    (a run that failed), as Lightning does; ``ckpt_path="last"`` considers it too.

    Args:
        dirpath: the directory of the checkpoint.
        filename: its name, without the ``.ckpt`` extension.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        if not filename or not isinstance(filename, str):
            raise MisconfigurationException(
                f"OnExceptionCheckpoint(filename={filename!r}): use a file name without the extension, "
                "such as \"on_exception\".")
        self.dirpath, self.filename = dirpath, filename
        self._failed = False

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._failed = False

    def on_exception(self, trainer: Trainer, module: TrainingModule, error: BaseException) -> None:
        self._failed = True
        if trainer.stage != "fit" or not trainer.optimizers:  # evaluation, or fit failed before training could
            return
        try:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(self.ckpt_path)
        except Exception as failure:  # noqa: BLE001 (the stage's own error is the one to raise)
            warnings.warn(f"OnExceptionCheckpoint could not write {self.ckpt_path}: {failure}", stacklevel=2)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if not self._failed and trainer.is_global_zero:  # a run that ended well leaves no stale one
            Path(self.ckpt_path).unlink(missing_ok=True)
