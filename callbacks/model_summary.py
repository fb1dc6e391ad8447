"""ModelSummary: a short table of the module's layers and parameter counts at the start of fit.

On by default (``Trainer(enable_model_summary=False)`` turns it off). Printed once, by rank zero,
after the model is set up (moved, wrapped), so the counts are those that train. With the module's
``example_input_array`` set, every rank runs it through the module once, as Lightning does, to show
each layer's input and output sizes: a forward that draws random numbers (a flow's dequantization
noise) then leaves the random streams where Lightning's run leaves them.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

import torch
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
        sizes = None
        if self.max_depth != 0 and getattr(module, "example_input_array", None) is not None:
            contexts = [callback.forward_context() for callback in trainer.callbacks]
            example = trainer.strategy.batch_to_device(module.example_input_array)
            sizes = example_sizes(module, example, self.max_depth, [c for c in contexts if c is not None])
        if trainer.is_global_zero:
            print(summarize(module, self.max_depth, sizes), file=sys.stderr)


def _listed(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    return [(name, child) for name, child in module.named_modules()
            if name and (max_depth == -1 or name.count(".") < max_depth)]


def _shape(value: Any) -> Any:
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [_shape(item) for item in value]
    return "?"


def example_sizes(module: nn.Module, example: Any, max_depth: int = 1,
                  contexts: list[contextlib.AbstractContextManager] = ()) -> dict[str, tuple[Any, Any]]:
    """Run ``example`` (a tensor, a tuple of positional arguments or a dict of keyword arguments)
    through ``module`` once, in eval mode and without gradients, inside ``contexts`` (autocast), and
    return each listed layer's ``(input sizes, output sizes)``; every submodule's mode is restored."""
    sizes: dict[str, tuple[Any, Any]] = {}

    def record(name: str):
        def hook(_: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            sizes.setdefault(name, (_shape(inputs[0] if len(inputs) == 1 else list(inputs)), _shape(output)))
        return hook

    handles = [child.register_forward_hook(record(name)) for name, child in _listed(module, max_depth)]
    modes = [(child, child.training) for child in module.modules()]
    module.eval()
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            if isinstance(example, (list, tuple)):
                module(*example)
            elif isinstance(example, dict):
                module(**example)
            else:
                module(example)
    finally:
        for handle in handles:
            handle.remove()
        for child, training in modes:
            child.train(training)
    return sizes


def summarize(module: nn.Module, max_depth: int = 1, sizes: dict[str, tuple[Any, Any]] | None = None) -> str:
    """The table :class:`ModelSummary` prints; with ``sizes`` (:func:`example_sizes`), the layers'
    input and output sizes too ("?" for a layer the example did not reach)."""
    rows = [(name, type(child).__name__, _short(_count(child))) for name, child in _listed(module, max_depth)]
    lines = []
    if rows:
        columns = [("Name", [row[0] for row in rows]), ("Type", [row[1] for row in rows]),
                   ("Params", [row[2] for row in rows])]
        if sizes is not None:
            columns += [("In sizes", [str(sizes.get(name, ("?", "?"))[0]) for name, _, _ in rows]),
                        ("Out sizes", [str(sizes.get(name, ("?", "?"))[1]) for name, _, _ in rows])]
        widths = [max(len(title), *(len(cell) for cell in cells)) for title, cells in columns]
        header = "  | " + " | ".join(title.ljust(width) for (title, _), width in zip(columns, widths))
        lines.append(header)
        lines.append("-" * len(header))
        lines += [f"{index:<2}| " + " | ".join(cells[index].rjust(width) if title == "Params" else cells[index].ljust(width)
                                              for (title, cells), width in zip(columns, widths)).rstrip()
                  for index in range(len(rows))]
        lines.append("-" * len(header))
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


class RichModelSummary(ModelSummary):
    """Lightning's RichModelSummary, printed as the plain summary (rich is not a dependency): the same
    rows to ``max_depth``. Lightning hands ``summarize_kwargs`` to rich's table only; they are refused."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if summarize_kwargs:
            raise ValueError(f"RichModelSummary({', '.join(summarize_kwargs)}=...): Cadence prints this summary as "
                             "plain text (rich is not a dependency), and those style rich's table only. Leave them out.")
        super().__init__(max_depth)
