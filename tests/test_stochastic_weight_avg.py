"""Lightning's StochasticWeightAveraging: SWALR from swa_epoch_start, the epoch-start average in the
module after fit, BatchNorm statistics recomputed with it, and a resume that continues with SWALR."""

from __future__ import annotations

import pytest
import torch
from linear_regression import LinearRegression
from torch import nn

from callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging


class Normalized(LinearRegression):
    """BatchNorm on the inputs, then the linear layer; records the LR and the weights of each epoch."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.lrs, self.weights = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(self.norm(x)), y)

    def on_train_epoch_start(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.weights.append(self.layer.weight.detach().clone())


def fit(make_trainer, loader, tmp_path=None, ckpt_path=None, max_epochs=4):
    torch.manual_seed(0)
    module = Normalized()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=1, annealing_strategy="linear")
    saving = [ModelCheckpoint(tmp_path, filename="{epoch}", save_top_k=-1, save_last=False)] if tmp_path else []
    make_trainer(max_epochs=max_epochs, callbacks=[swa, *saving], enable_checkpointing=bool(saving)).fit(
        module, loader, ckpt_path=ckpt_path)
    return module


def test_swa_averages_from_its_start_epoch_with_swalr_and_updates_batch_norm(make_trainer, regression_loader, tmp_path):
    module = fit(make_trainer, regression_loader, tmp_path)
    # SWA starts in epoch 2 (0-based): SWALR anneals linearly to 0.05 over one epoch, from epoch 3 on.
    assert module.lrs == [0.1, 0.1, 0.1, 0.05]
    # Averaged at the start of epochs 2 and 3: the weights after epochs 1 and 2.
    torch.testing.assert_close(module.layer.weight.detach(), (module.weights[2] + module.weights[3]) / 2)
    # One pass with momentum None: the running mean is the mean of the batch means.
    batch_means = torch.stack([x.mean(0) for x, _ in regression_loader])
    torch.testing.assert_close(module.norm.running_mean, batch_means.mean(0))
    assert module.norm.momentum == 0.1  # given back
    # Resumed after SWA started (the checkpoint of epoch 2): SWALR, the average and its count continue.
    resumed = fit(make_trainer, regression_loader, ckpt_path=tmp_path / "epoch=2.ckpt")
    assert resumed.lrs == [0.05]
    torch.testing.assert_close(resumed.layer.weight, module.layer.weight)
    torch.testing.assert_close(resumed.norm.running_var, module.norm.running_var)


def test_bad_swa_arguments_say_what_to_pass(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"swa_epoch_start should be a >0 integer or a float between 0 and 1"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=0)
    with pytest.raises(ValueError, match=r"The `swa_lrs` should a positive float, or a list of positive floats"):
        StochasticWeightAveraging(swa_lrs=[0.2, 1])

    class TwoOptimizers(LinearRegression):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)

    module = TwoOptimizers()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match=r"SWA currently works with 1 `optimizer`; configure_optimizers returned 2"):
        make_trainer(max_epochs=1, callbacks=[StochasticWeightAveraging(swa_lrs=0.1)]).fit(module, regression_loader)


def test_swa_batch_norm_pass_runs_a_training_step_that_logs(make_trainer, regression_loader):
    # A training_step that calls self.log (most do): Lightning runs the BatchNorm pass as an extra training epoch,
    # where logging is allowed; Cadence's pass after training must neither raise nor change the run's values.
    class Logs(Normalized):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_epoch=True)
            return loss

    class Before(Callback):  # its on_train_end runs before SWA's (the callbacks' order)
        def on_train_end(self, trainer, module):
            self.values = {name: value.clone() for name, value in trainer.callback_metrics.items()}

    torch.manual_seed(0)
    module, before = Logs(), Before()
    trainer = make_trainer(max_epochs=4, callbacks=[before, StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3)])
    trainer.fit(module, regression_loader)
    batch_means = torch.stack([x.mean(0) for x, _ in regression_loader])
    torch.testing.assert_close(module.norm.running_mean, batch_means.mean(0))  # the pass ran
    assert trainer.callback_metrics.keys() == before.values.keys() == {"train_loss", "train_loss_step", "train_loss_epoch"}
    assert all(torch.equal(trainer.callback_metrics[name], value) for name, value in before.values.items())  # logged nothing


def test_a_stop_at_swas_last_epoch_skips_the_batch_norm_update_as_lightnings_extra_epoch(make_trainer, regression_loader):
    # Lightning updates BatchNorm in an epoch it adds after the last one; EarlyStopping (or max_steps) ending
    # training at the last epoch skips it: the average is transferred, the running statistics stay training's.
    class StopsAtTheEnd(Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = trainer.current_epoch == 3

        def on_train_end(self, trainer, module):
            self.running_mean = module.norm.running_mean.clone()

    torch.manual_seed(0)
    module, stops = Normalized(), StopsAtTheEnd()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=3, annealing_epochs=1, annealing_strategy="linear")
    make_trainer(max_epochs=4, callbacks=[stops, swa]).fit(module, regression_loader)
    torch.testing.assert_close(module.layer.weight.detach(), (module.weights[2] + module.weights[3]) / 2)
    assert torch.equal(module.norm.running_mean, stops.running_mean)
