"""Gradient (activation) checkpointing: recompute chosen blocks in backward instead of storing them.

A checkpointed block keeps only its inputs for backward; its activations are recomputed when
backward reaches it. That trades one more forward of those blocks (about a third more compute
for a model made of them) for the memory their activations took, which is most of a deep model's
training memory. Measured in ``benchmarks/checkpointing.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from callbacks.forwards import ForwardFunction, restore_forward, wrap_forward
from strategies.selection import ACCEPTED, select_submodules

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class GradientCheckpointing(Callback):
    """Run the selected submodules' forwards under ``torch.utils.checkpoint`` (non-reentrant).

    Gradients are those of the model without it (the recomputation replays the RNG, so dropout
    draws the same mask, and autocast); the state dict keeps its keys, because each block's
    ``forward`` is replaced in place (``callbacks/forwards.py``) and put back when the stage ends.

    Args:
        modules: which submodules: a module class or a tuple of classes (every instance, e.g. your
            transformer block), a list of dotted names (``["encoder.layers.0"]``), or a predicate
            ``(name, module) -> bool``. Selecting nothing is an error listing the model's children.

    Composes with ``Compile(modules=...)`` on the same blocks (list this callback first: the
    compiled region then holds the checkpoint), ``AMP``, gradient accumulation and DDP (the
    recomputation happens inside backward; DDP's all-reduce hooks fire as usual). Under
    ``torch.no_grad``/``inference_mode`` (validation) the blocks just run.

    Example::

        Trainer(callbacks=[GradientCheckpointing(modules=nn.TransformerEncoderLayer)])
    """

    def __init__(self, modules: Any) -> None:
        if modules is None:
            raise MisconfigurationException(
                f"GradientCheckpointing(modules=None): say which blocks to checkpoint: {ACCEPTED}.")
        self.modules = modules
        self._blocks: list[nn.Module] = []

    def configure_model(self, model: nn.Module) -> nn.Module:
        self._blocks = [block for _, block in select_submodules(model, self.modules, "GradientCheckpointing(modules=...)")]
        for block in self._blocks:
            wrap_forward(block, checkpointed)
        return model

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        for block in self._blocks:
            restore_forward(block)
        self._blocks = []


def checkpointed(forward: ForwardFunction) -> ForwardFunction:
    """``forward`` run under non-reentrant activation checkpointing while gradients are recorded."""

    def checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for backward anyway
            return forward(module, *args, **kwargs)
        return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward
