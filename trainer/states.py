"""Lightning's ``lightning.pytorch.trainer.states``: what the Trainer is doing, as ``trainer.state``.

``trainer.state.fn`` is the last stage called (``TrainerFn.FITTING`` for ``fit``), ``.stage`` what runs
now (``RunningStage.TRAINING``, ``.SANITY_CHECKING``, ``.VALIDATING`` within fit, ``.TESTING``, ...;
None between stages) and ``.status`` whether one runs, finished or was interrupted. Code that
tells the stages apart the Lightning way (``self.trainer.state.stage == RunningStage.VALIDATING``)
runs unchanged; ``trainer.training``/``validating``/``testing``/``predicting``/``sanity_checking``
say the same as booleans.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.utilities import LightningEnum


class TrainerStatus(LightningEnum):
    INITIALIZING = "initializing"  # no stage has started
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # the last stage ended by an error or a signal

    @property
    def stopped(self) -> bool:
        return self in (self.FINISHED, self.INTERRUPTED)


class TrainerFn(LightningEnum):
    """The Trainer method called: ``fit``, ``validate``, ``test`` or ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(LightningEnum):
    """What runs within the method: fit runs ``SANITY_CHECKING``, ``TRAINING`` and ``VALIDATING``."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (self.VALIDATING, self.TESTING, self.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        return "val" if self in (self.VALIDATING, self.SANITY_CHECKING) else self.value


@dataclass
class TrainerState:
    """``trainer.state``: a snapshot of the Trainer's status, method and running stage."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status.stopped
