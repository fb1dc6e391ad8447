"""How logged values reach the user: ``trainer.callback_metrics``, the progress bar and the
loggers (each callback's ``on_log``).

``self.log`` keeps values on the device; at a log step the Trainer starts a non-blocking copy of
them to the host (``MetricStore.send_step_values``) and publishes the copy started one log step
earlier, which has arrived by then, so reading it does not wait. Whatever else publishes (an
epoch end, validation, a preemption stop) first publishes that pending copy, so the loggers see
the values in step order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.metrics import MetricSpec
    from trainer.trainer import Trainer


def publish(trainer: Trainer, values: dict[str, float], specs: dict[str, MetricSpec], step: int) -> None:
    """Host values reach callback_metrics, the progress bar and the loggers (on_log)."""
    if not values:
        return
    for key, value in values.items():
        trainer.callback_metrics[key] = torch.tensor(value)
        if specs[key].prog_bar:
            trainer.progress_bar_metrics[key] = value
    logged = {key: value for key, value in values.items() if specs[key].logger}  # self.log(logger=False): not these
    trainer.logged_metrics.update(logged)
    if not trainer.sanity_checking:
        for callback in trainer.callbacks:
            callback.on_log(trainer, trainer.module, logged, step)


def publish_received(trainer: Trainer) -> None:
    """Publish the copy the last log step started, if any (it has arrived: no wait)."""
    received = trainer.metrics.receive()
    if received is not None:
        step, values, specs = received
        publish(trainer, values, specs, step)


def flush_step_values(trainer: Trainer) -> tuple[int, dict[str, float], dict[str, Any]]:
    """Publish the pending copy, then copy what was logged since and return it as ``(step,
    values, specs)``: one host sync, for the end of an epoch or a preemption stop."""
    publish_received(trainer)
    trainer.metrics.send_step_values(trainer.global_step)
    return trainer.metrics.receive()


def publish_train_epoch(trainer: Trainer) -> None:
    """At the end of a training epoch: the epoch's last step values with its epoch aggregates."""
    _, step_values, step_specs = flush_step_values(trainer)
    values, specs = trainer.metrics.read_epoch_values(trainer.metrics.train)
    values.update(step_values)
    specs.update(step_specs)
    publish(trainer, values, specs, trainer.global_step)
