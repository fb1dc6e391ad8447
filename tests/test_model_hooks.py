"""Lightning's model hooks around the model's mode, gradient clipping and scheduler steps: an override
runs where Lightning runs it (its code used to be skipped with a warning); hooks Lightning 2 refuses
are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linear_regression import LinearRegression


def weights(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


# --- lr_scheduler_step --------------------------------------------------------------------
class EpochScheduler:
    """A scheduler of another API (timm's kind): ``step(epoch)`` sets the rate; not a torch one."""

    def __init__(self, optimizer, rates):
        self.optimizer, self.rates, self.epochs = optimizer, rates, []

    def step(self, epoch):
        self.epochs.append(epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = self.rates[epoch]

    def state_dict(self):
        return {"epochs": list(self.epochs)}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


class WithEpochScheduler(LinearRegression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.scheduler = EpochScheduler(optimizer, rates=[0.05, 0.02, 0.01])
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step(epoch=self.current_epoch)


def test_lr_scheduler_step_steps_a_scheduler_of_another_api_each_epoch(make_trainer, regression_loader):
    module = WithEpochScheduler()
    trainer = make_trainer(max_epochs=3, limit_val_batches=0)
    trainer.fit(module, regression_loader)
    # Lightning steps an "epoch" scheduler at each epoch's end, with current_epoch still that epoch.
    assert module.scheduler.epochs == [0, 1, 2]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01


def test_a_scheduler_of_another_api_without_lr_scheduler_step_is_refused_before_training(
        make_trainer, regression_loader):
    class NoStepHook(WithEpochScheduler):
        lr_scheduler_step = LinearRegression.lr_scheduler_step

    module = NoStepHook()
    before = weights(module)
    # Lightning 2.6.5's words first (its test_manual_optimization_with_non_pytorch_scheduler[True])
    with pytest.raises(TypeError, match=r"^The provided lr scheduler `EpochScheduler` doesn't follow PyTorch's "
                                        r"LRScheduler API\..*override lr_scheduler_step\(self, scheduler, metric\)"):
        make_trainer(max_epochs=1, limit_val_batches=0).fit(module, regression_loader)
    assert torch.equal(weights(module), before)


def test_a_scheduler_without_a_step_method_is_stepped_by_lr_scheduler_step(make_trainer, regression_loader):
    # As Lightning: only state_dict/load_state_dict are required of a scheduler; how it steps is the
    # module's lr_scheduler_step (Cadence refused one without .step() before training).
    class Halving:
        def __init__(self, optimizer):
            self.optimizer, self.advances = optimizer, 0

        def advance(self):
            self.advances += 1
            for group in self.optimizer.param_groups:
                group["lr"] /= 2

        def state_dict(self):
            return {"advances": self.advances}

        def load_state_dict(self, state):
            self.advances = state["advances"]

    class Custom(LinearRegression):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            self.scheduler = Halving(optimizer)
            return [optimizer], [self.scheduler]

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.advance()

    module = Custom()
    trainer = make_trainer(max_epochs=2, limit_val_batches=0)
    trainer.fit(module, regression_loader)
    assert module.scheduler.advances == 2  # once per epoch, the default interval
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


def test_lr_scheduler_step_gets_the_monitored_value_for_reduce_on_plateau(make_trainer, regression_loader):
    seen = []

    class Plateau(LinearRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_epoch=True, on_step=False)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "train_loss"}

        def lr_scheduler_step(self, scheduler, metric):
            seen.append((type(scheduler).__name__, metric, self.trainer.callback_metrics["train_loss"]))
            super().lr_scheduler_step(scheduler, metric)

    make_trainer(max_epochs=2, limit_val_batches=0).fit(Plateau(), regression_loader)
    assert [name for name, _, _ in seen] == ["ReduceLROnPlateau"] * 2
    assert all(torch.equal(torch.as_tensor(metric), logged) for _, metric, logged in seen)


# --- configure_gradient_clipping and clip_gradients -----------------------------------------
def one_step_change(make_trainer, module, **trainer_arguments) -> float:
    """The 2-norm of what one SGD step at lr 1 moved: the clipped gradient's norm."""
    before = weights(module)
    make_trainer(max_steps=1, limit_val_batches=0, **trainer_arguments).fit(module, regression_loader_of_one())
    return float((weights(module) - before).norm())


def regression_loader_of_one():
    from linear_regression import regression_samples
    x, y = regression_samples(8)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def test_configure_gradient_clipping_runs_at_each_step_with_the_trainers_settings(make_trainer):
    calls = []

    class OwnClipping(LinearRegression):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            calls.append((type(optimizer).__name__, gradient_clip_val, gradient_clip_algorithm))
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")

    unclipped = one_step_change(make_trainer, LinearRegression(lr=1.0))
    assert unclipped > 0.1  # so that a clip at 0.01 shows
    assert one_step_change(make_trainer, OwnClipping(lr=1.0)) == pytest.approx(0.01, rel=1e-4)
    assert calls == [("SGD", None, None)]  # Lightning calls it even when the Trainer clips nothing, with its None


def test_clip_gradients_without_a_value_uses_the_trainers_and_a_different_one_is_an_error(make_trainer):
    torch.manual_seed(0)  # the modules' weights: ByValue's 10 gradient elements all beyond 0.02 (not every draw's)
    class DefaultClipping(LinearRegression):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer)

    assert one_step_change(make_trainer, DefaultClipping(lr=1.0), gradient_clip_val=0.02) == pytest.approx(0.02, rel=1e-4)

    class OtherValue(LinearRegression):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.5)

    # Lightning 2.6.5's words (its test_lightning_module_configure_gradient_clipping_different_argument_values)
    with pytest.raises(ValueError, match=r"You have set `Trainer\(gradient_clip_val=0.02\)` and have passed "
                                         r"`clip_gradients\(gradient_clip_val=0.5\)`\. Please use only one of them"):
        one_step_change(make_trainer, OtherValue(lr=1.0), gradient_clip_val=0.02)

    class ByValue(LinearRegression):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")

    # With no algorithm given to the Trainer the module's choice stands: each of the 10 gradient elements is cut
    # to 0.02 (by norm, the whole step would be 0.02 long)...
    assert one_step_change(make_trainer, ByValue(lr=1.0)) == pytest.approx(0.02 * 10 ** 0.5, rel=1e-4)
    # ...and a different one given to both is Lightning's error, in its words.
    with pytest.raises(ValueError, match=r"You have set `Trainer\(gradient_clip_algorithm='norm'\)` and have passed "
                                         r"`clip_gradients\(gradient_clip_algorithm='value'\) Please use only one"):
        one_step_change(make_trainer, ByValue(lr=1.0), gradient_clip_algorithm="NORM")


def test_a_gradient_clip_val_of_zero_clips_nothing_as_in_lightning(make_trainer):
    # Lightning 2.6.5 takes Trainer(gradient_clip_val=0) and clips nothing (its precision plugin returns when
    # clip_val <= 0; its test_precision_16_clip_gradients[0] checks clip_grad_norm_ is not called).
    torch.manual_seed(0)
    unclipped = one_step_change(make_trainer, LinearRegression(lr=1.0))
    torch.manual_seed(0)
    assert one_step_change(make_trainer, LinearRegression(lr=1.0), gradient_clip_val=0) == pytest.approx(unclipped)
    assert unclipped > 0.1


# --- the model's mode around evaluation -------------------------------------------------------
class WithDropout(LinearRegression):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.modes: list[tuple[str, bool]] = []

    def validation_step(self, batch, batch_idx):
        self.modes.append(("validation", self.dropout.training))
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(self.dropout(x)), y))

    def test_step(self, batch, batch_idx):
        self.modes.append(("test", self.dropout.training))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.modes.append(("predict", self.dropout.training))
        return self.layer(batch[0])


def test_model_eval_overrides_keep_dropout_on_and_the_modes_come_back(make_trainer, regression_loader):
    class MonteCarlo(WithDropout):
        def on_validation_model_eval(self):
            super().on_validation_model_eval()
            self.dropout.train()

        def on_test_model_eval(self):
            self.eval()
            self.dropout.train()

        def on_predict_model_eval(self):
            self.eval()
            self.dropout.train()

    module = MonteCarlo()
    module.layer.eval()  # a submodule the user froze in eval mode keeps it after each stage
    trainer = make_trainer(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    trainer.test(module, regression_loader)
    trainer.predict(module, regression_loader)
    assert set(module.modes) == {("validation", True), ("test", True), ("predict", True)}
    assert module.training and module.dropout.training and not module.layer.training

    plain = WithDropout()
    trainer = make_trainer(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(plain, regression_loader, regression_loader)
    trainer.test(plain, regression_loader)
    assert set(plain.modes) == {("validation", False), ("test", False)}


def test_model_train_overrides_replace_giving_the_modes_back(make_trainer, regression_loader):
    class Overrides(WithDropout):
        def on_validation_model_train(self):
            self.train()
            self.dropout.eval()

        def on_test_model_train(self):
            self.train()
            self.layer.eval()

    module = Overrides()
    trainer = make_trainer(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(module, regression_loader, regression_loader)
    assert not module.dropout.training and module.layer.training  # after fit's validation: the override's modes
    trainer.test(module, regression_loader)
    assert module.dropout.training and not module.layer.training


def test_on_validation_model_zero_grad_runs_before_each_validation_inside_fit_only(make_trainer, regression_loader):
    class Counting(WithDropout):
        calls = 0

        def on_validation_model_zero_grad(self):
            self.calls += 1
            super().on_validation_model_zero_grad()

    module = Counting()
    trainer = make_trainer(max_epochs=2, limit_val_batches=1, val_check_interval=4, num_sanity_val_steps=1)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.calls == 4  # twice an epoch (after batches 4 and 8), not for the sanity check
    trainer.validate(module, regression_loader)
    assert module.calls == 4


# --- hooks Lightning 2 refuses or renamed --------------------------------------------------
@pytest.mark.parametrize("hook, instead", [
    ("training_epoch_end", "use on_train_epoch_end"),
    ("validation_epoch_end", "use on_validation_epoch_end"),
])
def test_hooks_lightning_2_refuses_are_errors_before_training(
        make_trainer, regression_loader, hook, instead):
    module = type("Old", (LinearRegression,), {hook: lambda self, *args, **kwargs: None})()
    before = weights(module)
    with pytest.raises(NotImplementedError, match=rf"Old defines {hook}, which Cadence does not call: .*{instead}"):
        make_trainer(max_epochs=1).fit(module, regression_loader, regression_loader)
    assert torch.equal(weights(module), before)


def test_a_removed_epoch_end_hook_is_refused_by_the_stages_that_would_run_it_as_lightning(make_trainer, regression_loader):
    # lightning-bolts' SAC keeps a test_epoch_end: Lightning 2.6.5 fits it and refuses it in test only (predict
    # refuses none); Cadence refused the fit.
    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    module = type("KeepsTestEpochEnd", (LinearRegression,), {
        "test_epoch_end": lambda self, outputs: None, "test_step": test_step,
        "predict_step": lambda self, batch, batch_idx: self.layer(batch[0])})()
    trainer = make_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match=r"KeepsTestEpochEnd defines test_epoch_end, which Cadence never calls: .*test "
                                         r"refuses it"):
        trainer.fit(module, regression_loader)
    assert trainer.global_step == 8
    assert len(trainer.predict(module, regression_loader)) == 8
    with pytest.raises(NotImplementedError, match=r"KeepsTestEpochEnd defines test_epoch_end, which Cadence does not call"):
        trainer.test(module, regression_loader)


def test_a_backward_override_runs_in_place_of_loss_backward_also_for_manual_backward(make_trainer, regression_loader):
    seen = []

    class HalvedGradients(LinearRegression):
        def backward(self, loss, *args, **kwargs):
            seen.append(float(loss.detach()))
            (loss / 2).backward(*args, **kwargs)

    plain, halved = LinearRegression(lr=1.0), HalvedGradients(lr=1.0)
    halved.load_state_dict(plain.state_dict())
    start = weights(plain)
    for module in (plain, halved):
        make_trainer(max_steps=1, limit_val_batches=0, accumulate_grad_batches=2).fit(module, regression_loader)
    assert len(seen) == 2  # each batch of the window, with the loss divided by accumulate_grad_batches
    assert torch.allclose(weights(halved) - start, (weights(plain) - start) / 2)

    class Manual(HalvedGradients):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            self.manual_backward(super().training_step(batch, batch_idx))

    seen.clear()
    make_trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(Manual(), regression_loader)
    assert len(seen) == 3


def test_configure_sharded_model_is_called_with_a_deprecation_warning(make_trainer, regression_loader):
    class Late(LinearRegression):
        def __init__(self):
            super().__init__()
            self.head = None

        def configure_sharded_model(self):
            if self.head is None:
                self.head = nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.layer(x)), y)

    module = Late()
    with pytest.warns(FutureWarning, match="Late.configure_sharded_model is deprecated"):
        make_trainer(max_steps=2, limit_val_batches=0).fit(module, regression_loader)
    assert isinstance(module.head, nn.Linear)

    class Both(Late):
        def configure_model(self):
            pass

    with pytest.raises(RuntimeError, match="Both Both.configure_model and Both.configure_sharded_model are defined"):
        make_trainer(max_steps=2, limit_val_batches=0).fit(Both(), regression_loader)
