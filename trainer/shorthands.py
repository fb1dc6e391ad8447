"""The Trainer's arguments, checked and translated once, at construction, into what the loop knows.

:func:`translate` is ``Trainer.__init__``'s one call: every argument is checked
(``trainer/arguments.py``), then Lightning's shorthands are translated. The loop reads none of
them; each becomes a strategy, callbacks or the plain settings it already has:

    accelerator, devices, strategy, num_nodes   -> a Strategy (strategies.resolve_strategy)
    fast_dev_run=n                              -> n batches of each stage (limits, max_steps=n, one epoch,
                                                   no sanity check), no loggers (a DummyLogger), no checkpoints
    overfit_batches=n                           -> limit_train_batches = limit_val_batches = n (and the
                                                   loaders read in order: trainer/data.py)
    max_time                                    -> callbacks.Timer
    enable_model_summary                        -> callbacks.ModelSummary
    benchmark, detect_anomaly                   -> callbacks.TorchFlags
    sync_batchnorm                              -> callbacks.SyncBatchNorm
    precision="16-mixed", "bf16-mixed"          -> callbacks.AMP, or the strategy's policy (trainer/precision.py)
    precision="64-true", "bf16-true", "16-true" -> callbacks.TruePrecision
    profiler, report                            -> callbacks.Profiler, callbacks.PerformanceReport

:func:`reject_unknown_arguments` turns a misspelled or Lightning-only keyword into an error that
names the close match, or the Cadence way to do the same.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import os
import sys
from typing import Any, Callable

import callbacks as callbacks_package
import strategies as strategies_package
from callbacks import Callback, ModelSummary, SyncBatchNorm, Timer, TorchFlags
from callbacks.console import info, MisconfigurationException, refuse_url
from callbacks.timer import parse_duration
from strategies import Strategy
from trainer.arguments import check_trainer_arguments
from trainer.data import check_limit, explain_ones
from trainer.precision import add_precision_callback
from trainer.seed import seed_generators, set_cublas_workspace_config

#: Trainer arguments of Lightning (1.x and 2.x) that Cadence does not take, and what to do instead.
LIGHTNING_ONLY = {
    "gpus": 'accelerator="gpu", devices=N',
    "num_processes": 'devices=N (with strategy="ddp" for several processes)',
    "auto_select_gpus": 'devices=N: CUDA_VISIBLE_DEVICES chooses which GPUs are visible',
    "tpu_cores": "nothing: Cadence runs on CPUs, CUDA GPUs and Apple GPUs, not TPUs",
    "ipus": "nothing: Cadence runs on CPUs, CUDA GPUs and Apple GPUs, not IPUs",
    "hpus": "nothing: Cadence runs on CPUs, CUDA GPUs and Apple GPUs, not HPUs",
    "plugins": "callbacks for what plugins did (callbacks.AMP for mixed precision, callbacks.TruePrecision for "
               "DoublePrecision/HalfPrecision, or Trainer(precision=...)); the cluster environment "
               "is torchrun's variables, and checkpoint files are written by the Trainer",
    "resume_from_checkpoint": "trainer.fit(model, ..., ckpt_path=path)",
    "replace_sampler_ddp": "use_distributed_sampler",
    "reload_dataloaders_every_epoch": "reload_dataloaders_every_n_epochs=1",
    "weights_summary": "enable_model_summary (or callbacks.ModelSummary(max_depth=...))",
    "checkpoint_callback": "enable_checkpointing",
    "progress_bar_refresh_rate": "callbacks=[callbacks.ProgressBar(refresh_rate=N)]",
    "weights_save_path": "callbacks=[callbacks.ModelCheckpoint(dirpath=...)]",
    "flush_logs_every_n_steps": "log_every_n_steps",
    "terminate_on_nan": 'on_nonfinite_loss="raise"',
    "track_grad_norm": "self.log of torch.nn.utils.get_total_norm(...) in on_before_optimizer_step",
    "auto_lr_find": "nothing (Lightning 2 dropped it too): choose the learning rate by hand",
    "auto_scale_batch_size": "nothing (Lightning 2 dropped it too): choose the batch size by hand",
    "amp_backend": "callbacks.AMP",
    "amp_level": "callbacks.AMP",
    "move_metrics_to_cpu": "nothing: logged values reach the host at log steps already",
    "multiple_trainloader_mode": "one training loader (combine datasets with torch.utils.data.ConcatDataset)",
    "stochastic_weight_avg": "torch.optim.swa_utils in your module",
    "prepare_data_per_node": "the prepare_data_per_node attribute of your DataModule or module",
    "enable_autolog_hparams": "logger=False to log nothing; hyperparameters are kept in checkpoints",
    "model_registry": "nothing: ModelCheckpoint writes the files; upload them yourself",
    "suggest_integrations": "nothing: leave it out",
}


def reject_unknown_arguments(unknown: dict[str, Any], function: Callable[..., Any], where: str = "Trainer",
                             weights_only: Any = None) -> None:
    """Raise a TypeError for keyword arguments ``function`` does not take, naming the close match
    (``max_epoch`` -> ``max_epochs``) or, for a Lightning argument, the Cadence way; and for a stage's
    ``weights_only`` that is not None, True or False (Lightning's, passed on to ``torch.load``: Cadence reads
    every checkpoint as plain data, as ``weights_only=True`` does, and refuses a file that holds objects)."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"{where}(weights_only={weights_only!r}): use None, True or False.")
    if not unknown:
        return
    parameters = inspect.signature(function).parameters
    accepted = [name for name, p in parameters.items() if name != "self" and p.kind != p.VAR_KEYWORD]
    problems = []
    for name, value in unknown.items():
        if name in LIGHTNING_ONLY:
            problems.append(f"{where}({name}={value!r}) is Lightning's; Cadence does not take it. Instead: "
                            f"{LIGHTNING_ONLY[name]}.")
            continue
        match = difflib.get_close_matches(name, accepted, n=1, cutoff=0.75)
        hint = f"did you mean {match[0]}?" if match else f"it takes: {', '.join(accepted)}."
        # Python's own words last, for code that matches them (Lightning's test_trainer_subclassing does)
        problems.append(f"{where}({name}={value!r}): no such argument; {hint} ({function.__qualname__}() got an "
                        f"unexpected keyword argument {name!r})")
    raise TypeError("\n".join(problems))


@dataclasses.dataclass
class Translated:
    """What ``Trainer.__init__`` stores besides the arguments it keeps as given: the strategy, the
    callbacks, and the plain settings that a shorthand may override."""

    strategy: Strategy
    callbacks: list[Callback]
    max_epochs: int | None
    max_steps: int
    limits: dict[str, Any]  # limit_{train,val,test,predict}_batches by stage: train, validate, test, predict
    num_sanity_val_steps: int
    val_check_interval: int | float
    check_val_every_n_epoch: int | None
    default_root_dir: str
    log_every_n_steps: int = 50
    gradient_clip_algorithm: str | None = None  # None (Lightning's): clip_gradients' default, "norm"
    fast_dev_run: bool | int = False  # as in Lightning, 1 is True
    deterministic: bool = False


#: Trainer arguments whose default in Lightning's signature is None, meaning the value here (a config
#: written from that signature, LightningCLI's or Hydra's, carries the nulls): None means the same here.
LIGHTNING_NONE_DEFAULTS = {
    "logger": True, "enable_checkpointing": True, "enable_progress_bar": True, "enable_model_summary": True,
    "log_every_n_steps": 50, "num_sanity_val_steps": 2, "deterministic": False,
}


#: ``Trainer(barebones=True)``: Lightning's features that cost speed, each refused when asked for, and why.
BAREBONES_OFF = {
    "enable_checkpointing": "Checkpointing", "logger": "Logging", "enable_progress_bar": "The progress bar",
    "log_every_n_steps": "Logging", "enable_model_summary": "Model summary", "num_sanity_val_steps": "Sanity checking",
    "fast_dev_run": "Development run", "detect_anomaly": "Anomaly detection", "profiler": "Profiling",
}


def defaults_from_env_vars(init: Callable[..., None]) -> Callable[..., None]:
    """Lightning's ``PL_TRAINER_<ARGUMENT>`` environment variables (``PL_<CLASS NAME>_`` for a subclass): each the
    default of that argument (read as a Python literal, else as a str: ``PL_TRAINER_LOGGER=False``,
    ``PL_TRAINER_MAX_STEPS=7``); an argument passed wins. Nothing is read when no such variable is set."""
    names = [name for name in inspect.signature(init).parameters if name not in ("self", "unknown")]

    @functools.wraps(init)
    def with_environment_defaults(self: Any, *args: Any, **kwargs: Any) -> None:
        prefix = f"PL_{type(self).__name__.upper()}_"
        if any(key.startswith(prefix) for key in os.environ):
            kwargs, args = {**dict(zip(names, args)), **kwargs}, ()
            for name in names:
                value = os.environ.get(prefix + name.upper())
                if value and name not in kwargs:
                    with contextlib.suppress(ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                        value = ast.literal_eval(value)
                    kwargs[name] = value
        init(self, *args, **kwargs)

    return with_environment_defaults


def with_lightning_defaults(arguments: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's ``arguments`` with each None of :data:`LIGHTNING_NONE_DEFAULTS` replaced by what it means,
    and, with ``barebones=True``, Lightning's speed-costing features off (each refused if asked for)."""
    if arguments.get("barebones"):
        for name, what in BAREBONES_OFF.items():
            value = arguments[name]
            if value is not None and value is not False and not (isinstance(value, int) and value == 0):
                raise MisconfigurationException(
                    f"`Trainer(barebones=True, {name}={value!r})` was passed. {what} can impact raw speed "
                    f"so it is disabled in barebones mode: leave {name} out, or drop barebones=True.")
        arguments = arguments | {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                                 "enable_model_summary": False, "num_sanity_val_steps": 0, "report": False,
                                 "log_every_n_steps": None}  # the loop's default: its checks run at log steps
    return {name: LIGHTNING_NONE_DEFAULTS[name] if value is None and name in LIGHTNING_NONE_DEFAULTS else value
            for name, value in arguments.items()}


def translate(*, max_epochs: Any, max_steps: Any, strategy: Any, devices: Any, precision: Any, callbacks: Any,
              accumulate_grad_batches: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any,
              val_check_interval: Any, check_val_every_n_epoch: Any, limit_train_batches: Any, limit_val_batches: Any,
              limit_test_batches: Any, limit_predict_batches: Any, num_sanity_val_steps: Any, log_every_n_steps: Any,
              default_root_dir: Any, enable_progress_bar: Any, enable_checkpointing: Any, logger: Any, seed: Any,
              deterministic: Any, on_nonfinite_loss: Any, accelerator: Any, num_nodes: Any, fast_dev_run: Any,
              min_epochs: Any, min_steps: Any, max_time: Any, overfit_batches: Any, enable_model_summary: Any,
              benchmark: Any, detect_anomaly: Any, inference_mode: Any, use_distributed_sampler: Any,
              sync_batchnorm: Any, reload_dataloaders_every_n_epochs: Any, profiler: Any, report: Any,
              barebones: Any = False) -> Translated:
    """Check every ``Trainer`` argument (each keyword is the Trainer's), then translate the
    shorthands (see the module's docstring). Plain arguments come back unchanged unless
    ``fast_dev_run`` or ``overfit_batches`` overrides them.

    ``seed`` seeds the process now (which also checks it; each stage seeds again) and
    ``deterministic`` configures cuBLAS before it first runs (the rest waits for each stage).
    """
    limits = {"train": limit_train_batches, "validate": limit_val_batches,
              "test": limit_test_batches, "predict": limit_predict_batches}
    if not fast_dev_run:  # what 1 and 1.0 mean, for the arguments given (as Lightning's info messages)
        explain_ones({"overfit_batches": overfit_batches, "val_check_interval": val_check_interval, **(
            {} if overfit_batches else {"limit_train_batches": limit_train_batches, "limit_val_batches": limit_val_batches}),
            "limit_test_batches": limit_test_batches, "limit_predict_batches": limit_predict_batches})
    val_check_interval = 1.0 if val_check_interval is None else val_check_interval  # Lightning's default
    check_trainer_arguments(
        max_epochs=max_epochs, max_steps=max_steps, accumulate_grad_batches=accumulate_grad_batches,
        log_every_n_steps=log_every_n_steps, check_val_every_n_epoch=check_val_every_n_epoch,
        gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
        val_check_interval=val_check_interval, limits=limits, num_sanity_val_steps=num_sanity_val_steps,
        on_nonfinite_loss=on_nonfinite_loss, min_epochs=min_epochs, min_steps=min_steps,
        reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs,
        flags={"benchmark": benchmark, "detect_anomaly": detect_anomaly, "inference_mode": inference_mode,
               "use_distributed_sampler": use_distributed_sampler, "sync_batchnorm": sync_batchnorm},
    )
    if not isinstance(barebones, bool):
        raise MisconfigurationException(f"Trainer(barebones={barebones!r}): use True or False.")
    refuse_url(default_root_dir, "Trainer(default_root_dir)")
    if barebones and os.environ.get("RANK", "0") == "0":
        print("Trainer(barebones=True): no checkpoints, loggers, self.log, progress bar, model summary, sanity check, "
              "profiler or performance report (Lightning's barebones mode).", file=sys.stderr)
    if seed is not None:
        seed_generators(seed)  # validates; seeded again at the start of each stage
    if deterministic:
        set_cublas_workspace_config()
    run = Translated(
        strategy=strategies_package.resolve_strategy(strategy, devices, accelerator=accelerator, num_nodes=num_nodes),
        callbacks=[], max_epochs=max_epochs, max_steps=max_steps, limits=dict(limits),
        num_sanity_val_steps=num_sanity_val_steps, val_check_interval=val_check_interval,
        check_val_every_n_epoch=check_val_every_n_epoch,
        # A str, as Lightning's; "~/runs" is the home directory's (os.path.expanduser), never a directory named "~".
        default_root_dir=os.path.normpath(os.path.expanduser(default_root_dir)) if default_root_dir is not None else os.getcwd(),
        log_every_n_steps=log_every_n_steps, deterministic=deterministic,
        gradient_clip_algorithm=gradient_clip_algorithm.lower() if gradient_clip_algorithm is not None else None,
    )
    batches = _fast_dev_run_batches(fast_dev_run)
    run.fast_dev_run = True if batches == 1 else fast_dev_run
    check_limit(overfit_batches, "overfit_batches")
    if batches:
        callbacks = _without_loggers_and_checkpoints(callbacks)
        # As Lightning: the loggers asked for become one DummyLogger (trainer.logger answers; nothing is written).
        logger, enable_checkpointing = [callbacks_package.DummyLogger()] if logger else False, False
        run.limits.update(test=batches, predict=batches)
        if not overfit_batches:
            run.limits.update(train=batches, validate=batches)
        run.max_steps, run.max_epochs, run.num_sanity_val_steps = batches, 1, 0
        run.val_check_interval, run.check_val_every_n_epoch = 1.0, 1
        if os.environ.get("RANK", "0") == "0":  # torchrun starts every rank with these arguments
            print(f"Trainer(fast_dev_run={fast_dev_run}): {batches} batch(es) of each stage; no loggers, no "
                  "checkpoints.", file=sys.stderr)
    if overfit_batches:
        run.limits.update(train=overfit_batches, validate=overfit_batches)
    run.callbacks = callbacks_package.default_callbacks(
        callbacks, enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing, logger=logger
    )
    _add_model_summary(run.callbacks, enable_model_summary)
    if max_time is not None and any(isinstance(callback, Timer) for callback in run.callbacks):
        parse_duration(max_time, "Trainer(max_time")  # still checked
        if os.environ.get("RANK", "0") == "0":  # as in Lightning: the Timer given wins, and the user is told
            info(f"Trainer(max_time={max_time!r}) is not used: the callbacks list already contains a Timer, whose "
                 "duration limits the run.")
    elif max_time is not None:
        run.callbacks.append(Timer(parse_duration(max_time, "Trainer(max_time")))
    if max_time is not None and run.max_epochs is None and run.max_steps == -1:
        run.max_epochs = -1  # as in Lightning: the time limit alone ends the run
    if benchmark is not None or detect_anomaly:
        run.callbacks.append(TorchFlags(cudnn_benchmark=benchmark, detect_anomaly=bool(detect_anomaly)))
    if sync_batchnorm:
        run.callbacks.insert(0, SyncBatchNorm())  # before compile and other model changes
    run.strategy.validate()
    run.callbacks = add_precision_callback(precision, run.strategy, run.callbacks)  # "16-mixed": an AMP first
    run.callbacks = callbacks_package.observability_callbacks(run.callbacks, profiler=profiler, report=report)
    return run


def _fast_dev_run_batches(fast_dev_run: Any) -> int:
    if isinstance(fast_dev_run, bool):
        return int(fast_dev_run)
    if not isinstance(fast_dev_run, int) or fast_dev_run < 0:
        raise MisconfigurationException(
            f"Trainer(fast_dev_run={fast_dev_run!r}): use True (one batch of each stage), False, or an "
            "int >= 0 (that many batches); a number of batches should be >= 0.")
    return fast_dev_run


def _without_loggers_and_checkpoints(callbacks: Any) -> Any:
    """fast_dev_run: the user's callbacks less the loggers and ModelCheckpoints (nothing is written)."""
    if callbacks is None or isinstance(callbacks, Callback):
        callbacks = [] if callbacks is None else [callbacks]
    writers = (callbacks_package.AsyncLogger, callbacks_package.ModelCheckpoint)
    return [callback for callback in callbacks if not isinstance(callback, writers)]


def _add_model_summary(callbacks: list[Callback], enabled: Any) -> None:
    given = [callback for callback in callbacks if isinstance(callback, ModelSummary)]
    if not isinstance(enabled, bool):
        raise MisconfigurationException(f"Trainer(enable_model_summary={enabled!r}): use True or False.")
    if given and not enabled:
        raise MisconfigurationException(
            "Trainer(enable_model_summary=False) but callbacks holds a ModelSummary; remove one of them.")
    if enabled and not given:
        callbacks.append(ModelSummary())
