"""The model summary: a table of a module's layers, their parameters, modes, FLOPs and sizes.

Lightning's ``lightning.pytorch.utilities.model_summary``, imported in Cadence as
``trainer.utilities.model_summary`` (the same names: ``ModelSummary``, ``summarize``,
``LayerSummary``, ``get_human_readable_count``, ``get_formatted_model_size``, ``parse_batch_shape``,
``UNKNOWN_SIZE``); the ``callbacks.ModelSummary`` callback prints this table when ``fit`` starts.
It lives here, below the callback, because callbacks import nothing from ``trainer``.

With the module's ``example_input_array`` set, the module runs it once (in eval mode, without
gradients, then each submodule back in its own mode) to record each layer's input and output sizes
and count the FLOPs (``torch.utils.flop_counter``), as Lightning's does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from callbacks.base import defines
from callbacks.console import MisconfigurationException, warn

UNKNOWN_SIZE = "?"
LEFTOVER_PARAMS_NAME = "other params"
NOT_APPLICABLE = "n/a"

#: Bits per parameter of each ``trainer.precision`` (a mixed precision keeps float32 weights, but
#: Lightning does not list those: it warns and counts 32 bits).
_BITS_OF_PRECISION = {"64": 64, "32": 32, "16": 16, "bf16": 16, "16-true": 16, "bf16-true": 16, "32-true": 32,
                      "64-true": 64}


class LayerSummary:
    """One layer of the summary: its type, parameter count, mode, and, once the module has run, the
    sizes of its first call's input and output (``UNKNOWN_SIZE`` until then, or for a scripted layer).

    Example::

        >>> layer = LayerSummary(torch.nn.Conv2d(3, 8, 3))
        >>> layer.num_parameters, layer.layer_type
        (224, 'Conv2d')
        >>> _ = layer._module(torch.rand(1, 3, 5, 5))
        >>> layer.in_size, layer.out_size
        ([1, 3, 5, 5], [1, 8, 3, 3])
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._in_size: Any = None
        self._out_size: Any = None
        self._hook_handle = None
        if not isinstance(module, torch.jit.ScriptModule):  # a scripted module takes no hooks
            self._hook_handle = module.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        inputs = (*args, *kwargs.values())
        self._in_size = parse_batch_shape(inputs[0] if len(inputs) == 1 else inputs)
        self._out_size = parse_batch_shape(output)
        self.detach_hook()  # the first call only: a layer called again (a recurrent loop) keeps its first sizes

    def detach_hook(self) -> None:
        """Remove the forward hook (done after the first call, and when the summary is made)."""
        if self._hook_handle is not None:
            self._hook_handle.remove()

    def __del__(self) -> None:
        self.detach_hook()

    @property
    def in_size(self) -> str | list:
        return self._in_size or UNKNOWN_SIZE

    @property
    def out_size(self) -> str | list:
        return self._out_size or UNKNOWN_SIZE

    @property
    def layer_type(self) -> str:
        """The module's class name."""
        return type(self._module).__name__

    @property
    def num_parameters(self) -> int:
        """The module's parameters (a lazy layer's not yet materialized count 0)."""
        return sum(0 if _uninitialized(p) else p.numel() for p in self._module.parameters())

    @property
    def training(self) -> bool:
        return self._module.training


class ModelSummary:
    """The summary of ``model``'s submodules down to ``max_depth`` levels; ``str()`` is the table.

    Args:
        model: the module to summarize (its ``example_input_array``, when set, is run once to
            record the layers' sizes and FLOPs).
        max_depth: levels of submodules listed: 1 the children, -1 every level, 0 none (the
            totals only).

    Example::

        >>> print(ModelSummary(model, max_depth=1))  # doctest: +SKIP
          | Name | Type       | Params | Mode  | FLOPs | In sizes  | Out sizes
        ----------------------------------------------------------------------------
        0 | net  | Sequential | 132 K  | train | 2.6 M | [10, 256] | [10, 512]
        ...
    """

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationException(
                f"ModelSummary(max_depth={max_depth!r}): `max_depth` can be -1, 0 or > 0, got {max_depth}. "
                "Use -1 for every level, 0 for the totals only, or the number of levels to list.")
        self._model = model
        self._max_depth = max_depth
        self._flop_counter = FlopCounterMode(display=False, depth=max_depth + 1)  # the model itself is depth 0
        self._warned_uninitialized = False
        self._layer_summary = self.summarize()
        trainer = getattr(model, "trainer", None)
        precision = getattr(trainer, "precision", "32-true") if trainer is not None else "32-true"
        if precision not in _BITS_OF_PRECISION:
            warn(f"Precision {precision} is not supported by the model summary.  Estimated model size in MB will not "
                 "be accurate. Using 32 bits instead.")
        self._bytes_per_parameter = _BITS_OF_PRECISION.get(precision, 32) / 8

    @property
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        """The submodules summarized before the depth cut: none, the children, or every one."""
        if self._max_depth == 0:
            return []
        if self._max_depth == 1:
            return list(self._model.named_children())
        return list(self._model.named_modules())[1:]

    def summarize(self) -> dict[str, LayerSummary]:
        """Each listed layer's :class:`LayerSummary` by name, after running ``example_input_array``."""
        layers = {name: LayerSummary(module) for name, module in self.named_modules}
        if getattr(self._model, "example_input_array", None) is not None:
            self._forward_example_input()
        for layer in layers.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            layers = {name: layer for name, layer in layers.items() if name.count(".") < self._max_depth}
        return layers

    def _forward_example_input(self) -> None:
        model = self._model
        example = model.example_input_array
        if hasattr(model, "transfer_batch_to_device"):  # a TrainingModule: its batch hooks, as a batch's
            example = model.on_after_batch_transfer(
                model.transfer_batch_to_device(model.on_before_batch_transfer(example, 0), model.device, 0), 0)
        trainer = getattr(model, "trainer", None)
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for callback in getattr(trainer, "callbacks", None) or ():  # autocast, as a step runs under
                    context = callback.forward_context() if defines(callback, "forward_context") else None
                    if context is not None:
                        stack.enter_context(context)
                stack.enter_context(self._flop_counter)
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        finally:
            for module, training in modes:
                module.train(training)

    @property
    def layer_names(self) -> list[str]:
        return list(self._layer_summary)

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self._layer_summary.values()]

    @property
    def in_sizes(self) -> list:
        return [layer.in_size for layer in self._layer_summary.values()]

    @property
    def out_sizes(self) -> list:
        return [layer.out_size for layer in self._layer_summary.values()]

    @property
    def param_nums(self) -> list[int]:
        return [layer.num_parameters for layer in self._layer_summary.values()]

    @property
    def training_modes(self) -> list[bool]:
        return [layer.training for layer in self._layer_summary.values()]

    @property
    def total_training_modes(self) -> dict[str, int]:
        """How many submodules (the model itself not counted) are in train and in eval mode, now."""
        modes = [module.training for module in self._model.modules()][1:]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return self._count(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return self._count(p for p in self._model.parameters() if p.requires_grad)

    @property
    def total_layer_params(self) -> int:
        """The listed layers' parameters summed (nested layers listed with their parents count twice)."""
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        """The parameters' size in MB at ``trainer.precision``'s bits per parameter (32 without a trainer)."""
        return self.total_parameters * self._bytes_per_parameter * 1e-6

    @property
    def total_flops(self) -> int:
        return self._flop_counter.get_total_flops()

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        """Each listed layer's FLOPs by operator (empty when the example input did not run it)."""
        counts = self._flop_counter.get_flop_counts()
        return {name: counts.get(f"{type(self._model).__name__}.{name}", {}) for name in self.layer_names}

    def _count(self, parameters: Any) -> int:
        parameters = list(parameters)
        if any(_uninitialized(p) for p in parameters) and not self._warned_uninitialized:
            self._warned_uninitialized = True
            warn("The total number of parameters detected may be inaccurate because the model contains an instance of "
                 "`UninitializedParameter`. To get an accurate number, set `self.example_input_array` in your "
                 "LightningModule.")
        return sum(0 if _uninitialized(p) else p.numel() for p in parameters)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns, ``(title, cells)``, as Lightning names this (a ``callbacks.ModelSummary``
        subclass's ``summarize`` receives them); parameters outside every listed layer get a last row."""
        columns = [(" ", [str(index) for index in range(len(self._layer_summary))]),
                   ("Name", self.layer_names),
                   ("Type", self.layer_types),
                   ("Params", [get_human_readable_count(count) for count in self.param_nums]),
                   ("Mode", ["train" if training else "eval" for training in self.training_modes]),
                   ("FLOPs", [get_human_readable_count(sum(counts.values())) for counts in self.flop_counts.values()])]
        if getattr(self._model, "example_input_array", None) is not None:
            columns += [("In sizes", [str(size) for size in self.in_sizes]),
                        ("Out sizes", [str(size) for size in self.out_sizes])]
        leftover = self.total_parameters - self.total_layer_params
        if leftover > 0:
            last = {" ": " ", "Name": LEFTOVER_PARAMS_NAME, "Params": get_human_readable_count(leftover)}
            for title, cells in columns:
                cells.append(last.get(title, NOT_APPLICABLE))
        return columns

    def __str__(self) -> str:
        return summary_table(self._get_summary_data(), self.total_parameters, self.trainable_parameters,
                             self.model_size, self.total_training_modes, self.total_flops)

    def __repr__(self) -> str:
        return str(self)


def summarize(lightning_module: nn.Module, max_depth: int = 1) -> ModelSummary:
    """The :class:`ModelSummary` of ``lightning_module`` to ``max_depth`` levels (0: the totals only)."""
    return ModelSummary(lightning_module, max_depth=max_depth)


def summary_table(columns: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int) -> str:
    """The summary's text: the columns left-aligned under their titles between two rules, then the totals."""
    rows = len(columns[0][1]) if columns else 0
    widths = [max([len(title), *(len(str(cell)) for cell in cells)]) for title, cells in columns]
    rule = "-" * (sum(widths) + 3 * (len(columns) + 1))
    lines = [" | ".join(title.ljust(width) for (title, _), width in zip(columns, widths)), rule]
    lines += [" | ".join(str(cells[row]).ljust(width) for (_, cells), width in zip(columns, widths)) for row in range(rows)]
    lines.append(rule)
    totals = [(get_human_readable_count(trainable_parameters), "Trainable params"),
              (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
              (get_human_readable_count(total_parameters), "Total params"),
              (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
              (total_training_modes["train"], "Modules in train mode"),
              (total_training_modes["eval"], "Modules in eval mode"),
              (get_human_readable_count(total_flops), "Total Flops")]
    lines += [f"{str(value):<10}{label}" for value, label in totals]
    return "\n".join(lines)


def parse_batch_shape(batch: Any) -> str | list:
    """``batch``'s shape as a list, a list of those for a list or tuple, else ``UNKNOWN_SIZE``."""
    if hasattr(batch, "shape"):
        return list(batch.shape)
    if isinstance(batch, (list, tuple)):
        return [parse_batch_shape(item) for item in batch]
    return UNKNOWN_SIZE


def get_formatted_model_size(total_model_size: float) -> str:
    """A size in MB with three decimals: ``0.530``."""
    return f"{total_model_size:,.3f}"


def get_human_readable_count(number: int) -> str:
    """A count in thousands (K), millions (M), billions (B) or trillions (T), as the table writes it:
    ``123`` -> ``"123  "``, ``1234`` -> ``"1.2 K"``, ``2e6`` -> ``"2.0 M"``, ``5e15`` -> ``"5,000 T"``."""
    if number < 0:
        raise MisconfigurationException(f"get_human_readable_count({number!r}): a count is never negative.")
    digits = int(math.floor(math.log10(number))) + 1 if number > 0 else 1
    group = min((digits + 2) // 3, 5) - 1  # 0: units, 1: K ... 4: T (no unit beyond trillions)
    unit = " KMBT"[group]
    scaled = number / 10 ** (3 * group)
    if group == 0 or scaled >= 100:
        return f"{int(scaled):,d} {unit}"
    return f"{scaled:,.1f} {unit}"


def _uninitialized(parameter: torch.Tensor) -> bool:
    return isinstance(parameter, nn.parameter.UninitializedParameter)  # a lazy layer before its first forward
