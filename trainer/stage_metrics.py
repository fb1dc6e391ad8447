"""What ``self.log`` records in one stage (training, or the running evaluation) between two reads.

Per step, ``log`` only keeps a reference (``on_step``) or adds in place on the device (``on_epoch``):
no ``.item()``, no copy to the host; the store (``trainer/metrics.py``) reads them at log steps and
epoch ends. How a name is logged (:class:`MetricSpec`) is fixed by its first call in a stage.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from callbacks.console import MisconfigurationException, warn
from trainer.utilities import extract_batch_size

REDUCE_FX = ("mean", "sum", "max", "min")
#: Lightning's callables for ``reduce_fx``, by the name Cadence uses.
REDUCE_CALLABLES = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min", sum: "sum", max: "max", min: "min"}

#: Lightning's table (fx_validator.py) of the hooks ``self.log`` may run in; outside batches (the epoch-level hooks,
#: on_train_start, on_validation_start, on_test_start) only with on_step=False, on_epoch=True.
LOGGING_HOOKS = frozenset({
    "training_step", "validation_step", "test_step", "on_before_backward", "backward", "on_after_backward",
    "on_before_optimizer_step", "optimizer_step", "configure_gradient_clipping", "clip_gradients",
    "on_before_zero_grad", "optimizer_zero_grad", "on_train_start", "on_validation_start", "on_test_start",
    *(f"on_{stage}_{when}" for stage in ("train", "validation", "test") for when in
      ("epoch_start", "epoch_end", "batch_start", "batch_end"))})
#: The hooks where Lightning refuses ``self.log`` (its table's None rows).
REFUSED_HOOKS = frozenset({
    "setup", "teardown", "prepare_data", "configure_model", "configure_sharded_model", "configure_optimizers",
    "configure_callbacks", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end", "on_train_end",
    "on_validation_end", "on_test_end", "on_exception", "state_dict", "load_state_dict", "on_save_checkpoint",
    "on_load_checkpoint", "lr_scheduler_step", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "on_validation_model_zero_grad", "on_validation_model_eval",
    "on_validation_model_train", "on_test_model_eval", "on_test_model_train", "predict_step",
    "on_predict_model_eval", *(f"on_predict_{when}" for when in
                               ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end"))})
_HOOK_NAMES = LOGGING_HOOKS | REFUSED_HOOKS


def running_hook() -> str:
    """The innermost hook on the call stack (by its name, as Lightning's table lists them), for a message or the
    "twice in one hook" check: walked only where a name is first logged or a call is refused."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _HOOK_NAMES:
            return frame.f_code.co_name
        frame = frame.f_back
    return "this hook"


@dataclass
class MetricSpec:
    """How one metric name was logged (fixed by its first ``self.log`` call)."""

    prog_bar: bool
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    reduce_fx: str
    logger: bool = True  # False: callback_metrics and the progress bar only, not the loggers
    add_dataloader_idx: bool = True
    metric: bool = False  # an update/compute/reset object: compute() at the epoch end, then reset()
    accumulates: bool = False  # an on_epoch number or tensor, summed on the device per step
    base: str = ""  # the name given to self.log
    suffix: str = ""  # "/dataloader_idx_N" (several evaluation loaders), else ""
    dataloader_idx: int | None = None  # the evaluation loader it was logged in (of several); None: outside them
    float64: bool = False  # a float64 tensor, or a number under float64 default (64-true): float64 in callback_metrics
    called_with: tuple = field(default=(), compare=False)  # the first call's arguments, as given (a later call's differ?)
    hook: str = field(default="", compare=False)  # the hook of the first call (running_hook)


def is_metric_object(value: Any) -> bool:
    """True for objects with torchmetrics' protocol: ``update``, ``compute`` and ``reset`` methods."""
    return not isinstance(value, torch.Tensor) and all(
        callable(getattr(value, method, None)) for method in ("update", "compute", "reset"))


def check_metric_attribute(module: torch.nn.Module, name: str, value: Any, attribute: str | None) -> None:
    """Lightning's rule for a logged metric object: ``metric_attribute`` names the module's attribute
    holding it, or, left out, a metric that is an ``nn.Module`` (torchmetrics') is one of the module's
    submodules (so that checkpoints and devices follow it)."""
    if attribute is not None:
        if getattr(module, attribute, None) is not value:
            raise MisconfigurationException(f'self.log("{name}", ..., metric_attribute="{attribute}"): {type(module).__name__}.'
                             f"{attribute} is not the logged object. Name the attribute that holds the metric, or "
                             "leave metric_attribute out.")
        return
    if not is_metric_object(value):
        return
    found = module.__dict__.get("_metric_attributes")  # id -> name, walked again only for a metric not seen
    if found is None or id(value) not in found:
        found = module.__dict__["_metric_attributes"] = {
            id(each): key for key, each in module.named_modules() if is_metric_object(each)}
    if id(value) not in found:
        lightnings = ("You can fix this by setting an attribute for the metric in your `LightningModule`" if not found
                      else f"You can fix this by calling `self.log({name}, ..., metric_attribute=name)` where `name` "
                           f"is one of {list(found.values())}")
        raise MisconfigurationException(f"Could not find the `LightningModule` attribute for the `torchmetrics.Metric` logged. "
                         f'{lightnings}: self.log("{name}", ...) got a metric that is not a submodule of '
                         f"{type(module).__name__}; assign it in __init__ (self.accuracy = Accuracy(...)).")


class StageMetrics:
    """The metrics of one stage (train, or the current evaluation) between two reads."""

    def __init__(self, default_on_step: bool, has_loggers: bool = True) -> None:
        self.default_on_step = default_on_step
        self.has_loggers = has_loggers  # False: self.log(logger=True) gets Lightning's warning
        self.specs: dict[str, MetricSpec] = {}
        self.step_values: dict[str, Any] = {}
        #: Names whose later calls only replace the step value (on_step only, no metric object, no loader
        #: suffix): for them, ``TrainingModule.log`` writes ``step_values`` itself.
        self.step_only: set[str] = set()
        self.epoch_totals: dict[str, list[Any]] = {}  # name -> [device total, weight]
        self.metric_objects: dict[str, Any] = {}  # name -> the metric object logged under it
        self.objects_logged: set[str] = set()  # metric objects logged since the last read of the epoch values
        self.computed_objects: set[str] = set()  # computed for the epoch end, reset after its hooks
        #: "/dataloader_idx_N" while evaluation runs loader N of several (Lightning's keys), else "" (set_loader).
        self.dataloader_suffix = ""
        self.dataloader_idx: int | None = None
        #: The running batch, set by the loop (None outside batches): its size weighs epoch means, as in Lightning.
        self.batch: Any = None
        self._sized: tuple[Any, int] = (None, 1)  # (batch, its size): inferred once per batch

    def set_loader(self, dataloader_idx: int | None) -> None:
        """Evaluation runs loader ``dataloader_idx`` of several (None: one loader, or outside the loaders)."""
        self.dataloader_idx = dataloader_idx
        self.step_values = {}  # as in Lightning, a loader's step rows repeat its own names only
        self.dataloader_suffix = "" if dataloader_idx is None else f"/dataloader_idx_{dataloader_idx}"
        if self.dataloader_suffix:  # names now get a suffix: every call goes through log()
            self.step_only = set()

    def log(self, name: str, value: Any, prog_bar: bool, logger: bool | None, on_step: bool | None,
            on_epoch: bool | None, reduce_fx: Any, sync_dist: bool, sync_dist_group: Any,
            add_dataloader_idx: bool, batch_size: int | None, rank_zero_only: bool) -> None:
        if self.batch is None and (on_step or on_epoch is False):  # outside batches: Lightning's epoch-level hooks
            given, allowed = ("on_step", on_step) if on_step else ("on_epoch", on_epoch), "(False,)" if on_step else "(True,)"
            raise MisconfigurationException(f"You can't `self.log({given[0]}={given[1]})` inside `{running_hook()}`, must be "
                                            f"one of {allowed}. Outside batches, log with on_step=False, on_epoch=True.")
        logged_as = name
        if self.dataloader_suffix and add_dataloader_idx:
            name = name + self.dataloader_suffix
        key = name  # where it is kept: the name, or apart when logged from another hook with other defaults
        spec = first = self.specs.get(name)
        if spec is not None and self._flavour(on_step, on_epoch) != (spec.on_step, spec.on_epoch):
            # Lightning keys a value by hook and name: "shared" logged per step in training_step and per epoch in
            # on_train_epoch_end are two metrics, each published when read (the epoch's value last, so it wins).
            key = f"{name}\x00{self._flavour(on_step, on_epoch)}"
            spec = self.specs.get(key)
        called_with = (prog_bar, logger, reduce_fx, sync_dist, add_dataloader_idx, rank_zero_only)
        if spec is None:
            if add_dataloader_idx and "/dataloader_idx_" in logged_as:
                raise MisconfigurationException(
                    f"You called `self.log` with the key `{logged_as}` but it should not contain information about "
                    "`dataloader_idx` when `add_dataloader_idx=True`: the Trainer adds \"/dataloader_idx_N\" itself; "
                    "log the name without it, or pass add_dataloader_idx=False.")
            if first is not None:  # another on_step/on_epoch: a second metric, unless from the same hook (Lightning's rule)
                self._check_twice(logged_as, first, called_with, (on_step, on_epoch))
            spec = self._register(name, logged_as, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist,
                                  sync_dist_group, add_dataloader_idx, rank_zero_only, key)
            spec.called_with = called_with
        else:
            if called_with != spec.called_with:  # rare: the arguments as given differ from the first call's
                self._check_twice(logged_as, spec, called_with)
            if spec.metric or not isinstance(value, (torch.Tensor, float)):
                self._check_same_kind(key, value, spec)
        if spec.on_step:
            self.step_values[key] = value
        if spec.metric:
            self.objects_logged.add(key)
        if spec.accumulates:
            if batch_size is None:  # Lightning's rule: a mean weighs each value by its batch's size
                batch_size = self._inferred_batch_size() if spec.reduce_fx == "mean" else 1
            self._accumulate(key, value, spec.reduce_fx, batch_size)

    def _flavour(self, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
        """``(on_step, on_epoch)`` of a call, Lightning's defaults filled in: per step in training batches;
        per epoch elsewhere (on_train_epoch_start/_end too)."""
        in_steps = self.default_on_step and self.batch is not None
        return (in_steps if on_step is None else bool(on_step)), ((not in_steps) if on_epoch is None else bool(on_epoch))

    def _check_twice(self, name: str, spec: MetricSpec, called_with: tuple, flavour: tuple | None = None) -> None:
        """Lightning's rule: a name logged again in the same hook with other arguments is refused (from another hook
        it is another metric: the first call's spec stays)."""
        prog_bar, logger, reduce_fx, sync_dist, add_dataloader_idx, rank_zero_only = called_with
        reduce_fx = REDUCE_CALLABLES.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
        reduce_fx = ("mean" if reduce_fx.lower() == "avg" else reduce_fx.lower()) if isinstance(reduce_fx, str) else reduce_fx
        same = flavour is None and (bool(prog_bar), True if logger is None else bool(logger), reduce_fx,
                                    bool(sync_dist) and not spec.metric and not rank_zero_only, bool(add_dataloader_idx)) == (
            spec.prog_bar, spec.logger, spec.reduce_fx, spec.sync_dist, spec.add_dataloader_idx)
        if not same and running_hook() == spec.hook:
            raise MisconfigurationException(
                f"You called `self.log({name}, ...)` twice in `{spec.hook}` with different arguments. This is not "
                "allowed: log it once per hook and batch, or under another name.")

    def _check_same_kind(self, name: str, value: Any, spec: MetricSpec) -> None:
        if spec.metric != is_metric_object(value):
            first, then = ("a metric object", type(value).__name__) if spec.metric else ("a number", "a metric object")
            raise MisconfigurationException(f'self.log("{spec.base}", ...) got {first}, then {then}: a key holds one metric object '
                             "or numbers, as in Lightning. Give each its own name.")
        if spec.metric:  # as Lightning, the epoch's value is the compute() of the last object logged under the key
            self.metric_objects[name] = value

    def _inferred_batch_size(self) -> int:
        """The running batch's size (host metadata, no device sync), or 1 outside a batch."""
        if self.batch is None:
            return 1
        if self._sized[0] is not self.batch:
            self._sized = (self.batch, extract_batch_size(self.batch))
        return self._sized[1]

    def _register(self, name: str, logged_as: str, value: Any, prog_bar: bool, logger: bool | None, on_step: bool | None,
                  on_epoch: bool | None, reduce_fx: Any, sync_dist: bool, sync_dist_group: Any,
                  add_dataloader_idx: bool, rank_zero_only: bool, key: str) -> MetricSpec:
        if not isinstance(logged_as, str) or not logged_as:
            raise MisconfigurationException(f"self.log(name={logged_as!r}): the name must be a non-empty string.")
        reduce_fx = REDUCE_CALLABLES.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
        if isinstance(reduce_fx, str):  # Lightning reads the name case-insensitively, "avg" as "mean"
            reduce_fx = "mean" if reduce_fx.lower() == "avg" else reduce_fx.lower()
        if reduce_fx not in REDUCE_FX:
            raise MisconfigurationException(
                "Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported. If you need a custom reduction, "
                f"please log a `torchmetrics.Metric` instance instead. Found: {reduce_fx}: self.log(\"{name}\", ...) "
                f"takes one of {REDUCE_FX} (or torch.mean, torch.sum, torch.max, torch.min).")
        if sync_dist_group is not None:
            raise MisconfigurationException(f'self.log("{name}", sync_dist_group=...): Cadence reduces over all processes; '
                             "leave sync_dist_group out.")
        metric = is_metric_object(value)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationException(
                    f"`self.log({name}, ...)` was called, but the tensor must have a single element. You can try doing "
                    f"`self.log({name}, value.mean())`: it got a tensor of shape {tuple(value.shape)}.")
        elif not metric and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            shown = str(value) if len(str(value)) <= 200 else f"<{type(value).__name__}>"
            raise MisconfigurationException(
                f"`self.log({name}, {shown})` was called, but {type(value).__name__} values cannot be logged: log a "
                "number, a one-element tensor or a metric object (update/compute/reset)."
            )
        on_step, on_epoch = self._flavour(on_step, on_epoch)
        spec = MetricSpec(
            prog_bar=bool(prog_bar),
            on_step=on_step,
            on_epoch=on_epoch,
            # A metric object syncs itself in compute(); a value logged on rank zero only has no
            # partner on the other ranks for a collective.
            sync_dist=bool(sync_dist) and not metric and not rank_zero_only,
            reduce_fx=reduce_fx,
            logger=True if logger is None else bool(logger),
            add_dataloader_idx=bool(add_dataloader_idx),
            metric=metric,
            base=logged_as if name != logged_as else name,
            suffix=name[len(logged_as):] if name != logged_as else "",
            dataloader_idx=self.dataloader_idx,
            # As Lightning's: a number becomes a tensor of the default dtype (float64 in 64-true's steps).
            float64=not metric and (value.dtype if isinstance(value, torch.Tensor) else torch.get_default_dtype())
            == torch.float64,
        )
        spec.accumulates = spec.on_epoch and not metric
        spec.hook = running_hook()
        if spec.on_step and not spec.on_epoch and not metric and not self.dataloader_suffix and key == name:
            self.step_only.add(name)
        if logger and not self.has_loggers:  # once per name and stage: the first call registers it
            warn(f"You called `self.log({logged_as!r}, ..., logger=True)` but have no logger configured. Enable one "
                 "with Trainer(logger=True) or a logger callback, or remove `logger=True` to suppress this warning.")
        if not (spec.on_step or spec.on_epoch):
            raise MisconfigurationException(f'`self.log(on_step=False, on_epoch=False)` is not useful: self.log("{name}", '
                                            "...) records nothing that way; set one.")
        if metric:
            if spec.on_step and not hasattr(value, "_forward_cache"):
                raise MisconfigurationException(
                    f'self.log("{name}", <{type(value).__name__}>, on_step=True): a metric object is logged per step '
                    "through the value of its last metric(...) call (torchmetrics' forward), which this object "
                    "does not keep. Log it with on_step=False, on_epoch=True (compute() at the epoch end), or "
                    "log the batch's value as a tensor."
                )
            self.metric_objects[key] = value
        self.specs[key] = spec
        return spec

    def _accumulate(self, name: str, value: Any, reduce_fx: str, weight: int) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(())
            if value.dtype in (torch.float16, torch.bfloat16):  # AMP: sum in float32, or value * batch_size overflows
                value = value.float()
        else:  # a number: summed as a tensor of the default dtype, as Lightning's (its float32 arithmetic, not Python's)
            value = torch.tensor(value, dtype=torch.float64 if self.specs[name].float64 else torch.float32)
        total = self.epoch_totals.get(name)
        if total is None:
            start = value * weight if reduce_fx == "mean" else value
            if isinstance(start, torch.Tensor):
                start = start.to(torch.float64 if start.dtype == torch.float64 else torch.float32, copy=True)
            self.epoch_totals[name] = [start, weight]
            return
        if reduce_fx == "mean":
            total[0] = total[0] + value * weight
        elif reduce_fx == "sum":
            total[0] = total[0] + value
        else:
            total[0] = (torch.maximum if reduce_fx == "max" else torch.minimum)(torch.as_tensor(total[0]), torch.as_tensor(value))
        total[1] += weight

    def take_step_values(self, keep: bool = False) -> dict[str, tuple[Any, MetricSpec]]:
        """The latest value of each ``on_step`` metric since the last read, then forget them (``keep``:
        since they were last forgotten). A metric object gives its last ``metric(...)`` call's value."""
        taken = {name: (value, self.specs[name]) for name, value in self.step_values.items()}
        if not keep:
            self.step_values = {}
        for name in self.metric_objects.keys() & taken.keys():
            value = taken[name][0]._forward_cache
            if value is None:  # logged before its first metric(...) call
                del taken[name]
            else:
                taken[name] = (_scalar(name.split("\x00")[0], value), taken[name][1])
        return taken

    def take_epoch_values(self, final: bool = True) -> dict[str, tuple[Any, MetricSpec]]:
        """Each ``on_epoch`` metric logged since the last read, reduced over the epoch, then forget
        them. Metric objects give their ``compute()``; they are ``reset()`` at the ``final`` read
        (after the epoch-end hooks, as in Lightning, so a hook may still call ``compute()``)."""
        taken = {}
        for name, (total, weight) in self.epoch_totals.items():
            spec = self.specs[name]
            taken[name] = (total / weight if spec.reduce_fx == "mean" else total, spec)
        self.epoch_totals = {}
        for name in self.objects_logged:  # not one only read again (the epoch end reads more than once)
            if self.specs[name].on_epoch:
                taken[name] = (_scalar(name.split("\x00")[0], self.metric_objects[name].compute()), self.specs[name])
        self.computed_objects |= self.objects_logged
        self.objects_logged = set()
        if len(taken) > 1:  # in the order of the names' first calls, as Lightning's (not the set's hash order)
            taken = {name: taken[name] for name in self.specs if name in taken}
        if final:
            for name in self.computed_objects:
                self.metric_objects[name].reset()
            self.computed_objects = set()
        return taken


def _scalar(name: str, value: Any) -> Any:
    """A metric object's value as one number or one-element tensor, or an error naming the metric."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise MisconfigurationException(
        f"The `.compute()` return of the metric logged as '{name}' must be a tensor (a scalar): it "
        f"computed {what}. Log each element under its own name.")


class NoStage:
    """What ``self.log`` writes to between stages: nothing is recorded."""

    step_only: frozenset[str] = frozenset()

    def log(self, *args: Any, **kwargs: Any) -> None:
        return None


NO_STAGE = NoStage()


class NotAttached(NoStage):
    """What ``self.log`` writes to before the module is given to a Trainer: nothing, with Lightning's warning."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        warn("You are trying to `self.log()` but the `self.trainer` reference is not registered on the model yet. "
             "This is most likely because the model hasn't been passed to the `Trainer`: nothing is recorded "
             "(calling a step yourself, as in a unit test, is fine).")


NOT_ATTACHED = NotAttached()


class Barebones(NoStage):
    """What ``self.log`` writes to under ``Trainer(barebones=True)``: nothing, with Lightning's warning."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        warn("`self.log()` was called, but `Trainer(barebones=True)` is configured. Logging can impact raw speed so "
             "it is disabled under this setting: nothing is recorded.")


BAREBONES = Barebones()


class Refused(NoStage):
    """What ``self.log`` meets in a hook where Lightning refuses it (setup, on_fit_start, the batch transfer hooks
    ...): Lightning's error, naming ``hook`` (or the innermost hook on the stack)."""

    def __init__(self, hook: str | None = None) -> None:
        self.hook = hook

    def log(self, *args: Any, **kwargs: Any) -> None:
        raise MisconfigurationException(
            f"You can't `self.log()` inside `{self.hook or running_hook()}`. HINT: You can still log directly to the "
            "logger by using `self.logger.experiment`.")


class PredictRefused(Refused):
    """What ``self.log`` meets in every hook of ``Trainer.predict``, which, as Lightning's, records no metrics."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        raise MisconfigurationException(
            "You are trying to `self.log()` but the loop's result collection is not registered yet. This is most likely "
            "because you are trying to log in a `predict` hook, but it doesn't support logging: it was called inside "
            f"`{self.hook or running_hook()}`. Log directly to the logger with `self.logger.experiment`.")


REFUSED = Refused()


def refused_in(module: Any, hook: str) -> Any:
    """``module``'s ``hook`` (its bound method), calling which refuses ``self.log`` (:func:`refusing`)."""
    return functools.partial(refusing, module, hook, getattr(module, hook))


def refusing(module: Any, hook: str, call: Any, *args: Any) -> Any:
    """``call(*args)`` (``module``'s ``hook``, or a callback's) with ``self.log`` refused in it, as in Lightning's
    table. For the hooks Cadence calls where ``self.log`` otherwise records (inside a training or evaluation loop)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return call(*args)
    metrics = trainer.metrics
    current, metrics.current = metrics.current, metrics.refusal(hook)
    try:
        return call(*args)
    finally:
        metrics.current = current
