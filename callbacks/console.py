"""Lines a callback writes for the user: on stderr, above the progress bar when one is drawn; and
warnings that point at the user's line.

A plain ``print`` while a tqdm bar is drawn breaks the bar in two; writing through the bar
(``ProgressBar.print``, tqdm's ``write``) keeps it whole. Epochs are counted as the bar counts
them (``Epoch 3/10`` is ``current_epoch == 2``), so a message and the bar never disagree. A
warning raised in a hook is reported at the user's own line (the ``trainer.fit(...)`` call, or
their module's code), not at Cadence's internals, however deep the hook was called.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import sysconfig
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer import Trainer


def epoch_label(trainer: Trainer) -> str:
    """The running epoch as the progress bar shows it: ``"Epoch 3/10"`` (or ``"Epoch 3"`` without max_epochs)."""
    total = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
    return f"Epoch {trainer.current_epoch + 1}{total}"


def write_line(trainer: Trainer, text: str) -> None:
    """Write ``text`` to stderr in this process, through the progress bar when there is one."""
    bar = trainer.progress_bar_callback
    if bar is not None:
        bar.print(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def cadence_logger() -> logging.Logger:
    """The ``"cadence"`` logger: INFO to stderr unless the program configured logging (as Lightning's)."""
    logger = logging.getLogger("cadence")
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(logging.StreamHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def info(text: str, logger: str = "cadence") -> None:
    """An informational line for the user, as Lightning's ``rank_zero_info``: through Python's logging
    (the ``logger`` named, at INFO) when the program configured logging (a handler on it or an
    ancestor: ``logging.basicConfig``, a file, pytest's caplog); on stderr otherwise, so it is seen."""
    target = logging.getLogger(logger)
    if target.hasHandlers():
        if target.level == logging.getLogger("cadence").level == logging.NOTSET:
            target.setLevel(logging.INFO)  # no level chosen for Cadence's lines: the root's WARNING would drop them
        target.info(text)
    else:
        print(text, file=sys.stderr, flush=True)


def rank_prefixed(trainer: Trainer, text: str) -> str:
    """``text`` prefixed with ``[rank: N]`` when several processes run (Lightning's format)."""
    return f"[rank: {trainer.global_rank}] {text}" if trainer.world_size > 1 else text


#: Frames in these directories are not the user's: Cadence's packages and Python's own libraries.
_NOT_USERS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + package + os.sep
                    for package in ("callbacks", "trainer", "strategies")}
                   | {os.path.abspath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "purelib", "platlib")})


def refuse_url(path: Any, where: str) -> None:
    """Cadence writes to local paths: a URL (``s3://``, ``gs://``, ``memory://``...) is refused, naming ``where``."""
    if isinstance(path, str) and re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise MisconfigurationException(
            f"{where}={path!r} is a URL: Lightning reaches such paths through fsspec, Cadence reads and "
            "writes local paths only. Use a local (or mounted) path, and copy the files to or from the store.")


class MisconfigurationException(ValueError):
    """Lightning's exception for a wrong setup (``lightning.pytorch.utilities.exceptions``): every ValueError Cadence
    raises about what it was given (arguments, hooks' returns, ``self.log`` calls) is one, as Lightning raises it, so
    ``except MisconfigurationException`` and ``except ValueError`` both catch them; projects raise it too."""


class PossibleUserWarning(UserWarning):
    """Lightning's category for warnings that could be false positives (too few batches for the
    logging interval, no val loader for a ``validation_step``...): ``disable_possible_user_warnings()``
    or ``POSSIBLE_USER_WARNINGS=0`` (or ``off``) in the environment silences them all."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore warnings of the category ``PossibleUserWarning``, as Lightning's function does.

    Args:
        module: a regular expression for the module the warning is reported at. Cadence reports a
            warning at the user's own line, so this names the user's module (Lightning's own module
            names match nothing). Default: every module.
    """
    warnings.filterwarnings("ignore", module=module, category=PossibleUserWarning)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the innermost frame of the user's code that led here (the caller's
    caller if there is none: a spawned worker's stack holds no user frame)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_USERS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 3)
