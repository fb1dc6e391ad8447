"""Replacing a submodule's ``forward`` in place, reversibly, so that its state_dict keeps its keys.

Activation checkpointing and compilation change what a block's forward does. Wrapping the block
in another module would prefix every state_dict key (``torch.compile(model)`` adds ``_orig_mod.``,
``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.``) and break loading checkpoints into
the plain model. Instead, :func:`wrap_forward` sets the block's ``forward`` attribute to a
:class:`BoundForward` around a function of ``(module, *args, **kwargs)``; wrappers stack (checkpoint
inside, compile outside) and :func:`restore_forward` puts the block's own forward back.

The functions take the module as an argument instead of closing over it, so ``copy.deepcopy`` of
the model gives a copy whose forward runs the copy's weights, not the original's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

#: Where a wrapped module remembers its own ``forward`` attribute (None: it had none, the class's runs).
_ORIGINAL = "_cadence_original_forward"

ForwardFunction = Callable[..., Any]  # (module, *args, **kwargs) -> output


class BoundForward:
    """A module's replaced ``forward``: calls ``function(module, *args, **kwargs)``."""

    def __init__(self, module: nn.Module, function: ForwardFunction) -> None:
        self.module = module
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__} through {getattr(self.function, '__qualname__', self.function)}>"


def forward_function(module: nn.Module) -> ForwardFunction:
    """What ``module``'s forward runs now, as a function of ``(module, *args, **kwargs)``."""
    installed = module.__dict__.get("forward")
    if installed is None:
        return type(module).forward
    if isinstance(installed, BoundForward) and installed.module is module:
        return installed.function
    return lambda _module, *args, **kwargs: installed(*args, **kwargs)  # the user's own instance forward


def wrap_forward(module: nn.Module, wrap: Callable[[ForwardFunction], ForwardFunction]) -> None:
    """Make ``module``'s forward ``wrap(what it runs now)``, in place."""
    if _ORIGINAL not in module.__dict__:
        module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
    module.__dict__["forward"] = BoundForward(module, wrap(forward_function(module)))


def restore_forward(module: nn.Module) -> None:
    """Undo every :func:`wrap_forward` on ``module`` (a no-op if there is none)."""
    if _ORIGINAL not in module.__dict__:
        return
    original = module.__dict__.pop(_ORIGINAL)
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = original
