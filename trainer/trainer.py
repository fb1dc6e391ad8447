"""The Trainer: fit / validate / test / predict, and THE loop, readable top to bottom.

``fit`` comes first and its docstring is the loop in pseudocode; the helpers follow in the order
they are called. Everything about *where* the loop runs is the strategy's (``strategies/``);
everything that happens *around* it is a callback's (``callbacks/``). The loop names only
``Strategy`` and ``Callback`` methods.

Performance notes are marked "hot loop": nothing there converts a tensor to a Python value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import callbacks as callbacks_package
import strategies as strategies_package
from callbacks import Callback
from strategies import Strategy
from trainer import checkpoint as checkpoint_io
from trainer.data import check_limit, limited_length, loader_length, rebuild_dataloader
from trainer.metrics import MetricStore
from trainer.module import TrainingModule
from trainer.optim import SchedulerConfig, parse_optimizers
from trainer.seed import capture_rng_state, restore_rng_state, seed_everything, seed_worker_of_rank

STAGES = ("fit", "validate", "test", "predict")


class Trainer:
    """Trains a :class:`TrainingModule` with one fixed loop; where it runs is the ``strategy``.

    Args mean what they mean in PyTorch Lightning; the ones Cadence adds:
        seed: seed Python, NumPy, torch and DataLoader workers (per worker and per rank) first.
        deterministic: also ask PyTorch for deterministic kernels (slower on GPUs).

    Example::

        trainer = Trainer(max_epochs=5, strategy="auto")
        trainer.fit(model, train_loader, val_loader)
        trainer.test(model, test_loader)
    """

    def __init__(
        self,
        max_epochs: int | None = None,
        max_steps: int = -1,
        strategy: str | Strategy = "auto",
        devices: int | str = "auto",
        callbacks: list[Callback] | Callback | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        logger: bool | Callback | list[Callback] = True,
        seed: int | None = None,
        deterministic: bool = False,
    ) -> None:
        _check_positive_int(max_epochs, "max_epochs", allow_none=True)
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < -1 or max_steps == 0:
            raise ValueError(f"Trainer(max_steps={max_steps!r}): use -1 (no limit) or an int >= 1.")
        _check_positive_int(accumulate_grad_batches, "accumulate_grad_batches")
        _check_positive_int(log_every_n_steps, "log_every_n_steps")
        _check_positive_int(check_val_every_n_epoch, "check_val_every_n_epoch", allow_none=True)
        if gradient_clip_val is not None and (not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val <= 0):
            raise ValueError(f"Trainer(gradient_clip_val={gradient_clip_val!r}): use a positive number or None.")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f'Trainer(gradient_clip_algorithm="{gradient_clip_algorithm}"): use "norm" or "value".')
        if isinstance(val_check_interval, bool) or not isinstance(val_check_interval, (int, float)) or val_check_interval <= 0 or (
            isinstance(val_check_interval, float) and val_check_interval > 1.0
        ):
            raise ValueError(
                f"Trainer(val_check_interval={val_check_interval!r}): use a float in (0.0, 1.0] (a share "
                "of the epoch) or an int >= 1 (a number of training batches)."
            )
        for name, value in (("limit_train_batches", limit_train_batches), ("limit_val_batches", limit_val_batches),
                            ("limit_test_batches", limit_test_batches), ("limit_predict_batches", limit_predict_batches)):
            check_limit(value, name)
        if isinstance(num_sanity_val_steps, bool) or not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
            raise ValueError(f"Trainer(num_sanity_val_steps={num_sanity_val_steps!r}): use an int >= 0, or -1 for all.")
        if seed is not None:
            seed_everything(seed)  # validates; seeded again at the start of each stage

        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.strategy = strategies_package.resolve_strategy(strategy, devices)
        self.strategy.validate()
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limits = {"train": limit_train_batches, "validate": limit_val_batches,
                       "test": limit_test_batches, "predict": limit_predict_batches}
        self.num_sanity_val_steps = num_sanity_val_steps
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = Path(default_root_dir) if default_root_dir is not None else Path.cwd()
        self.seed = seed
        self.deterministic = deterministic
        self.callbacks = callbacks_package.default_callbacks(
            callbacks, enable_progress_bar=enable_progress_bar, enable_checkpointing=enable_checkpointing, logger=logger
        )

        # Public loop state (Lightning names).
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.sanity_checking = False
        self.stage: str | None = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int = 0
        self.log_dir: Path | None = None
        self.module: TrainingModule | None = None  # the user's module while a stage runs
        self.model: torch.nn.Module | None = None  # what the strategy wrapped (DDP), or the module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.metrics = MetricStore(self.strategy.all_reduce)
        self.batch_idx = 0  # index of the training batch being run, within its epoch
        self._resume_position: tuple[int, int] | None = None  # (epoch, batches to skip) after a restore
        self._epoch_rng: dict | None = None  # RNG state just before the epoch's loader iterator
        self._in_epoch_end = False
        self._train_batches_seen = 0  # training batches run since the first fit (log-step clock)

    # =========================================================================================
    # The public entry points
    # =========================================================================================
    def fit(self, model: TrainingModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            ckpt_path: str | os.PathLike | None = None) -> None:
        """Train ``model``. What happens, in order:

            strategy.launch (DDP spawns here, or joins a torchrun group)
            seed; setup hooks; move the model once; callbacks' configure_model; strategy wrap;
            configure_optimizers; restore ckpt_path if given
            on_fit_start
            sanity validation (num_sanity_val_steps batches, nothing logged)
            on_train_start
            each epoch until max_epochs, max_steps or should_stop:
                on_train_epoch_start
                each batch: to device (non_blocking) -> on_train_batch_start
                    -> forward (training_step) under the callbacks' forward contexts
                    -> backward (no all-reduce while accumulating)
                    -> every accumulate_grad_batches-th batch: on_before_optimizer_step, clip,
                       optimizer step, zero grad, step-interval schedulers
                    -> on_train_batch_end -> every log_every_n_steps: on_log
                    -> at val_check_interval: validation (on_validation_start ... on_validation_end)
                epoch metrics -> on_log; epoch-interval schedulers
                on_train_epoch_end
            on_train_end
            on_fit_end
            teardown (also after an error, which first calls on_exception)

        Callbacks run in the order given, each before the module's hook of the same name.
        """
        train_dataloaders = self._loader_or_hook(train_dataloaders, model, "train_dataloader", "fit")
        if val_dataloaders is None and _overrides(model, "val_dataloader"):
            val_dataloaders = model.val_dataloader()
        if val_dataloaders is None and _overrides(model, "validation_step") and self.limits["validate"] != 0:
            warnings.warn(
                f"{type(model).__name__} defines validation_step but fit got no val_dataloaders and the "
                "module has no val_dataloader(); validation will not run. Pass val_dataloaders=... to fit.",
                stacklevel=2,
            )
        self._check_run_length(train_dataloaders)
        self._launch("fit", model, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``validation_step`` over ``dataloaders``; return ``[{metric: value}]`` (epoch means)."""
        dataloaders = self._loader_or_hook(dataloaders, model, "val_dataloader", "validate")
        return self._launch("validate", model, dataloaders, None, ckpt_path)

    def test(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[dict[str, float]]:
        """Run ``test_step`` over ``dataloaders``; return ``[{metric: value}]`` (epoch means)."""
        dataloaders = self._loader_or_hook(dataloaders, model, "test_dataloader", "test")
        return self._launch("test", model, dataloaders, None, ckpt_path)

    def predict(self, model: TrainingModule, dataloaders: Any = None, ckpt_path: str | None = None) -> list[Any]:
        """Run ``predict_step`` over ``dataloaders``; return the outputs, one per batch, in order."""
        dataloaders = self._loader_or_hook(dataloaders, model, "predict_dataloader", "predict")
        return self._launch("predict", model, dataloaders, None, ckpt_path)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write the whole training state to ``path`` atomically (rank zero writes; all ranks wait)."""
        state = self._checkpoint_state()
        if self.strategy.is_global_zero:
            checkpoint_io.save_atomic(state, path)
        self.strategy.barrier("save_checkpoint")

    # =========================================================================================
    # Launch and per-process setup
    # =========================================================================================
    def _launch(self, stage: str, module: TrainingModule, loader: Any, val_loader: Any, ckpt_path: Any) -> Any:
        if not isinstance(module, TrainingModule):
            raise TypeError(
                f"Trainer.{stage} needs a trainer.TrainingModule; got {type(module).__name__}. "
                "Subclass TrainingModule and define training_step and configure_optimizers."
            )
        if self.log_dir is None:
            self.log_dir = self._next_log_dir()
        output, handoff = self.strategy.launch(self._run_stage, stage, module, loader, val_loader, ckpt_path)
        if handoff is not None:  # the work ran in other processes: bring its results here
            self._receive_handoff(module, handoff)
        return output

    def _run_stage(self, stage: str, module: TrainingModule, loader: Any, val_loader: Any, ckpt_path: Any) -> tuple[Any, Any]:
        """Everything one process does for one stage; returns (output, handoff for the caller)."""
        self.stage = stage
        if stage != "fit":
            self.progress_bar_metrics = {}
        self.strategy.setup_environment()
        self.module = module
        module._trainer = self
        try:
            if self.seed is not None:
                seed_everything(self.seed)
            if self.deterministic:
                _use_deterministic_algorithms()
            if self.strategy.is_global_zero:
                print(self.strategy.describe(), file=sys.stderr)
            for callback in self.callbacks:
                callback.setup(self, module, stage)
            module.setup(stage)
            self.model = self._setup_model(module, stage)
            if stage == "fit":
                output = self._run_fit(module, loader, val_loader, ckpt_path)
            else:
                if ckpt_path is not None:
                    self._restore(ckpt_path, weights_only=True)
                output = self._run_evaluation(stage, loader)
            handoff = self._handoff_state(module) if self.strategy.launches_subprocesses else None
            return output, handoff
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self, module, error)
            raise
        finally:
            for callback in self.callbacks:
                callback.teardown(self, module, stage)
            module.teardown(stage)
            self.strategy.teardown()
            module._trainer = None
            self.module = self.model = None

    def _setup_model(self, module: TrainingModule, stage: str) -> torch.nn.Module:
        """Move once; callbacks rewrap (compile, checkpointing); the strategy wraps (DDP)."""
        module = self.strategy.setup_module(module)
        for callback in self.callbacks:
            configured = callback.configure_model(module)
            if configured is not module:
                raise RuntimeError(
                    f"{type(callback).__name__}.configure_model returned a new object; modify the "
                    "module in place (module.compile(), wrapping submodules) so its state_dict keeps its keys."
                )
        if stage != "fit":
            return module
        self.optimizers, self.lr_scheduler_configs = parse_optimizers(module.configure_optimizers())
        if module.automatic_optimization:
            if len(self.optimizers) > 1:
                raise ValueError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers. Several optimizers "
                    "need manual optimization: set self.automatic_optimization = False in __init__ and "
                    "step them in training_step (self.optimizers(), self.manual_backward(loss))."
                )
        else:
            if self.accumulate_grad_batches != 1 or self.gradient_clip_val is not None:
                raise ValueError(
                    "accumulate_grad_batches and gradient_clip_val apply to automatic optimization only; "
                    "with self.automatic_optimization = False, accumulate and clip in training_step."
                )
            for optimizer in self.optimizers:  # global_step counts optimizer steps, as in Lightning
                optimizer.register_step_post_hook(self._count_manual_step)
        self._backward_owner = _single_owner(self.callbacks, "owns_backward")
        self._step_owner = _single_owner(self.callbacks, "owns_optimizer_step")
        self._clip_parameters = [p for group in self.optimizers[0].param_groups for p in group["params"]]
        return self.strategy.wrap_module(module)

    def _count_manual_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.global_step += 1

    # =========================================================================================
    # fit: the loop
    # =========================================================================================
    def _run_fit(self, module: TrainingModule, train_loader: Any, val_loader: Any, ckpt_path: Any) -> None:
        train_loader = self._prepare_loader(train_loader, "train", shuffle=True)
        val_loader = self._prepare_loader(val_loader, "validate", shuffle=False) if val_loader is not None else None
        self.should_stop = False
        if ckpt_path is not None:
            self._restore(ckpt_path)
        for callback in self.callbacks:
            callback.on_fit_start(self, module)
        module.on_fit_start()
        if val_loader is not None and self._resume_position is None and self.num_sanity_val_steps != 0:
            self._run_sanity_check(val_loader)
        for callback in self.callbacks:
            callback.on_train_start(self, module)
        module.on_train_start()
        while not self._finished():
            self._run_train_epoch(train_loader, val_loader)
        for callback in self.callbacks:
            callback.on_train_end(self, module)
        module.on_train_end()
        for callback in self.callbacks:
            callback.on_fit_end(self, module)
        module.on_fit_end()

    def _finished(self) -> bool:
        return (
            self.should_stop
            or (self.max_steps != -1 and self.global_step >= self.max_steps)
            or (self.max_epochs is not None and self.current_epoch >= self.max_epochs)
        )

    def _run_train_epoch(self, train_loader: Any, val_loader: Any) -> None:
        module, strategy = self.module, self.strategy
        self.model.train()
        self.metrics.start_training()
        self._in_epoch_end = False
        for callback in self.callbacks:
            callback.on_train_epoch_start(self, module)
        module.on_train_epoch_start()
        num_batches = self.num_training_batches
        val_every = self._val_every(num_batches) if val_loader is not None else None
        batch_idx = -1
        for batch_idx, batch in self._iterate_train(train_loader):
            # hot loop: from here to the end of the step, no tensor becomes a Python value.
            self.batch_idx = batch_idx
            batch = strategy.batch_to_device(batch)
            self._call_batch_start(batch, batch_idx)
            outputs = self._training_step(module, batch, batch_idx, num_batches)
            self._call_batch_end(outputs, batch, batch_idx)
            self._train_batches_seen += 1
            if self._train_batches_seen % self.log_every_n_steps == 0:
                self._log_step()
            if val_every is not None and ((batch_idx + 1) % val_every == 0 or batch_idx + 1 == num_batches):
                self._run_validation(val_loader)
            if self.should_stop or (self.max_steps != -1 and self.global_step >= self.max_steps):
                break
        if batch_idx == -1 and self._resume_position is None:
            raise RuntimeError(
                "The training DataLoader yielded no batches. Check that the dataset is not empty and "
                "that batch_size <= len(dataset) when drop_last=True."
            )
        self._resume_position = None
        self._end_train_epoch()

    def _iterate_train(self, loader: Any) -> Iterable[tuple[int, Any]]:
        """``enumerate(loader)`` under limit_train_batches, resuming mid-epoch at the index level."""
        _set_sampler_epoch(loader, self.current_epoch)
        skip = 0
        if self._resume_position is not None and self._resume_position[0] == self.current_epoch:
            skip = self._resume_position[1]
        if skip:
            # Replay the RNG draws the loader made when this epoch began (shuffle order, worker
            # seeds), skip the batches already trained at the sampler level, then continue from
            # the state at the checkpoint.
            resumed_rng = capture_rng_state()
            restore_rng_state(self._epoch_rng)
            iterator = iter(_skip_batches(loader, skip))
            restore_rng_state(resumed_rng)
        else:
            self._epoch_rng = capture_rng_state()
            iterator = iter(loader)
        limit = self.num_training_batches
        for batch_idx in range(skip, limit if limit != math.inf else sys.maxsize):
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch_idx, batch

    def _training_step(self, module: TrainingModule, batch: Any, batch_idx: int, num_batches: int | float) -> Any:
        """Forward and backward for one batch; an optimizer step at the end of each accumulation."""
        if not module.automatic_optimization:
            with self._forward_context():
                outputs = self.strategy.training_step(self.model, batch, batch_idx)
            return outputs
        accumulate = self.accumulate_grad_batches
        steps_now = (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == num_batches
        with self.strategy.no_backward_sync(self.model, enabled=not steps_now):
            with self._forward_context():
                outputs = self.strategy.training_step(self.model, batch, batch_idx)
            loss = _loss_of(outputs, batch_idx)
            self.run_backward(loss / accumulate if accumulate > 1 else loss)
        if steps_now:
            self._optimizer_step(module)
        return outputs

    def _forward_context(self) -> contextlib.AbstractContextManager:
        contexts = [c for c in (callback.forward_context() for callback in self.callbacks) if c is not None]
        if not contexts:
            return contextlib.nullcontext()
        if len(contexts) == 1:
            return contexts[0]
        stack = contextlib.ExitStack()
        for context in contexts:
            stack.enter_context(context)
        return stack

    def run_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through the backward seam (AMP scaling) or the strategy."""
        if not loss.requires_grad:
            raise RuntimeError(
                f"The loss at batch {self.batch_idx} does not require grad: every parameter is frozen "
                "(requires_grad=False) or the loss was detached. Unfreeze parameters or return the "
                "loss tensor itself, not loss.item() or loss.detach()."
            )
        if self._backward_owner is not None:
            self._backward_owner.backward(self, self.module, loss)
        else:
            self.strategy.backward(loss)

    def _optimizer_step(self, module: TrainingModule) -> None:
        optimizer = self.optimizers[0]
        for callback in self.callbacks:
            callback.on_before_optimizer_step(self, module, optimizer)
        module.on_before_optimizer_step(optimizer)
        if self.gradient_clip_val is not None:
            if self.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(self._clip_parameters, self.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(self._clip_parameters, self.gradient_clip_val)
        if self._step_owner is not None:
            stepped = self._step_owner.optimizer_step(self, module, optimizer)
        else:
            optimizer.step()
            stepped = True
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if stepped:
            self._step_schedulers("step")

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step if interval == "step" else self.current_epoch + 1
        for config in self.lr_scheduler_configs:
            if config.interval != interval or count % config.frequency != 0:
                continue
            if config.needs_metric:
                if config.monitor not in self.callback_metrics:
                    raise RuntimeError(
                        f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged; logged "
                        f"metrics are {sorted(self.callback_metrics)}. Log it with self.log or fix 'monitor'."
                    )
                config.scheduler.step(float(self.callback_metrics[config.monitor]))
            else:
                config.scheduler.step()

    def _call_batch_start(self, batch: Any, batch_idx: int) -> None:
        for callback in self.callbacks:
            callback.on_train_batch_start(self, self.module, batch, batch_idx)
        self.module.on_train_batch_start(batch, batch_idx)

    def _call_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for callback in self.callbacks:
            callback.on_train_batch_end(self, self.module, outputs, batch, batch_idx)
        self.module.on_train_batch_end(outputs, batch, batch_idx)

    def _log_step(self) -> None:
        """Every log_every_n_steps batches: start this step's copy to the host; publish the last."""
        received = self.metrics.receive()  # copied one log step ago: reading it does not wait
        self.metrics.send_step_values(self.global_step)
        if received is not None:
            step, values, specs = received
            self._publish(values, specs, step)

    def _end_train_epoch(self) -> None:
        self._in_epoch_end = True
        received = self.metrics.receive()
        if received is not None:
            self._publish(received[1], received[2], received[0])
        self.metrics.send_step_values(self.global_step)  # the epoch's last step values, read now
        received = self.metrics.receive()
        values, specs = self.metrics.read_epoch_values(self.metrics.train)
        values.update(received[1])
        specs.update(received[2])
        self._publish(values, specs, self.global_step)
        self._step_schedulers("epoch")
        for callback in self.callbacks:
            callback.on_train_epoch_end(self, self.module)
        self.module.on_train_epoch_end()
        self.current_epoch += 1

    def _publish(self, values: dict[str, float], specs: dict[str, Any], step: int) -> None:
        """Host values reach callback_metrics, the progress bar and the loggers (on_log)."""
        if not values:
            return
        for key, value in values.items():
            self.callback_metrics[key] = torch.tensor(value)
            if specs[key].prog_bar:
                self.progress_bar_metrics[key] = value
        self.logged_metrics.update(values)
        if not self.sanity_checking:
            for callback in self.callbacks:
                callback.on_log(self, self.module, values, step)

    # =========================================================================================
    # Validation, test, predict
    # =========================================================================================
    def _val_every(self, num_batches: int | float) -> int | None:
        if self.check_val_every_n_epoch is None and isinstance(self.val_check_interval, float):
            return None
        if self.check_val_every_n_epoch is not None and (self.current_epoch + 1) % self.check_val_every_n_epoch != 0:
            return None
        if isinstance(self.val_check_interval, int):
            return self.val_check_interval
        if num_batches == math.inf:
            raise ValueError(
                "val_check_interval is a fraction of the epoch, but the training loader has no length. "
                "Use an int val_check_interval (every N batches)."
            )
        return max(1, int(num_batches * self.val_check_interval))

    def _run_sanity_check(self, val_loader: Any) -> None:
        self.sanity_checking = True
        try:
            limit = self.num_val_batches if self.num_sanity_val_steps == -1 else min(self.num_sanity_val_steps, self.num_val_batches)
            self._evaluation_loop("validate", val_loader, limit)
        finally:
            self.sanity_checking = False

    def _run_validation(self, val_loader: Any) -> None:
        self._evaluation_loop("validate", val_loader, self.num_val_batches)
        self.model.train()
        self.metrics.start_training()

    def _run_evaluation(self, stage: str, loader: Any) -> Any:
        loader = self._prepare_loader(loader, stage, shuffle=False)
        limit = self.num_val_batches
        return self._evaluation_loop(stage, loader, limit)

    def _evaluation_loop(self, stage: str, loader: Any, limit: int | float) -> Any:
        """One pass of validation, test or predict, under ``torch.inference_mode``."""
        module = self.module
        hooks = _evaluation_hooks(stage, self.callbacks, module)
        self.model.eval()
        self.metrics.start_evaluation()
        for hook in hooks.start:
            hook(self, module)
        hooks.epoch_start()
        predictions = []
        with torch.inference_mode():
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                batch = self.strategy.batch_to_device(batch)
                with self._forward_context():
                    outputs = hooks.step(batch, batch_idx)
                if stage == "predict":
                    predictions.append(outputs)
                for hook in hooks.batch_end:
                    hook(self, module, outputs, batch, batch_idx)
        hooks.epoch_end()
        values, specs = self.metrics.read_epoch_values(self.metrics.evaluation)
        if not self.sanity_checking:
            self._publish(values, specs, self.global_step)
        for hook in hooks.end:
            hook(self, module)
        return predictions if stage == "predict" else [values]

    # =========================================================================================
    # Loaders
    # =========================================================================================
    def _loader_or_hook(self, loader: Any, module: Any, hook: str, stage: str) -> Any:
        if loader is None and isinstance(module, TrainingModule):
            loader = getattr(module, hook)()
        if loader is None:
            argument = "train_dataloaders" if stage == "fit" else "dataloaders"
            raise ValueError(f"Trainer.{stage} got no {argument} and the module's {hook}() returned None. Pass a DataLoader.")
        if isinstance(loader, (list, tuple)) and stage != "fit":
            if len(loader) != 1:
                raise ValueError(f"Trainer.{stage} takes one DataLoader; got {len(loader)}.")
            loader = loader[0]
        return loader

    def _check_run_length(self, loader: Any) -> None:
        if self.max_epochs is None and self.max_steps == -1:
            if loader_length(loader) is None:
                raise ValueError(
                    "The training loader has no length (an IterableDataset) and neither max_epochs nor "
                    "max_steps is set, so training would never end. Pass Trainer(max_steps=N) or max_epochs=N."
                )
            warnings.warn("Neither max_epochs nor max_steps is set; training stops after max_epochs=1000.", stacklevel=3)
            self.max_epochs = 1000

    def _prepare_loader(self, loader: Any, stage: str, shuffle: bool) -> Any:
        """The strategy's shard of ``loader``, seeded workers, and its number of batches."""
        if isinstance(loader, torch.utils.data.DataLoader) and self.seed is not None and loader.num_workers > 0 and loader.worker_init_fn is None:
            loader = rebuild_dataloader(loader, worker_init_fn=seed_worker_of_rank(self.strategy.global_rank))
        loader = self.strategy.setup_dataloader(loader, shuffle=shuffle)
        length = loader_length(loader)
        if length == 0:
            raise ValueError(f"The {stage} DataLoader is empty (len 0). Check the dataset and batch_size/drop_last.")
        count = limited_length(length, self.limits[stage])
        if count == 0 and stage == "train":
            raise ValueError("limit_train_batches=0 leaves no batch to train on; use a value > 0.")
        if stage == "train":
            self.num_training_batches = math.inf if count is None else count
        else:
            self.num_val_batches = math.inf if count is None else count
        return loader

    # =========================================================================================
    # Checkpoint state
    # =========================================================================================
    def _checkpoint_state(self) -> dict[str, Any]:
        module = self.strategy.unwrap(self.model) if self.model is not None else self.module
        epoch, batches_done = self._loop_position()
        state = {
            "state_dict": module.state_dict(),
            "optimizer_states": [optimizer.state_dict() for optimizer in self.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
            "loops": {"epoch": epoch, "batches_done": batches_done, "global_step": self.global_step,
                      "train_batches_seen": self._train_batches_seen},
            "rng": {"now": capture_rng_state(), "epoch_start": self._epoch_rng},
            "callbacks": {callback.state_key: callback.state_dict() for callback in self.callbacks},
            "hyper_parameters": dict(getattr(module, "hparams", {})),
            "versions": {"torch": torch.__version__, "python": platform.python_version(), "cadence": _version()},
        }
        module.on_save_checkpoint(state)
        return state

    def _loop_position(self) -> tuple[int, int]:
        """Where a resumed run continues: (epoch, batches of it already trained)."""
        if self._in_epoch_end or self.stage != "fit":
            return self.current_epoch + (1 if self._in_epoch_end else 0), 0
        return self.current_epoch, self.batch_idx + 1

    def _restore(self, ckpt_path: str | os.PathLike, weights_only: bool = False) -> None:
        path = self._resolve_ckpt_path(ckpt_path)
        state = checkpoint_io.load_checkpoint(path)
        module = self.module
        module.on_load_checkpoint(state)
        missing, unexpected = module.state_dict().keys() - state["state_dict"].keys(), state["state_dict"].keys() - module.state_dict().keys()
        if missing or unexpected:
            raise ValueError(
                f"Checkpoint {path} does not fit {type(module).__name__}: missing keys {sorted(missing)}, "
                f"unexpected keys {sorted(unexpected)}. Load it into the model class that wrote it."
            )
        module.load_state_dict(state["state_dict"])
        if weights_only:
            return
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizer_states"]):
            optimizer.load_state_dict(optimizer_state)
        for config, scheduler_state in zip(self.lr_scheduler_configs, state["lr_schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        for callback in self.callbacks:
            if callback.state_key in state["callbacks"]:
                callback.load_state_dict(state["callbacks"][callback.state_key])
        loops = state["loops"]
        self.current_epoch, self.global_step = loops["epoch"], loops["global_step"]
        self._train_batches_seen = loops["train_batches_seen"]
        self._resume_position = (loops["epoch"], loops["batches_done"])
        self._epoch_rng = state["rng"]["epoch_start"]
        restore_rng_state(state["rng"]["now"])

    def _resolve_ckpt_path(self, ckpt_path: str | os.PathLike) -> Path:
        if str(ckpt_path) != "last":
            return Path(ckpt_path)
        candidates = sorted(self.default_root_dir.glob("cadence_logs/version_*/checkpoints/last.ckpt"), key=os.path.getmtime)
        if not candidates:
            raise FileNotFoundError(
                f"ckpt_path='last' found no last.ckpt under {self.default_root_dir}/cadence_logs; "
                "pass a checkpoint path, or ckpt_path=None to start fresh."
            )
        return candidates[-1]

    def _next_log_dir(self) -> Path:
        root = self.default_root_dir / "cadence_logs"
        versions = [int(p.name.split("_")[1]) for p in root.glob("version_*") if p.name.split("_")[1].isdigit()]
        return root / f"version_{max(versions, default=-1) + 1}"

    def _handoff_state(self, module: TrainingModule) -> dict[str, Any]:
        """What a spawned rank zero sends back so the caller's objects reflect the run."""
        return {
            "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "current_epoch": self.current_epoch,
            "global_step": self.global_step,
            "callback_metrics": {k: float(v) for k, v in self.callback_metrics.items()},
            "callbacks": {callback.state_key: callback.state_dict() for callback in self.callbacks},
        }

    def _receive_handoff(self, module: TrainingModule, handoff: dict[str, Any]) -> None:
        module.load_state_dict(handoff["state_dict"])
        self.current_epoch, self.global_step = handoff["current_epoch"], handoff["global_step"]
        self.callback_metrics = {k: torch.tensor(v) for k, v in handoff["callback_metrics"].items()}
        for callback in self.callbacks:
            if callback.state_key in handoff["callbacks"]:
                callback.load_state_dict(handoff["callbacks"][callback.state_key])

    # =========================================================================================
    # Small helpers
    # =========================================================================================
    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size


@dataclasses.dataclass
class _EvaluationHooks:
    """The hooks of one evaluation stage, as bound methods (no hook is looked up by name)."""

    step: Any
    start: list[Any]
    epoch_start: Any
    batch_end: list[Any]
    epoch_end: Any
    end: list[Any]


def _evaluation_hooks(stage: str, callbacks: list[Callback], module: TrainingModule) -> _EvaluationHooks:
    if stage == "validate":
        return _EvaluationHooks(
            module.validation_step,
            [c.on_validation_start for c in callbacks] + [lambda trainer, m: m.on_validation_start()],
            module.on_validation_epoch_start, [c.on_validation_batch_end for c in callbacks],
            module.on_validation_epoch_end,
            [c.on_validation_end for c in callbacks] + [lambda trainer, m: m.on_validation_end()],
        )
    if stage == "test":
        return _EvaluationHooks(
            module.test_step,
            [c.on_test_start for c in callbacks] + [lambda trainer, m: m.on_test_start()],
            module.on_test_epoch_start, [c.on_test_batch_end for c in callbacks],
            module.on_test_epoch_end,
            [c.on_test_end for c in callbacks] + [lambda trainer, m: m.on_test_end()],
        )
    return _EvaluationHooks(
        module.predict_step,
        [c.on_predict_start for c in callbacks] + [lambda trainer, m: m.on_predict_start()],
        module.on_predict_epoch_start, [c.on_predict_batch_end for c in callbacks],
        module.on_predict_epoch_end,
        [c.on_predict_end for c in callbacks] + [lambda trainer, m: m.on_predict_end()],
    )


def _loss_of(outputs: Any, batch_idx: int) -> torch.Tensor:
    """The loss in what training_step returned, checked without reading its value."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        if outputs is None:
            raise RuntimeError(
                f"training_step returned None at batch {batch_idx}. Return the loss tensor, or a dict "
                'with a "loss" key.'
            )
        what = "a dict without a 'loss' key" if isinstance(outputs, dict) else type(loss).__name__
        raise RuntimeError(
            f"training_step returned {what} at batch {batch_idx}. Return the loss tensor, or a dict "
            'with a "loss" key.'
        )
    if loss.dim() != 0:
        raise RuntimeError(
            f"training_step returned a loss of shape {tuple(loss.shape)} at batch {batch_idx}; the "
            "loss must be a scalar. Reduce it (loss.mean()) before returning."
        )
    return loss


def _single_owner(callbacks: list[Callback], attribute: str) -> Callback | None:
    owners = [callback for callback in callbacks if getattr(callback, attribute)]
    if len(owners) > 1:
        names = " and ".join(type(owner).__name__ for owner in owners)
        raise ValueError(f"{names} both set {attribute}=True; one callback may own that seam. Remove one of them.")
    return owners[0] if owners else None


def _overrides(module: Any, name: str) -> bool:
    return getattr(type(module), name, None) is not getattr(TrainingModule, name)


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


class _SkipBatches:
    """A batch sampler that drops the first ``skip`` batches of another: resuming costs indices, not I/O."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self):
        iterator = iter(self.batch_sampler)
        for _ in range(self.skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


def _skip_batches(loader: Any, skip: int) -> Any:
    if isinstance(loader, torch.utils.data.DataLoader) and loader.batch_sampler is not None:
        return rebuild_dataloader(loader, batch_sampler=_SkipBatches(loader.batch_sampler, skip))
    warnings.warn(
        f"Resuming mid-epoch on a loader without a batch sampler ({type(loader).__name__}); the "
        f"{skip} batches already trained are fetched and dropped.",
        stacklevel=2,
    )
    iterator = iter(loader)
    for _ in range(skip):
        next(iterator, None)
    return iterator


def _use_deterministic_algorithms() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _check_positive_int(value: Any, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Trainer({name}={value!r}): use an int >= 1{' or None' if allow_none else ''}.")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("torchcadence")
    except Exception:  # not installed (running from a checkout)
        return "unknown"
