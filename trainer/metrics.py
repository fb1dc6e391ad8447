"""The metric store behind ``self.log``: values stay on the device until a log step.

Per step, ``log`` only keeps a reference (``on_step``) or adds in place on the device (``on_epoch``): no
``.item()``, no copy to the host. At a log step the values are stacked and copied to the host with ``non_blocking``;
the copy is read at the *next* log step (or stage end), long finished by then: the GPU never waits for the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trainer.host_copy import HostCopy, gather_alone
from trainer.stage_metrics import BAREBONES, NO_STAGE, REFUSED, MetricSpec, NoStage, PredictRefused, StageMetrics


def _key(spec: MetricSpec, fork: str) -> str:
    # Lightning's rule: a metric logged both per step and per epoch gets "_step"/"_epoch" keys,
    # before the loader's suffix ("loss_epoch/dataloader_idx_1").
    return f"{spec.base}_{fork}{spec.suffix}" if spec.on_step and spec.on_epoch else spec.base + spec.suffix


class MetricStore:
    """Owns the stages' metrics and their path to the host. ``self.log`` writes to ``current``
    (the training or the evaluation metrics, whichever stage runs). Between the phases where Lightning lets
    ``self.log`` record (from on_train_start to on_train_epoch_end; from on_validation_start to
    on_validation_epoch_end), ``current`` refuses it with Lightning's error (its table of hooks), as it does in
    the hooks called within them that Lightning refuses (:func:`trainer.stage_metrics.refusing`).

    Args:
        reduce: ``strategy.all_reduce``; called at read time for ``sync_dist`` metrics.
        gather: ``strategy.all_gather_object``; checks that every rank logged the same
            ``sync_dist`` keys before they are reduced.
    """

    def __init__(self, reduce: Any, gather: Any = None, barebones: bool = False) -> None:
        self.reduce = reduce
        self.barebones = barebones  # Trainer(barebones=True): self.log records nothing, with Lightning's warning
        self.gather = gather if gather is not None else gather_alone
        self.train = StageMetrics(default_on_step=True)
        self.evaluation = StageMetrics(default_on_step=False)
        self.has_loggers = True  # the running stage has loggers (start_stage)
        self.refused: NoStage = REFUSED if not barebones else BAREBONES  # predict: PredictRefused (start_stage)
        self.current = self.refused
        self._ended: NoStage | StageMetrics = self.refused  # the stage whose phase ended last (on_log_calls)
        self._pending: tuple[int, dict[str, MetricSpec], torch.Tensor, Any, dict[str, float]] | None = None
        self._evaluation_steps: list[tuple[int, int, dict[str, tuple[Any, MetricSpec]]]] = []  # (loader, batch_idx, values)
        # Per (stage, loader): the step axis of its on_step values, as Lightning counts a loop's batches per
        # loader from when its loaders were made (restart_evaluation_steps).
        self.evaluation_batches: dict[tuple[str, int], int] = {}
        self._evaluation_batches_run: dict[int, int] = {}  # per loader: the batches this evaluation ran
        # Where published values land (Lightning's trainer.callback_metrics, .progress_bar_metrics, .logged_metrics).
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        #: The epoch values read since the epoch's batches ended: the loggers get them in one record after the hooks.
        self._epoch_end: tuple[dict[str, float], dict[str, MetricSpec]] = ({}, {})

    def start_evaluation(self) -> None:
        self.evaluation = StageMetrics(default_on_step=False, has_loggers=self.has_loggers)
        self.current = self.evaluation if self.refused is REFUSED else self.refused  # predict: refused

    def start_training(self) -> None:
        self.current = self.train if not self.barebones else BAREBONES

    def start_train_epoch(self) -> None:
        """As in Lightning, each training log step gives the loggers the latest value of every step
        metric logged in the epoch so far, also those not logged since the last log step."""
        self.train.step_values = {}
        self.start_training()

    def start_stage(self, stage: str, has_loggers: bool = True) -> None:
        """A stage begins: fresh training metrics, so that a second ``fit`` registers its names (and
        metric objects) anew, and, as in Lightning, no published value of an earlier stage (after
        ``test``, ``callback_metrics`` holds the test's values only)."""
        self.has_loggers = has_loggers
        self.train = StageMetrics(default_on_step=True, has_loggers=has_loggers)
        self.refuse_for(stage)
        self.current = self._ended = self.refused  # setup, on_fit_start ...: Lightning refuses self.log there
        self._pending = None
        self.clear_published()

    def refuse_for(self, stage: str) -> None:
        """What ``self.log`` meets where Lightning refuses it in ``stage`` (in predict: everywhere)."""
        self.refused = BAREBONES if self.barebones else PredictRefused() if stage == "predict" else REFUSED

    def clear_published(self) -> None:
        """Forget every published value (a stage starts; the sanity check ends, as in Lightning)."""
        self.callback_metrics, self.progress_bar_metrics, self.logged_metrics = {}, {}, {}
        self._epoch_end = ({}, {})

    def end_sanity_check(self) -> None:
        """The sanity check is over: forget its values (``self.log`` records training's from on_train_start)."""
        self.clear_published()
        self.current = self.refused

    def stop(self) -> None:
        """No stage runs: ``self.log`` (a unit test calling ``training_step`` after fit) records nothing."""
        self.current = NO_STAGE

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """``self.log`` records nothing meanwhile: steps a callback runs outside the loop (SWA's BatchNorm pass
        after training, where Lightning runs an extra epoch) neither raise nor add to the run's values."""
        current, self.current = self.current, NO_STAGE
        try:
            yield
        finally:
            self.current = current

    def end_phase(self) -> None:
        """A phase where Lightning lets ``self.log`` record ends: it is refused until the next one starts."""
        if self.current is not self.refused:
            self._ended = self.current
        self.current = self.refused

    def on_log_calls(self, published: list[tuple[int, dict]], callbacks: list[Any]) -> Any:
        """``(step, values, callback)`` for each ``on_log`` call of ``published``. ``on_log`` is Cadence's (Lightning's
        table has no row for it): ``self.log`` there records where it did in the phase that published them."""
        if not published:
            return
        current = self.current
        if current is self.refused:
            self.current = self._ended
        try:
            for step, logged in published:
                for callback in callbacks:
                    yield step, logged, callback
        finally:
            self.current = current

    def refusal(self, hook: str) -> NoStage:
        """What ``self.log`` meets in ``hook``, one where Lightning refuses it (barebones: its warning only)."""
        return self.refused if self.refused is BAREBONES else type(self.refused)(hook)

    # --- publishing: each returns [(step, values for the loggers)], which the Trainer hands to on_log
    def publish(self, step: int, values: dict[str, float], specs: dict[str, MetricSpec], loggers: bool = True,
                callback: bool = True) -> list[tuple[int, dict]]:
        """``values`` reach ``progress_bar_metrics``, ``logged_metrics``, with ``callback`` (not an
        evaluation's step values) ``callback_metrics`` (a ``name_step``/``name_epoch`` value also as
        ``name``, as in Lightning), and with ``loggers`` the loggers."""
        if not values:
            return []
        logged = {}
        for key, value in values.items():
            spec = specs[key]  # one tensor in both dicts, as Lightning's; float64 under 64-true
            tensor = torch.tensor(value, dtype=torch.float64 if spec.float64 else None)
            if callback:  # as Lightning's: the bare name first, then "name_step" (its callback_metrics' order)
                if spec.on_step and spec.on_epoch:
                    self.callback_metrics[spec.base + spec.suffix] = tensor
                self.callback_metrics[key] = tensor
            if spec.prog_bar:
                self.progress_bar_metrics[key] = value
            if spec.logger:
                logged[key] = value
                self.logged_metrics[key] = tensor
        return [(step, logged)] if loggers and logged else []

    def publish_pending(self) -> list[tuple[int, dict]]:
        """The copy the last log step started, if any: it has arrived, reading it does not wait.
        Whatever publishes publishes it first, so that the loggers see the values in step order."""
        pending = self.receive()
        return self.publish(*pending) if pending is not None else []

    def before_validation(self, step: int) -> list[tuple[int, dict]]:
        """Validation in fit is about to run: the pending copy for the loggers, and, as Lightning's monitors
        see them, the step values logged since the last log step in ``callback_metrics`` and the bar (kept
        for the loggers' next log step: they get step values at log steps only, as in Lightning)."""
        published = self.publish_pending()
        self.peek_step_values(step)
        self.end_phase()  # on_validation_model_zero_grad, _eval: no self.log, as in Lightning
        return published

    def fresh_metrics(self) -> dict[str, torch.Tensor]:
        """``callback_metrics`` with this batch's step values in it (a step-interval ReduceLROnPlateau reads it)."""
        self.peek_step_values(-1)
        return self.callback_metrics

    def peek_step_values(self, step: int) -> None:
        """The step values logged since the last log step into ``callback_metrics`` and the bar now (one host
        copy), kept for the loggers' next log step: what a validation or a step-triggered checkpoint reads."""
        kept = dict(self.train.step_values)
        latest, self.train.step_values = self.train.take_step_values(), kept
        if latest:
            copy = HostCopy(step, {_key(spec, "step"): (value, spec) for value, spec in latest.values()}, self.reduce, self.gather)
            self.publish(copy.step, copy.values(), copy.specs, loggers=False)

    def log_step(self, step: int) -> list[tuple[int, dict]]:
        """At a log step: start this step's copy to the host; publish the one of the last log step."""
        pending = self.receive()
        self.send_step_values(step)
        return self.publish(*pending) if pending is not None else []

    def flush(self, step: int) -> list[tuple[int, dict]]:
        """The pending copy, then what was logged since (now: one host sync): a preemption stop."""
        published = self.publish_pending()
        self.send_step_values(step)
        self.end_phase()  # the training stops here: on_train_end refuses self.log
        return published + self.publish(*self.receive())

    def end_train_batches(self, step: int) -> list[tuple[int, dict]]:
        """The epoch's batches are done: the last log step's values for the loggers; the values logged
        since, and the epoch's so far, for ``callback_metrics``, the bar and ``logged_metrics`` only
        (Lightning writes step values at log steps only, and the epoch's after the epoch-end hooks)."""
        published = self.publish_pending()
        self.send_step_values(step)
        self.publish(*self.receive(), loggers=False)
        self.read_epoch_end(self.train)
        return published

    def read_epoch_end(self, stage_metrics: StageMetrics, final: bool = False) -> tuple[dict[str, float], dict[str, MetricSpec]]:
        """In the epoch end: the epoch values logged since the last read, reduced now (one host copy),
        into ``callback_metrics`` for the hooks that read it there (Lightning computes them when read).
        Returns every epoch value read since the epoch's batches ended; the ``final`` read, after the
        hooks, resets the metric objects and starts over."""
        stage_metrics.batch = None  # what the hooks log weighs 1, as in Lightning
        values, specs = self.read_epoch_values(stage_metrics, final)
        self.publish(-1, values, specs, loggers=False)
        held_values, held_specs = self._epoch_end
        held_values.update(values)
        held_specs.update(specs)
        if final:
            self._epoch_end = ({}, {})
        return held_values, held_specs

    def end_train_epoch(self, step: int) -> list[tuple[int, dict]]:
        """After the epoch-end hooks: the epoch's values, the hooks' included, in one record at ``step``. Until the
        next epoch starts (on_train_end, the loaders' reload), ``self.log`` is refused."""
        self.end_phase()
        return self.publish(step, *self.read_epoch_end(self.train, final=True))

    def end_evaluation(self, stage: str, step: int, publish: bool
                       ) -> tuple[list[tuple[int, dict]], dict[str, float], dict[str, MetricSpec]]:
        """After the evaluation's epoch-end hooks: publish its ``on_step`` values, then its epoch values
        (at ``step``); returns those, the epoch values and their specs. Without ``publish`` (sanity) the
        loggers get nothing."""
        # As Lightning's, each step row names its step: the loggers take it as the step and add no "epoch" (logger_metrics).
        published = [(step, {**logged, "step": step}) for received in self.read_evaluation_step_values(stage, publish)
                     for step, logged in self.publish(*received, callback=False)]
        values, specs = self.read_epoch_end(self.evaluation, final=True)
        self.end_phase()  # on_validation_end, on_validation_model_train: no self.log, as in Lightning
        return (published + self.publish(step, values, specs) if publish else []), values, specs

    # --- the path to the host ------------------------------------------------------------
    def send_step_values(self, step: int) -> None:
        """At a log step: start a non-blocking copy of this step's values to the host."""
        values = self.train.take_step_values(keep=True)  # forgotten when the next epoch starts
        self._pending = HostCopy(step, {_key(s, "step"): (v, s) for n, (v, s) in values.items()}, self.reduce, self.gather)

    def receive(self) -> tuple[int, dict[str, float], dict[str, MetricSpec]] | None:
        """``(step, values, specs)`` of the last ``send_step_values``, or None if nothing is pending."""
        pending, self._pending = self._pending, None
        return None if pending is None else (pending.step, pending.values(), pending.specs)

    def keep_evaluation_step_values(self, batch_idx: int) -> None:
        """After an evaluation batch: keep what it logged ``on_step`` (on the device) for the end."""
        values = self.evaluation.take_step_values(keep=True)  # as Lightning: each step row repeats earlier batches' names
        loader = self.evaluation.dataloader_idx or 0
        if values:
            self._evaluation_steps.append((loader, batch_idx, values))
        self._evaluation_batches_run[loader] = batch_idx + 1

    def restart_evaluation_steps(self, stage: str) -> None:
        """``stage``'s loaders were made (validate, test, predict: each call; fit's validation: at fit's
        start and when reloaded): its step rows count from 0 again, as Lightning's loops count them."""
        self.evaluation_batches = {key: count for key, count in self.evaluation_batches.items() if key[0] != stage}

    def read_evaluation_step_values(self, stage: str, publish: bool) -> list[tuple[int, dict[str, float], dict[str, MetricSpec]]]:
        """At the end of an evaluation: ``[(step, values, specs)]`` of its ``on_step`` values, one
        host copy for all of them: a row per loader and batch, in that order. As in Lightning, the step
        counts each loader's batches since its loaders were made (sanity checks excluded:
        ``publish=False`` reads and drops them)."""
        kept, self._evaluation_steps = self._evaluation_steps, []
        run, self._evaluation_batches_run = self._evaluation_batches_run, {}
        first = {loader: self.evaluation_batches.get((stage, loader), 0) for loader in run}
        named = {(loader, first[loader] + batch_idx, _key(spec, "step")): (value, spec)
                 for loader, batch_idx, values in kept for name, (value, spec) in values.items()}
        copy = HostCopy(-1, named, self.reduce, self.gather)  # every rank, even with nothing kept: the sync check pairs up
        if not publish:
            return []
        for loader, num_batches in run.items():
            self.evaluation_batches[stage, loader] = first[loader] + num_batches
        rows: dict[tuple[int, int], tuple[dict[str, float], dict[str, MetricSpec]]] = {}
        for (loader, step, key), value in copy.values().items():
            values, specs = rows.setdefault((loader, step), ({}, {}))
            values[key], specs[key] = value, copy.specs[loader, step, key]
        return [(step, values, specs) for (_, step), (values, specs) in sorted(rows.items())]

    def read_epoch_values(self, stage_metrics: StageMetrics, final: bool = True) -> tuple[dict[str, float], dict[str, MetricSpec]]:
        """At the end of an epoch or evaluation: the reduced epoch values on the host, now."""
        values = stage_metrics.take_epoch_values(final)
        copy = HostCopy(-1, {_key(s, "epoch"): (v, s) for n, (v, s) in values.items()}, self.reduce, self.gather)
        return copy.values(), copy.specs
