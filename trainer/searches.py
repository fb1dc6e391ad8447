"""The seams the Tuner's searches run through: ``Trainer.run_search``, ``run_trial`` and
``reload_dataloaders`` (trainer/tuner.py, callbacks/lr_finder.py, callbacks/batch_size_finder.py).

They are methods of the Trainer, which inherits them from :class:`SearchSeams`, so that
``trainer/trainer.py`` stays the loop: a search sets a stage up as the loop does, and a trial runs
the loop's own methods for a few steps with the Trainer's state kept aside (``trainer/trial.py``
says what is kept and how it comes back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from callbacks import Callback
from trainer.data_source import collect_data, reloadable
from trainer.hooks import step_hooks
from trainer.scheduler_config import SchedulerConfig
from trainer.setup import replaced_optimizers
from trainer.trial import Snapshot, fresh_loop_state

if TYPE_CHECKING:
    from trainer.datamodule import DataModule
    from trainer.module import TrainingModule
    from trainer.trainer import Trainer


class SearchSeams:
    """``run_search``, ``run_trial``, ``reload_dataloaders`` and ``replace_optimizers``, which :class:`trainer.Trainer`
    inherits."""

    def run_search(self: Trainer, search: Callable[[Trainer, TrainingModule], Any], model: TrainingModule, method: str = "fit",
                   train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
                   datamodule: DataModule | None = None) -> Any:
        """Set ``model`` up as ``method`` does, run ``search(trainer, module)`` in place of its loop (of the hooks, only
        setup and teardown run), tear down; return what ``search`` returned (rank zero's, when spawned)."""
        data = collect_data(method, model, train_dataloaders if method == "fit" else dataloaders, val_dataloaders,
                            datamodule, previous_datamodule=self.datamodule, validates=self.limits["validate"] != 0)
        return self._launch(method, model, data, None, search)

    def run_trial(self: Trainer, num_steps: int, callbacks: list[Callback] = (),
                  schedulers: Callable[[list[torch.optim.Optimizer]], list[Any]] | None = None) -> None:
        """From a hook of a running stage, run its loop for ``num_steps`` optimizer steps (fit: no validation, only the
        schedulers ``schedulers(optimizers)`` makes step) or batches of the first loader (validate, test, predict),
        with only ``callbacks`` and the seam owners (AMP); then put everything back, also after an error."""
        sampler = self._progress.sampler
        snapshot = Snapshot.take(self.module, self.optimizers, self.lr_scheduler_configs, self.callbacks, sampler)
        kept = dict(vars(self))  # every attribute; what the loop changes in place is replaced for the trial
        self.metrics, self._progress, self._guard, self._preemption, self.phase_times = fresh_loop_state(self.strategy, sampler)
        self.callbacks = [*snapshot.seam_owners, *callbacks]
        self._plan = dataclasses.replace(self._plan, hooks=step_hooks(self.callbacks, self.module))
        self.should_stop, self.on_nonfinite_loss, self.min_epochs, self.min_steps = False, "ignore", None, None
        try:
            if self.stage == "fit":
                made = schedulers(self.optimizers) if schedulers is not None else []
                self.lr_scheduler_configs = [SchedulerConfig(scheduler, interval="step") for scheduler in made]
                self.max_epochs, self.max_steps = -1, self.global_step + num_steps
                self._fit_loaders = dataclasses.replace(self._fit_loaders, val=None)
                while not self._finished():
                    self._run_train_epoch()
            else:
                (loader, *_), (count, *_) = self._evaluation_loaders
                self._evaluation_loaders = ([loader], [min(num_steps, count)])
                self._evaluation_loop(self.stage, *self._evaluation_loaders)
        finally:
            vars(self).update(kept)
            snapshot.restore()

    def replace_optimizers(self: Trainer, optimizers: Any) -> None:
        """What ``trainer.strategy.optimizers = [...]`` does during a fit: the loop steps ``optimizers`` from the
        next batch on (trainer/setup.py ``replaced_optimizers``)."""
        self._plan, self.optimizers = replaced_optimizers(self, self._plan, optimizers)

    def reload_dataloaders(self: Trainer) -> list[Any]:
        """Make the running stage's loaders again from their hooks (a search changed the batch size): from on_fit_start
        or on_train_epoch_start the coming epoch runs on them, from on_<stage>_start the stage. Returns them."""
        reloadable(self._data, self.stage)  # or an error saying why not
        self._make_loaders(self.stage, self._data)
        return [self._fit_loaders.shown] if self.stage == "fit" else list(self._evaluation_loaders[0])
