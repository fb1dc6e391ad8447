"""The Trainer's seams for searches: ``run_trial``, ``reload_dataloaders`` and ``run_search``.

A trial run from a hook in the middle of fit must leave nothing behind: the fit goes on exactly as
without it (weights, counters, logged metrics, the optimizer's state), also when the trial fails.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import Callback
from linear_regression import LinearRegression
from trainer import Trainer


class Logged(LinearRegression):
    """Logs its loss, trains with Adam (a state that a trial would change) and makes its own loader."""

    def __init__(self, data) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer.reset_parameters()
        self.data = data

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8, shuffle=True)


class Failing(Callback):
    """Raises at the trial's second batch: the trial's own callback."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("the trial failed")


class TrialAtEpochStart(Callback):
    """Runs a trial of five steps at the start of epoch 1 (one that fails, with ``fail``) and records
    what the Trainer says before and after it."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.seen = fail, []

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch != 1:
            return
        before = (trainer.global_step, trainer.batch_idx, dict(trainer.callback_metrics), trainer.callbacks)
        if self.fail:
            with pytest.raises(RuntimeError, match="the trial failed"):
                trainer.run_trial(5, callbacks=[Failing()])
        else:
            trainer.run_trial(5)
        self.seen = [before, (trainer.global_step, trainer.batch_idx, dict(trainer.callback_metrics),
                              trainer.callbacks)]


def fit(make_trainer, data, callbacks=()) -> tuple[LinearRegression, Trainer]:
    module = Logged(data)
    trainer = make_trainer(max_epochs=3, seed=1, callbacks=list(callbacks))
    trainer.fit(module)
    return module, trainer


@pytest.mark.parametrize("fail", [False, True])
def test_a_trial_mid_fit_leaves_the_run_exactly_as_without_it(make_trainer, regression_data, fail):
    plain, plain_trainer = fit(make_trainer, regression_data)
    trial = TrialAtEpochStart(fail)
    tried, trainer = fit(make_trainer, regression_data, [trial])
    before, after = trial.seen
    assert before[:2] == after[:2] == (8, -1)
    assert before[2].keys() == after[2].keys() and all(torch.equal(before[2][k], after[2][k]) for k in before[2])
    assert before[3] is after[3]  # the Trainer's own callback list, not the trial's
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tried.state_dict()[name]), name
    assert trainer.global_step == plain_trainer.global_step == 24
    assert torch.equal(trainer.callback_metrics["train_loss_epoch"], plain_trainer.callback_metrics["train_loss_epoch"])


def test_the_seams_outside_a_stage_say_where_to_call_them(make_trainer):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match=r"run_trial runs the loop of a running stage: call it from a hook"):
        trainer.run_trial(3)
    with pytest.raises(RuntimeError, match=r"reload_dataloaders\(\) remakes the loaders of a running stage"):
        trainer.reload_dataloaders()


def test_reload_dataloaders_refuses_loaders_passed_to_fit(make_trainer, regression_data):
    class Reloads(Callback):
        def on_fit_start(self, trainer, module):
            trainer.reload_dataloaders()

    trainer = make_trainer(max_epochs=1, callbacks=[Reloads()])
    with pytest.raises(ValueError, match=r"cannot remake loaders passed as Trainer.fit\(train_dataloaders=...\). "
                                         r"Return them from train_dataloader\(\)"):
        trainer.fit(LinearRegression(), DataLoader(regression_data, batch_size=8))


def test_reload_dataloaders_from_on_fit_start_trains_the_epoch_on_the_new_loaders(make_trainer, regression_data):
    class Resized(Logged):
        batch_size = 8

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=self.batch_size)

    class Reloads(Callback):
        def on_fit_start(self, trainer, module):
            module.batch_size = 16
            self.loaders = trainer.reload_dataloaders()

    reloads, module = Reloads(), Resized(regression_data)
    trainer = make_trainer(max_epochs=1, callbacks=[reloads])
    trainer.fit(module)
    assert trainer.train_dataloader is reloads.loaders[0]
    assert trainer.num_training_batches == 4 and trainer.global_step == 4  # 64 samples in batches of 16, not 8


def test_run_search_names_a_method_it_does_not_know(make_trainer):
    with pytest.raises(ValueError, match=r"run_search\(method='tune'\): use 'fit', 'validate', 'test' or 'predict'"):
        make_trainer().run_search(lambda trainer, module: None, LinearRegression(), method="tune")
