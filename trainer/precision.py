"""``Trainer(precision=...)``: Lightning's precision spellings, translated once, at construction.

``"bf16-mixed"`` and ``"16-mixed"`` become a ``callbacks.AMP`` at the head of the callbacks
(autocast around forward and loss; float16 adds a GradScaler), unless the strategy takes mixed
precision over itself (``Strategy.mixed_precision``, FSDP's policy). ``"32-true"`` adds nothing.
As in Lightning, ``"16-mixed"`` on the CPU trains in bfloat16, with a warning (``AMP("fp16")``
gives float16 there). The loop never reads ``precision``.
"""

from __future__ import annotations

from typing import Any

import torch

from callbacks import AMP, Callback
from strategies import Strategy
from callbacks.console import warn

#: Accepted values -> the AMP dtype (None: full float32). As in Lightning, "16", 16 and "bf16" are
#: old spellings of the mixed ones; 32 and "32" of "32-true".
PRECISIONS: dict[Any, str | None] = {
    "32-true": None, "32": None, 32: None,
    "16-mixed": "float16", "16": "float16", 16: "float16",
    "bf16-mixed": "bfloat16", "bf16": "bfloat16",
}
_OLD_SPELLINGS = {"16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}
_NOT_BUILT = {
    "64-true": "Cadence has no float64 mode; call model.double() and feed float64 data yourself",
    "64": "Cadence has no float64 mode; call model.double() and feed float64 data yourself",
    64: "Cadence has no float64 mode; call model.double() and feed float64 data yourself",
    "16-true": "Cadence does not train with half-precision weights; use '16-mixed' (float32 weights, float16 compute)",
    "bf16-true": "Cadence does not train with bfloat16 weights; use 'bf16-mixed' (float32 weights, bfloat16 compute)",
}


def add_precision_callback(precision: Any, strategy: Strategy, callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the AMP callback that ``precision`` asks for, if any.

    Raises:
        ValueError: ``precision`` is not an accepted spelling, or the callbacks already hold an
            ``AMP`` (two places would set the precision).
    """
    if precision is None:
        return callbacks
    accepted = ", ".join(repr(value) for value in PRECISIONS)
    if isinstance(precision, bool) or not isinstance(precision, (str, int)) or precision not in PRECISIONS:
        hint = _NOT_BUILT.get(precision) if isinstance(precision, (str, int)) else None
        raise ValueError(f"Trainer(precision={precision!r}) is not supported{f' ({hint})' if hint else ''}. "
                         f"Use one of {accepted}, or None.")
    explicit = [callback for callback in callbacks if isinstance(callback, AMP)]
    if explicit:
        raise ValueError(
            f"Trainer(precision={precision!r}) and callbacks=[{explicit[0]!r}] both set the precision. "
            "Keep one: drop precision=..., or drop the AMP callback."
        )
    if precision in _OLD_SPELLINGS and strategy.is_global_zero:
        warn(f"Trainer(precision={precision!r}) is an old spelling, kept for Lightning's sake; "
             f"write precision={_OLD_SPELLINGS[precision]!r}.")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return callbacks
    if strategy.mixed_precision(torch.bfloat16 if dtype == "bfloat16" else torch.float16):
        return callbacks
    # As in Lightning, "16-mixed" on the CPU trains in bfloat16 (AMP warns when it switches).
    return [AMP(dtype, cpu_dtype="bfloat16" if dtype == "float16" else None), *callbacks]
