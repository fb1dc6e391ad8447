"""LambdaCallback: a callback made of functions, one per hook (Lightning's).

``LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)``: each function given becomes
that hook of this callback and is called with the hook's arguments; the hooks not given stay the
base class's no-ops (so a per-batch hook nobody gave costs nothing).
"""

from __future__ import annotations

from typing import Any, Callable

from callbacks.console import MisconfigurationException
from callbacks.base import Callback

Hook = Callable[..., Any] | None

#: Lightning's LambdaCallback parameters, in its order.
HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_batch_start", "on_train_batch_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_test_epoch_start", "on_test_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end",
    "on_train_start", "on_train_end", "on_validation_start", "on_validation_end", "on_test_start", "on_test_end",
    "on_exception", "on_save_checkpoint", "on_load_checkpoint", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_predict_start", "on_predict_end",
    "on_predict_batch_start", "on_predict_batch_end", "on_predict_epoch_start", "on_predict_epoch_end",
)


class LambdaCallback(Callback):
    """A callback whose hooks are the functions given (each called with that hook's arguments).

    Example::

        LambdaCallback(on_train_epoch_end=lambda trainer, module: print(trainer.current_epoch))
    """

    def __init__(self, setup: Hook = None, teardown: Hook = None, on_fit_start: Hook = None, on_fit_end: Hook = None,
                 on_sanity_check_start: Hook = None, on_sanity_check_end: Hook = None,
                 on_train_batch_start: Hook = None, on_train_batch_end: Hook = None,
                 on_train_epoch_start: Hook = None, on_train_epoch_end: Hook = None,
                 on_validation_epoch_start: Hook = None, on_validation_epoch_end: Hook = None,
                 on_test_epoch_start: Hook = None, on_test_epoch_end: Hook = None,
                 on_validation_batch_start: Hook = None, on_validation_batch_end: Hook = None,
                 on_test_batch_start: Hook = None, on_test_batch_end: Hook = None, on_train_start: Hook = None,
                 on_train_end: Hook = None, on_validation_start: Hook = None, on_validation_end: Hook = None,
                 on_test_start: Hook = None, on_test_end: Hook = None, on_exception: Hook = None,
                 on_save_checkpoint: Hook = None, on_load_checkpoint: Hook = None, on_before_backward: Hook = None,
                 on_after_backward: Hook = None, on_before_optimizer_step: Hook = None,
                 on_before_zero_grad: Hook = None, on_predict_start: Hook = None, on_predict_end: Hook = None,
                 on_predict_batch_start: Hook = None, on_predict_batch_end: Hook = None,
                 on_predict_epoch_start: Hook = None, on_predict_epoch_end: Hook = None) -> None:
        given = {name: value for name, value in locals().items() if name in HOOKS and value is not None}
        for name, function in given.items():
            if not callable(function):
                raise MisconfigurationException(
                    f"LambdaCallback({name}={function!r}): use a function of the hook's arguments "
                    f"(trainer, module, ...), or None.")
            setattr(self, name, function)  # this instance's hook: the loop calls it with the hook's arguments
        self._given = sorted(given)

    @property
    def state_key(self) -> str:
        """Its hooks name it, so that two LambdaCallbacks with different hooks can sit side by side."""
        return f"LambdaCallback{self._given}"
