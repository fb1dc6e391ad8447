"""Mixed precision: autocast around forward and loss; for float16, loss scaling with a GradScaler.

``AMP("bf16")`` runs each ``training_step`` (and the evaluation steps) under ``torch.autocast``
for the strategy's device: matrix products in bfloat16, the parameters (the "master weights")
and the optimizer state in float32. bfloat16 has float32's range, so it needs nothing else.

``AMP("fp16")`` adds a ``torch.amp.GradScaler``: the loss is multiplied by a large scale before
backward, so small float16 gradients do not flush to zero. Per optimizer step:

    backward(scale * loss)            every micro-batch; DDP all-reduces the scaled gradients
    unscale_(optimizer)               once, before on_before_optimizer_step and clipping
    scaler.step(optimizer)            skips the step when a gradient is inf/NaN (then the scale halves)
    scaler.update()                   once per round of steps, before the next scaled backward

A step the scaler skipped leaves weights, optimizer state and LR schedulers as they were, counts
in ``global_step`` (as in Lightning) and is not an ``on_nonfinite_loss`` skip. The scaler's state
is saved in checkpoints (this callback's ``state_dict``), so a resumed run continues with the
same scale. ``GradScaler.step`` reads one value per step from the device (whether a gradient
overflowed); with a fused optimizer (``torch.optim.AdamW(..., fused=True)``) it reads nothing,
the skip happens on the device, and the LR scheduler then steps even on a skipped step.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from callbacks.console import MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "auto": "auto",
           torch.bfloat16: "bfloat16", torch.float16: "float16"}


class AMP(Callback):
    """Automatic mixed precision for training and evaluation; ``Trainer(precision="bf16-mixed")``
    and ``"16-mixed"`` add this callback.

    Args:
        dtype: ``"bfloat16"`` (``"bf16"``), ``"float16"`` (``"fp16"``, with loss scaling), or
            ``"auto"``: bfloat16 where the device runs it natively, else float16 (GPUs before
            Ampere, which only emulate bfloat16); the choice is printed on rank zero when the run starts.
        init_scale, growth_factor, backoff_factor, growth_interval: float16's ``GradScaler``
            settings (PyTorch's defaults when None).
        cpu_dtype: the dtype to use instead when the device is the CPU, with a warning.
            ``Trainer(precision="16-mixed")`` passes ``"bfloat16"``: Lightning switches to
            bf16-mixed on the CPU, and a Lightning script must mean the same here.

    In manual optimization, ``self.manual_backward(loss)`` scales the loss and the optimizers from
    ``self.optimizers()`` step through the scaler; ``self.clip_gradients(opt, ...)`` unscales first.
    With several optimizers the scale is updated once per round of steps (before the next
    backward), so every optimizer unscales with the scale its gradients were made with.

    Example::

        Trainer(callbacks=[AMP("bf16")])        # or Trainer(precision="bf16-mixed")
    """

    def __init__(self, dtype: str | torch.dtype = "bfloat16", *, init_scale: float | None = None,
                 growth_factor: float | None = None, backoff_factor: float | None = None,
                 growth_interval: int | None = None, cpu_dtype: str | torch.dtype | None = None) -> None:
        for name, value in (("dtype", dtype), ("cpu_dtype", cpu_dtype)):
            if value is not None and (not isinstance(value, (str, torch.dtype)) or value not in _DTYPES):
                raise MisconfigurationException(
                    f"AMP({name}={value!r}): use 'bfloat16' ('bf16'), 'float16' ('fp16') or 'auto'.")
        self.requested = _DTYPES[dtype]
        self.cpu_dtype = None if cpu_dtype is None else _DTYPES[cpu_dtype]
        options = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
                   "growth_interval": growth_interval}
        self.scaler_options = {name: value for name, value in options.items() if value is not None}
        if self.scaler_options and self.requested == "bfloat16":
            raise MisconfigurationException(
                f"AMP('bfloat16') got {sorted(self.scaler_options)}: those set float16's loss "
                "scaling, which bfloat16 does not need. Drop them, or use AMP('float16').")
        self.dtype: torch.dtype | None = None  # decided at setup ("auto" needs the device)
        self.device_type = "cpu"
        self.scaler: torch.amp.GradScaler | None = None
        self._loaded_state: dict[str, Any] | None = None  # scaler state that arrived before the scaler
        self._stepped: set[torch.optim.Optimizer] = set()  # stepped since the last scaler.update()
        self._unscaled: set[torch.optim.Optimizer] = set()  # unscaled since their last step
        self._step_ran = False
        self._step_hooks: dict[torch.optim.Optimizer, Any] = {}

    def __repr__(self) -> str:
        return f"AMP({self.requested!r}{f', cpu_dtype={self.cpu_dtype!r}' if self.cpu_dtype else ''})"

    # --- setup ---------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        device = trainer.strategy.device
        if not torch.amp.is_autocast_available(device.type):
            raise MisconfigurationException(
                f"AMP: torch.autocast does not support the device type {device.type!r} "
                "(this strategy's device). Remove AMP or train on cpu, cuda or mps.")
        self.device_type = device.type
        requested = self.requested
        if self.cpu_dtype is not None and device.type == "cpu" and self.cpu_dtype != requested:
            requested = self.cpu_dtype
            if trainer.is_global_zero:
                warn(f"{self!r} runs {requested} on the CPU; Trainer(precision='16-mixed') asks for this, as "
                     "Lightning switches to bf16-mixed there. Pass callbacks=[AMP('fp16')] for float16 on the CPU.")
        self.dtype = _resolve(requested, device)
        if self.requested == "auto" and trainer.is_global_zero:
            how = "no loss scaling needed" if self.dtype == torch.bfloat16 else "with loss scaling: no bfloat16 here"
            if self.dtype == torch.float16 and device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(device)
                how = (f"with loss scaling: compute capability {major}.{minor} only emulates bfloat16, without "
                       "tensor-core speed")
            print(f"AMP('auto'): {str(self.dtype).removeprefix('torch.')} autocast on {device} ({how}).",
                  file=sys.stderr)
        scaled = self.dtype == torch.float16
        self.owns_backward = self.owns_optimizer_step = scaled
        if scaled and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type, **self.scaler_options)
        if self.scaler is not None and self._loaded_state is not None:
            self.scaler.load_state_dict(self._loaded_state)
            self._loaded_state = None

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self._stepped:
            self._update()
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks = {}
        self._unscaled = set()

    # --- the seams -----------------------------------------------------------------------
    def forward_context(self) -> torch.autocast:
        # A new context each time: an autocast object keeps the state it restores on itself.
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, trainer: Trainer, module: TrainingModule, loss: torch.Tensor) -> None:
        if self._stepped:  # the last round of steps is over: update the scale before using it
            self._update()
        trainer.strategy.backward(self.scaler.scale(loss), module.backward)  # the module's override sees the scaled loss

    def unscale_gradients(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None or optimizer in self._unscaled:
            return
        if optimizer in self._stepped:  # a second step of this optimizer since the update
            self._update()
        self.scaler.unscale_(optimizer)
        self._unscaled.add(optimizer)

    def optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: torch.optim.Optimizer) -> bool:
        if optimizer in self._stepped:
            self._update()
        if optimizer not in self._step_hooks:  # tells whether GradScaler.step ran the step
            self._step_hooks[optimizer] = optimizer.register_step_pre_hook(self._record_step)
        self._step_ran = False
        self.scaler.step(optimizer)  # unscales first unless unscale_gradients did
        self._stepped.add(optimizer)
        self._unscaled.discard(optimizer)
        return self._step_ran

    def _record_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_ran = True

    def _update(self) -> None:
        self.scaler.update()
        self._stepped = set()
        self._unscaled = set()

    def performance_facts(self) -> dict[str, Any]:
        return {"autocast": self.dtype} if self.dtype is not None else {}

    # --- checkpoint state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {"scaler": self._loaded_state} if self._loaded_state else {}
        if self._stepped:  # the update the next backward would make, made now: same numbers
            self._update()
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("scaler")
        if not state:
            return
        if self.scaler is None:  # before setup (a spawned run's handoff): apply when it is built
            self._loaded_state = state
        else:
            self.scaler.load_state_dict(state)


def _resolve(requested: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for ``requested`` on ``device``; "auto" prefers bfloat16."""
    if requested == "bfloat16":
        return torch.bfloat16
    if requested == "float16":
        return torch.float16
    if device.type == "cuda":
        # torch.cuda.is_bf16_supported() counts bfloat16 that is only emulated (V100, T4: compute
        # capability 7.x) unless including_emulation=False; it also asks the current device, this
        # asks the run's. Ampere (8.0) and later have bfloat16 tensor cores; ROCm GPUs run it natively.
        native = torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)
        return torch.bfloat16 if native else torch.float16
    if device.type == "mps":
        return torch.float16  # bfloat16 on Apple GPUs needs macOS 14; float16 works everywhere
    return torch.bfloat16
