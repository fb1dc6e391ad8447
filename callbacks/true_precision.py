"""One floating dtype throughout: Lightning's ``"64-true"``, ``"bf16-true"`` and ``"16-true"``.

``TruePrecision("bf16")`` keeps the weights themselves in bfloat16 (not float32 master weights as
``AMP`` does): the module is converted once, after its ``configure_model`` and before
``configure_optimizers``, so the optimizer holds (and keeps its state in) the converted parameters.
As Lightning's ``DoublePrecision`` and ``HalfPrecision`` plugins do, it also

- runs the module's ``configure_model`` with ``torch.get_default_dtype()`` set to the dtype, so
  layers built there are made (and initialized) in it;
- sets the default dtype while ``training_step``, ``validation_step``, ``test_step`` and
  ``predict_step`` run (``torch.zeros(3)`` made there has the dtype), and restores it after, also
  when the step raises;
- converts the floating-point tensors of each batch to the dtype before the batch transfer hooks
  and the move to the device (integer labels and masks stay as they are).

Composition: gradients have the parameters' dtype, so accumulation and clipping work in it; under
DDP the gradients are all-reduced in it. The loss is not scaled: float16 weights (``"16-true"``)
can underflow small gradients, as in Lightning, where ``"16-true"`` is meant for inference.
A checkpoint holds tensors of the dtype; loading one into a float32 module (``load_from_checkpoint``)
casts them to float32, as in Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from callbacks.console import MisconfigurationException
from callbacks.base import Callback
from strategies.transfer import apply_to_tensors

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

_DTYPES: dict[Any, torch.dtype] = {
    "float64": torch.float64, "64": torch.float64, 64: torch.float64, "64-true": torch.float64, "double": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "16": torch.float16, 16: torch.float16, "16-true": torch.float16,
    torch.float64: torch.float64, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
}
#: Lightning's name of each precision (``trainer.precision``).
PRECISION_NAMES = {torch.float64: "64-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}


class DefaultDtype:
    """``torch.set_default_dtype(dtype)`` inside, the previous default restored on the way out
    (Lightning's ``_DtypeContextManager``). A new one per use: it keeps the dtype it restores."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.previous = torch.get_default_dtype()

    def __enter__(self) -> None:
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc_info: Any) -> None:
        torch.set_default_dtype(self.previous)


class TruePrecision(Callback):
    """Train, evaluate and predict with the weights, inputs and computations in one dtype;
    ``Trainer(precision="64-true" | "bf16-true" | "16-true")`` adds this callback.

    Args:
        dtype: ``"float64"`` (``"64"``, ``torch.float64``), ``"bfloat16"`` (``"bf16"``) or
            ``"float16"`` (``"fp16"``).

    Example::

        Trainer(callbacks=[TruePrecision("float64")])     # or Trainer(precision="64-true")
    """

    def __init__(self, dtype: str | int | torch.dtype = "bfloat16") -> None:
        if isinstance(dtype, bool) or not isinstance(dtype, (str, int, torch.dtype)) or dtype not in _DTYPES:
            raise MisconfigurationException(
                f"TruePrecision(dtype={dtype!r}): use 'float64' ('64'), 'bfloat16' ('bf16') or "
                "'float16' ('fp16').")
        self.dtype = _DTYPES[dtype]
        #: Lightning's precision string, which ``trainer.precision`` answers.
        self.precision = PRECISION_NAMES[self.dtype]

    def __repr__(self) -> str:
        return f"TruePrecision({str(self.dtype).removeprefix('torch.')!r})"

    def check_device(self, device: torch.device) -> None:
        """Raise if ``device`` cannot hold this dtype (Apple GPUs have no float64)."""
        if device.type == "mps" and self.dtype == torch.float64:
            raise MisconfigurationException(
                f"{self.precision!r} precision ({self!r}) needs float64, which Apple GPUs (mps) do not "
                "have. Train in float64 on the CPU (strategy='cpu'), or use precision='32-true' on mps.")

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self.check_device(trainer.strategy.device)

    # --- the seams -----------------------------------------------------------------------
    def module_init_context(self) -> DefaultDtype:
        return DefaultDtype(self.dtype)

    def configure_model(self, model: nn.Module) -> nn.Module:
        # In place, the floating parameters and buffers only (model.to(dtype) would cast complex ones to
        # real): Lightning's DoublePrecision calls model.double().
        convert = {torch.float64: model.double, torch.bfloat16: model.bfloat16, torch.float16: model.half}[self.dtype]
        return convert()

    def forward_context(self) -> DefaultDtype:
        return DefaultDtype(self.dtype)

    def convert_input(self, batch: Any) -> Any:
        dtype = self.dtype
        return apply_to_tensors(batch, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)
