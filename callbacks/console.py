"""Lines a callback writes for the user: on stderr, above the progress bar when one is drawn.

A plain ``print`` while a tqdm bar is drawn breaks the bar in two; writing through the bar
(``ProgressBar.print``, tqdm's ``write``) keeps it whole. Epochs are counted as the bar counts
them (``Epoch 3/10`` is ``current_epoch == 2``), so a message and the bar never disagree.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

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


def rank_prefixed(trainer: Trainer, text: str) -> str:
    """``text`` prefixed with ``[rank: N]`` when several processes run (Lightning's format)."""
    return f"[rank: {trainer.global_rank}] {text}" if trainer.world_size > 1 else text
