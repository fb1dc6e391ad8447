"""What a TrainingModule offers beyond training, as Lightning's LightningModule: ``to_torchscript``,
``to_onnx`` and ``all_gather``. The module's methods are thin; the work is here.

TorchScript cannot compile the module's Python-only properties (the Trainer, the loggers, the
counters), so the module lists them in ``__jit_unused_properties__`` (see :func:`unscriptable`).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import MisconfigurationException
from strategies.transfer import move_to_device

if TYPE_CHECKING:
    from trainer.module import TrainingModule


def unscriptable(cls: type) -> list[str]:
    """The properties of ``cls`` and its bases that ``torch.jit.script`` is to leave alone."""
    return sorted({name for klass in cls.__mro__ for name, value in vars(klass).items() if isinstance(value, property)})


def example_inputs(module: TrainingModule, given: Any, what: str) -> Any:
    """``given`` (or the module's ``example_input_array``) on the module's device."""
    if given is None:
        given = module.example_input_array
        if given is None:
            raise MisconfigurationException(
                f"{type(module).__name__}.{what} needs an input to trace the model with: pass it, or set "
                "model.example_input_array (Lightning's message: requires either `example_inputs` or "
                "`model.example_input_array` to be defined).")
    return move_to_device(given, module.device)


@torch.no_grad()
def to_torchscript(module: TrainingModule, file_path: str | os.PathLike | None, method: str | None,
                   example: Any, kwargs: dict[str, Any]) -> Any:
    """``module`` compiled by ``torch.jit.script`` (or traced with ``method="trace"``), in eval mode;
    saved at ``file_path`` when given. The module's training mode is restored after."""
    warnings.warn(f"{type(module).__name__}.to_torchscript: TorchScript is deprecated in PyTorch, and Lightning's "
                  "`LightningModule.to_torchscript` has been deprecated in v2.7 and will be removed in v2.8; use "
                  "torch.export.export() to export a model.",
                  DeprecationWarning, stacklevel=3)
    mode = module.training
    if method == "script":
        scripted = torch.jit.script(module.eval(), **kwargs)
    elif method == "trace":
        if kwargs.get("check_inputs") is not None:
            kwargs["check_inputs"] = move_to_device(kwargs["check_inputs"], module.device)
        scripted = torch.jit.trace(module.eval(), example_inputs(module, example, "to_torchscript(method='trace')"),
                                   **kwargs)
    else:
        raise MisconfigurationException(
            f"to_torchscript(method={method!r}): the 'method' parameter only supports 'script' or 'trace'.")
    module.train(mode)
    if file_path is not None:
        torch.jit.save(scripted, os.fspath(file_path))
    return scripted


def to_onnx(module: TrainingModule, file_path: Any, input_sample: Any, kwargs: dict[str, Any]) -> Any:
    """``torch.onnx.export(module, input_sample, file_path, **kwargs)``, the module's mode restored."""
    if importlib.util.find_spec("onnx") is None:
        raise ModuleNotFoundError(f"`{type(module).__name__}.to_onnx()` requires `onnx` to be installed: "
                                  "pip install onnx onnxscript (Cadence does not depend on it).")
    mode = module.training
    sample = example_inputs(module, input_sample, "to_onnx")
    result = torch.onnx.export(module, sample, os.fspath(file_path) if file_path is not None else None, **kwargs)
    module.train(mode)
    return result


def refuse_tensorrt(module: TrainingModule) -> None:
    """Lightning's ``to_tensorrt`` (``torch_tensorrt.compile`` of the module, then ``torch_tensorrt.save``): its words
    when the package is missing, and in every case the way to do it without Cadence in between."""
    how = ("call torch_tensorrt.compile(module.eval(), ir=\"default\", inputs=[example_input]) and "
           "torch_tensorrt.save(...) on this module directly (Cadence does not export to TensorRT itself).")
    if importlib.util.find_spec("torch_tensorrt") is None:
        raise ModuleNotFoundError(f"`{type(module).__name__}.to_tensorrt` requires `torch_tensorrt` to be installed. "
                                  f"Install it (pip install torch-tensorrt), then {how}")
    raise NotImplementedError(f"`{type(module).__name__}.to_tensorrt` is Lightning's: {how}")


def all_gather(module: TrainingModule, data: Any, group: Any, sync_grads: bool) -> Any:
    """``data`` (numbers, tensors, or dicts/lists/tuples of them) gathered from every process by the
    running strategy: each tensor gets a first dimension of the world size (none with one process)."""
    gather = module.trainer.strategy.all_gather if module.trainer is not None else (lambda tensor, **_: tensor)

    def apply(value: Any) -> Any:
        if isinstance(value, Mapping):
            return type(value)({key: apply(item) for key, item in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(apply(item) for item in value)
        if isinstance(value, (int, float, bool)) or isinstance(value, torch.Tensor):
            tensor = torch.as_tensor(value, device=module.device)
            return gather(tensor, group=group, sync_grads=sync_grads)
        return value

    return apply(data)
