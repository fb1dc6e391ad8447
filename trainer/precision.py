"""``Trainer(precision=...)``: Lightning's precision spellings, translated once, at construction.

``"bf16-mixed"`` and ``"16-mixed"`` become a ``callbacks.AMP`` at the head of the callbacks
(autocast around forward and loss; float16 adds a GradScaler), unless the strategy takes mixed
precision over itself (``Strategy.mixed_precision``, FSDP's policy). ``"64-true"`` (``"64"``,
``64``), ``"bf16-true"`` and ``"16-true"`` become a ``callbacks.TruePrecision``: weights, inputs and
computations in that dtype (Lightning's DoublePrecision and HalfPrecision plugins); not under FSDP.
``"32-true"`` adds nothing. As in Lightning, ``"16-mixed"`` on the CPU trains in bfloat16, with a
warning (``AMP("fp16")`` gives float16 there). The loop never reads ``precision``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from callbacks import AMP, Callback, TruePrecision
from strategies import Strategy
from callbacks.console import MisconfigurationException, warn

#: Accepted values -> the AMP dtype (None: full float32), or the TruePrecision's (Lightning's name).
#: As in Lightning, "16", 16 and "bf16" are old spellings of the mixed ones; 32 and "32" of
#: "32-true"; 64 and "64" of "64-true" (without a warning, as there).
PRECISIONS: dict[Any, str | None] = {
    "32-true": None, "32": None, 32: None,
    "16-mixed": "float16", "16": "float16", 16: "float16",
    "bf16-mixed": "bfloat16", "bf16": "bfloat16",
    "64-true": "64-true", "64": "64-true", 64: "64-true", "bf16-true": "bf16-true", "16-true": "16-true",
}
_OLD_SPELLINGS = {"16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}


def add_precision_callback(precision: Any, strategy: Strategy, callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` with the AMP or TruePrecision callback that ``precision`` asks for, if any.

    Raises:
        ValueError: ``precision`` is not an accepted spelling; the callbacks already hold an ``AMP``
            or a ``TruePrecision`` (two places would set the precision); a true precision under
            FSDP, or float64 on an Apple GPU.
    """
    explicit = [callback for callback in callbacks if isinstance(callback, (AMP, TruePrecision))]
    if len(explicit) > 1:
        raise MisconfigurationException(
            f"callbacks=[{explicit[0]!r}, {explicit[1]!r}] both set the precision. Keep one of them.")
    if precision is None:
        if explicit and isinstance(explicit[0], TruePrecision):
            _check_true_precision(explicit[0], f"callbacks=[{explicit[0]!r}]", strategy)
        return callbacks
    accepted = ", ".join(repr(value) for value in PRECISIONS)
    if isinstance(precision, bool) or not isinstance(precision, (str, int)) or precision not in PRECISIONS:
        raise MisconfigurationException(
            f"Trainer(precision={precision!r}) is not supported. Use one of {accepted}, or None.")
    if explicit:
        raise MisconfigurationException(
            f"Trainer(precision={precision!r}) and callbacks=[{explicit[0]!r}] both set the precision. "
            "Keep one: drop precision=..., or drop the callback."
        )
    if precision in _OLD_SPELLINGS and strategy.is_global_zero:
        warn(f"Trainer(precision={precision!r}) is an old spelling, kept for Lightning's sake; "
             f"write precision={_OLD_SPELLINGS[precision]!r}.")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return callbacks
    if dtype.endswith("-true"):
        true_precision = TruePrecision(dtype)
        _check_true_precision(true_precision, f"Trainer(precision={precision!r})", strategy)
        return [true_precision, *callbacks]
    if strategy.mixed_precision(torch.bfloat16 if dtype == "bfloat16" else torch.float16):
        return callbacks
    # As in Lightning, "16-mixed" on the CPU trains in bfloat16 (AMP warns when it switches).
    return [AMP(dtype, cpu_dtype="bfloat16" if dtype == "float16" else None), *callbacks]


def _check_true_precision(true_precision: TruePrecision, given: str, strategy: Strategy) -> None:
    """Raise before training if ``strategy`` cannot run ``true_precision`` (``given`` names it as the user wrote it)."""
    fsdp = sys.modules.get("strategies.fsdp")  # loaded if the strategy is an FSDP
    if fsdp is not None and isinstance(strategy, fsdp.FSDP):
        raise MisconfigurationException(
            f"{given} keeps the weights in {str(true_precision.dtype).removeprefix('torch.')}, which Cadence does not "
            "build under FSDP. Use precision='bf16-mixed' (FSDP's MixedPrecisionPolicy: bfloat16 compute, float32 "
            "shards), or a single-device or DDP strategy."
        )
    device = getattr(strategy, "device", None)
    if isinstance(device, torch.device):
        true_precision.check_device(device)
