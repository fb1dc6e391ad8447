"""Lightning callbacks, loggers and profilers that Cadence does not offer, each with the Cadence way.

Importing one works (``from callbacks import DeviceStatsMonitor``), so a script's imports do not
fail on a line that says nothing; making one raises an error that says what to use instead.
"""

from __future__ import annotations

from typing import Any

from callbacks.base import Callback

_SERVICES = ("Cadence depends on no tracking service: write a callbacks.Logger that sends on_log's values to it "
             "(TensorBoardLogger and CSVLogger are built in)")


class Refused(Callback):
    """A Lightning name Cadence does not offer: making one raises, with ``way``, the Cadence way."""

    way = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is Lightning's; Cadence does not have it. Instead: {self.way}.")


class SpikeDetection(Refused):
    way = ("Trainer(on_nonfinite_loss=\"raise\" | \"skip\") for NaN/inf losses, and "
           "EarlyStopping(monitor, divergence_threshold=...) to stop a run whose loss diverges")


class WandbLogger(Refused):
    way = _SERVICES


class MLFlowLogger(Refused):
    way = _SERVICES


class CometLogger(Refused):
    way = _SERVICES


class NeptuneLogger(Refused):
    way = _SERVICES


class LitLogger(Refused):
    way = _SERVICES


class XLAProfiler(Refused):
    way = "Cadence runs on CPUs, CUDA GPUs and Apple GPUs, not XLA; use SimpleProfiler or PyTorchProfiler"


_SERVE = ("Cadence starts no model server (fastapi and uvicorn are not dependencies): export the trained module "
          "(module.to_onnx(...), torch.export) and serve that, and check its answers with trainer.predict")


class ServableModuleValidator(Refused):
    """Lightning's ``lightning.pytorch.serve.ServableModuleValidator``."""

    way = _SERVE


class ServableModule:
    """Lightning's ``lightning.pytorch.serve.ServableModule``, a base class: a class deriving from it is refused
    when it is defined (a mixin's ``__init__`` is not reached through the module's)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{cls.__name__} derives from ServableModule, which is Lightning's; Cadence does not have it. Instead: {_SERVE}.")
