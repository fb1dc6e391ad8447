"""What the Tuner's two searches share: the model attribute they tune, their progress bar and
messages, and telling an out-of-memory error from the others.

A search reads and writes its hyperparameter (``lr``, ``batch_size``) where Lightning looks for it
(``lightning_hasattr`` and friends): an attribute of the model, a key of ``model.hparams``, an
attribute of the DataModule, a key of its ``hparams``. Reading takes the last of those that has
it, writing sets every one, as in Lightning.
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING, Any

import torch

from callbacks.console import info

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule


def _holders(model: TrainingModule, name: str, datamodule: Any = None) -> list[Any]:
    """The objects (or hparams dicts) holding ``name``, in Lightning's order; the DataModule is the
    Trainer's, unless ``datamodule`` is given (before a stage, the one it will get)."""
    holders: list[Any] = []
    if hasattr(model, name):
        holders.append(model)
    if name in getattr(model, "hparams", {}):
        holders.append(model.hparams)
    if datamodule is None:
        datamodule = getattr(getattr(model, "trainer", None), "datamodule", None)
    if datamodule is not None:
        if hasattr(datamodule, name):
            holders.append(datamodule)
        if name in getattr(datamodule, "hparams", {}):
            holders.append(datamodule.hparams)
    return holders


def has_attribute(model: TrainingModule, name: str, datamodule: Any = None) -> bool:
    """Whether the model, its hparams, the DataModule or its hparams hold ``name``."""
    return bool(_holders(model, name, datamodule))


def get_attribute(model: TrainingModule, name: str) -> Any:
    """``name``'s value from the last holder that has it (Lightning's ``lightning_getattr``)."""
    holders = _holders(model, name)
    if not holders:
        raise AttributeError(f"{name} is neither stored in the model namespace nor the `hparams` namespace/dict, "
                             "nor the datamodule.")
    holder = holders[-1]
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def set_attribute(model: TrainingModule, name: str, value: Any, datamodule: Any = None) -> None:
    """Set ``name`` to ``value`` in every holder (Lightning's ``lightning_setattr``)."""
    holders = _holders(model, name, datamodule)
    if not holders:
        raise AttributeError(f"{name} is neither stored in the model namespace nor the `hparams` namespace/dict, "
                             "nor the datamodule.")
    for holder in holders:
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def is_out_of_memory(error: BaseException) -> bool:
    """True for torch's OutOfMemoryError (CUDA, MPS) and the messages Lightning also reads as one
    (a cuDNN failure that means memory, the CPU allocator's)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError) or len(error.args) != 1 or not isinstance(error.args[0], str):
        return False
    message = error.args[0]
    return (("CUDA" in message and "out of memory" in message)
            or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED." in message
            or "DefaultCPUAllocator: can't allocate memory" in message)


def free_memory() -> None:
    """After an out-of-memory trial: collect what it left in reference cycles and give the device
    allocator's cached blocks back. A full collection takes up to a second in a large process, so
    on the CPU alone only the young generations are collected (the trial's objects are young)."""
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    on_mps = torch.backends.mps.is_available()
    gc.collect(2 if on_cuda or on_mps else 1)
    if on_cuda:
        torch.cuda.empty_cache()
    if on_mps:
        torch.mps.empty_cache()


class SearchProgress:
    """The progress of a search: a tqdm bar on rank zero when the Trainer shows its own bar in a
    terminal, and messages that go through the bar (so they do not garble it), or to stderr.

    Args:
        trainer: the running Trainer (its ``progress_bar_callback`` decides whether a bar is drawn).
        description: the bar's text.
        total: the number of steps the bar counts.
    """

    def __init__(self, trainer: Trainer, description: str, total: int) -> None:
        self.speaks = trainer.is_global_zero
        self._bar: Any = None
        bar_callback = trainer.progress_bar_callback
        if self.speaks and bar_callback is not None and getattr(bar_callback, "enabled", True) and sys.stderr.isatty():
            from tqdm.auto import tqdm  # loaded on first use: importing callbacks stays cheap

            self._bar = tqdm(total=total, desc=description, dynamic_ncols=True, file=sys.stderr)

    def update(self, count: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(count)

    def say(self, message: str) -> None:
        """Say ``message`` on rank zero: through the bar when one is drawn, else as :func:`callbacks.console.info`."""
        if not self.speaks:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            info(message, "cadence.tuner")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
