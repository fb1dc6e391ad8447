"""ModelSummary: the table of the module's layers and parameter counts, printed when fit starts.

On by default (``Trainer(enable_model_summary=False)`` turns it off). Every rank makes the summary
(``callbacks.summary``, Lightning's ``utilities.model_summary``) after the model is set up (moved,
wrapped), so the counts are those that train; rank zero prints it, to stderr. With the module's
``example_input_array`` set, the summary runs it through the module once, as Lightning's does, under
the callbacks' forward contexts (autocast): a forward that draws random numbers (a flow's
dequantization noise) then leaves the random streams where Lightning's run leaves them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from callbacks.summary import summarize, summary_table

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class ModelSummary(Callback):
    """Print the module's submodules (to ``max_depth`` levels) with their parameter counts, modes and
    FLOPs, and the trainable, frozen and total parameters, when ``fit`` starts.

    Args:
        max_depth: how many levels of submodules to list; -1 every level; 0 prints nothing (Lightning's
            meaning: the summary is off).

    A subclass may override :meth:`summarize` to show the table another way (Lightning's seam).
    """

    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationException(
                f"ModelSummary(max_depth={max_depth!r}): use an int >= 0, or -1 for every level.")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.max_depth == 0:
            return
        summary = summarize(module, self.max_depth)
        if trainer.is_global_zero:
            self.summarize(summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters,
                           summary.model_size, summary.total_training_modes, total_flops=summary.total_flops)

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        """Print the table made of ``summary_data`` (the columns, ``(title, cells)``) and the totals."""
        print(summary_table(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                            total_flops), file=sys.stderr)


class RichModelSummary(ModelSummary):
    """Lightning's RichModelSummary, printed as the plain summary (rich is not a dependency): the same
    rows to ``max_depth``. Lightning hands ``summarize_kwargs`` to rich's table only; they are refused."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if summarize_kwargs:
            raise MisconfigurationException(
                f"RichModelSummary({', '.join(summarize_kwargs)}=...): Cadence prints this summary as "
                "plain text (rich is not a dependency), and those style rich's table only. Leave them out.")
        super().__init__(max_depth)
