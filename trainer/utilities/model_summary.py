"""Lightning's ``lightning.pytorch.utilities.model_summary``: the table of a module's layers.

``from trainer.utilities.model_summary import ModelSummary, summarize`` as in Lightning; the code is
``callbacks/summary.py``, which the ``callbacks.ModelSummary`` callback prints with.
"""

from callbacks.summary import (  # noqa: F401 (the names Lightning users import from here)
    LEFTOVER_PARAMS_NAME, NOT_APPLICABLE, UNKNOWN_SIZE, LayerSummary, ModelSummary, get_formatted_model_size,
    get_human_readable_count, parse_batch_shape, summarize,
)
