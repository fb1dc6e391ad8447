"""Lightning's ``trainer.state`` (``lightning.pytorch.trainer.states``): which entry point runs (``fn``), which
loop (``stage``) and how the last one ended (``status``), read from the Trainer's own fields when asked."""

from __future__ import annotations

import dataclasses
from trainer.utilities import LightningEnum


class TrainerStatus(LightningEnum):
    INITIALIZING = "initializing"  # no stage has run yet
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # the last stage ended by an error or a signal

    @property
    def stopped(self) -> bool:
        return self in (self.FINISHED, self.INTERRUPTED)


class TrainerFn(LightningEnum):
    """The entry point called: ``fit``, ``validate``, ``test`` or ``predict``."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(LightningEnum):
    """The loop running now; ``validate`` also within ``fit``, ``sanity_check`` before fit trains."""

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
        return None if self == self.SANITY_CHECKING else "val" if self == self.VALIDATING else self.value


@dataclasses.dataclass
class TrainerState:
    """What ``trainer.state`` returns: a snapshot, as Lightning's fields read at that moment."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status == TrainerStatus.INTERRUPTED


def state_of(fn: str | None, running: bool, interrupted: bool, sanity_checking: bool, evaluating: str | None) -> TrainerState:
    """``trainer.state`` from the Trainer's fields: the last (or running) entry point ``fn``, whether a stage
    runs now, whether the last one was ``interrupted``, and the loop that runs (sanity check, an evaluation)."""
    if fn is None:
        return TrainerState()
    status = TrainerStatus.RUNNING if running else TrainerStatus.INTERRUPTED if interrupted else TrainerStatus.FINISHED
    stage = None
    if running:
        stage = (RunningStage.SANITY_CHECKING if sanity_checking else RunningStage(evaluating) if evaluating
                 else RunningStage.TRAINING if fn == "fit" else None)
    return TrainerState(status, TrainerFn(fn), stage)
