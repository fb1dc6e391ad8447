"""Apple GPUs through PyTorch's MPS backend.

Some operators have no MPS kernel yet. Setting ``PYTORCH_ENABLE_MPS_FALLBACK=1`` in the
environment *before* ``import torch`` runs those on the CPU instead of raising
``NotImplementedError``; the fallback is slow, so it is a stopgap, not a default. MPS has no
float64: keep tensors in float32 (or float16/bfloat16 under AMP).
"""

from __future__ import annotations

import torch

from strategies.single import SingleDevice


class MPS(SingleDevice):
    """Train on the Apple GPU of this Mac.

    Example::

        Trainer(strategy="mps")  # or strategies.MPS()
    """

    def __init__(self) -> None:
        super().__init__(torch.device("mps"))
