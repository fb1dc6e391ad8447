"""ModelSummary: a short table of the module's layers and parameter counts at the start of fit.

On by default (``Trainer(enable_model_summary=False)`` turns it off). Printed once, by rank zero,
after the model is set up (moved, wrapped), so the counts are those that train.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torch import nn

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


class ModelSummary(Callback):
    """Print the module's submodules (to ``max_depth`` levels) with their parameter counts, and the
    trainable, frozen and total parameters, when ``fit`` starts.

    Args:
        max_depth: how many levels of submodules to list; 0 prints only the totals, -1 every level.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"ModelSummary(max_depth={max_depth!r}): use an int >= 0, or -1 for every level.")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.is_global_zero:
            print(summarize(module, self.max_depth), file=sys.stderr)


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """The table :class:`ModelSummary` prints."""
    rows = [(name, type(child).__name__, _count(child))
            for name, child in module.named_modules()
            if name and (max_depth == -1 or name.count(".") < max_depth)]
    lines = []
    if rows:
        width = max(len("Name"), *(len(name) for name, _, _ in rows))
        kind = max(len("Type"), *(len(kind) for _, kind, _ in rows))
        lines.append(f"  | {'Name'.ljust(width)} | {'Type'.ljust(kind)} | Params")
        lines.append("-" * (width + kind + 17))
        lines += [f"{index:<2}| {name.ljust(width)} | {kind_.ljust(kind)} | {_short(count):>6}"
                  for index, (name, kind_, count) in enumerate(rows)]
        lines.append("-" * (width + kind + 17))
    trainable = sum(_numel(p) for p in module.parameters() if p.requires_grad)
    total = sum(_numel(p) for p in module.parameters())
    size = sum(_numel(p) * p.element_size() for p in module.parameters() if not _uninitialized(p))
    lines += [f"{_short(trainable):<10}Trainable params", f"{_short(total - trainable):<10}Non-trainable params",
              f"{_short(total):<10}Total params", f"{size / 1e6:<10.3f}Total estimated model params size (MB)"]
    return "\n".join(lines)


def _uninitialized(parameter: nn.Parameter) -> bool:
    return isinstance(parameter, nn.parameter.UninitializedParameter)


def _numel(parameter: nn.Parameter) -> int:
    return 0 if _uninitialized(parameter) else parameter.numel()  # a lazy layer before its first forward


def _count(module: nn.Module) -> int:
    return sum(_numel(p) for p in module.parameters())


def _short(count: int) -> str:
    """1234 -> "1.2 K", as Lightning writes parameter counts."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)
