"""configure_optimizers in every format Lightning accepts, LR schedulers, and manual optimization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from linear_regression import LinearRegression, ManualLinearRegression
from strategies import SingleDevice
from trainer import TrainingModule
from trainer.utilities import LRSchedulerConfig


class Model(LinearRegression):
    """Linear regression whose configure_optimizers returns whatever ``make(module)`` builds."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        self.returned = self.make(self)
        return self.returned


def sgd(module, lr=1.0):
    return torch.optim.SGD(module.parameters(), lr=lr)


def lr_of(trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


# --- the accepted formats ------------------------------------------------------------------
def halve_each(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@pytest.mark.parametrize(
    "make, lr_after_two_epochs",
    [
        (lambda m: sgd(m), 1.0),
        (lambda m: [sgd(m)], 1.0),
        (lambda m: (lambda o: ([o], [halve_each(o)]))(sgd(m)), 0.25),  # (optimizers, schedulers): per epoch
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": halve_each(o)})(sgd(m)), 0.25),
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o), "interval": "epoch",
                                                                  "frequency": 2}})(sgd(m)), 0.5),
        # 16 optimizer steps, stepped every 4th: halved 4 times
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o), "interval": "step",
                                                                  "frequency": 4}})(sgd(m)), 1 / 16),
        (lambda m: [(lambda o: {"optimizer": o, "lr_scheduler": halve_each(o)})(sgd(m))], 0.25),  # a list of dicts
    ],
    ids=["optimizer", "list", "tuple-of-lists", "dict", "dict-epoch-frequency", "dict-step-frequency", "list-of-dicts"],
)
def test_configure_optimizers_accepts_the_lightning_formats(make_trainer, regression_loader, make, lr_after_two_epochs):
    trainer = make_trainer(max_epochs=2)
    trainer.fit(Model(make), regression_loader)
    assert lr_of(trainer) == pytest.approx(lr_after_two_epochs)
    assert trainer.global_step == 16


@pytest.mark.parametrize("frequency, accumulate, halvings", [
    (3, 1, 4),  # batches 3 and 6 of each 8-batch epoch (not global steps 3, 6, 9, 12, 15)
    (2, 2, 8),  # windows end at batches 2, 4, 6, 8 of each epoch: every one is a multiple of 2
])
def test_a_step_schedulers_frequency_counts_the_epochs_batches_as_lightning(make_trainer, regression_loader,
                                                                           frequency, accumulate, halvings):
    # Lightning's _update_learning_rates: current_idx = batch_idx + 1 for "step", stepped at a window's end when
    # current_idx % frequency == 0 (UvA-DL-style warm-up schedules counted per batch keep their curve).
    def make(module):
        optimizer = sgd(module)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": halve_each(optimizer), "interval": "step", "frequency": frequency}}

    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=accumulate)
    trainer.fit(Model(make), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.5 ** halvings)


class Plateau(Model):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", 1.0)  # never improves


def halving_plateau(module):
    """SGD with a ReduceLROnPlateau that halves the rate at each epoch 'val/loss' does not improve."""
    optimizer = sgd(module)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}}


def test_reduce_lr_on_plateau_steps_on_the_monitored_metric(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(Plateau(halving_plateau), regression_loader, regression_loader)
    assert lr_of(trainer) == pytest.approx(0.25)  # epoch 1 sets the best; epochs 2 and 3 halve


def test_reduce_lr_on_plateau_without_monitor_is_an_error(make_trainer, regression_loader):
    def make(module):
        optimizer = sgd(module)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}

    with pytest.raises(ValueError, match="ReduceLROnPlateau without a metric to watch"):
        make_trainer(max_epochs=1).fit(Model(make), regression_loader)


def test_reduce_lr_on_plateau_watching_an_unlogged_metric_is_an_error(make_trainer, regression_loader):
    def make(module):
        optimizer = sgd(module)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val/acc"}}

    with pytest.raises(RuntimeError, match="ReduceLROnPlateau watches 'val/acc', which was not logged"):
        make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Plateau(make), regression_loader, regression_loader)


def test_reduce_lr_on_plateau_is_not_stepped_when_max_steps_ends_the_epoch_early(make_trainer, regression_loader):
    # As in Lightning, epoch schedulers step only at an epoch's last batch: max_steps=3 of 8 batches ends fit
    # before any validation, so the plateau scheduler is not asked for 'val/loss' (no error) and keeps its lr.
    trainer = make_trainer(max_steps=3, num_sanity_val_steps=0)
    model = Plateau(halving_plateau)
    trainer.fit(model, regression_loader, regression_loader)
    assert trainer.global_step == 3 and lr_of(trainer) == 1.0
    assert model.returned["lr_scheduler"]["scheduler"].last_epoch == 0


def test_a_step_interval_reduce_lr_on_plateau_reads_this_batchs_value(make_trainer, regression_loader):
    # Lightning steps a "step" ReduceLROnPlateau with the value training_step logged in that batch (no log step
    # needed): a constant 1.0 sets the best at batch 1, then batches 2, 3 and 4 each halve the rate.
    class Flat(Model):
        def training_step(self, batch, batch_idx):
            self.log("flat", 1.0)
            return super().training_step(batch, batch_idx)

    def make(module):
        optimizer = sgd(module)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "flat", "interval": "step"}}

    trainer = make_trainer(max_epochs=1, limit_train_batches=4)
    trainer.fit(Flat(make), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.125)


def test_a_step_interval_reduce_lr_on_plateau_steps_after_the_validation_of_its_batch(make_trainer, regression_loader):
    # Lightning's documented pattern: a "step" ReduceLROnPlateau watching a validation metric, with validation every
    # 2 batches and frequency 2. Lightning steps it after on_train_batch_end and that batch's validation, so it
    # reads the validation just run (Lightning 2.6.5: 20.5, 40.5, 60.5, 80.5 for this module), and a checkpoint
    # written at that validation holds the scheduler before its step.
    seen = []

    class WatchesValidation(Model):
        def validation_step(self, batch, batch_idx):
            self.log("val_metric", float(10 * self.global_step + batch_idx))

        def lr_scheduler_step(self, scheduler, metric):
            seen.append((self.global_step, float(metric)))
            super().lr_scheduler_step(scheduler, metric)

    def make(module):
        optimizer = sgd(module)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return [optimizer], [{"scheduler": plateau, "interval": "step", "frequency": 2, "monitor": "val_metric"}]

    trainer = make_trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=2, val_check_interval=2,
                           num_sanity_val_steps=0)
    trainer.fit(WatchesValidation(make), regression_loader, regression_loader)
    assert seen == [(2, 20.5), (4, 40.5), (6, 60.5), (8, 80.5)]


def test_unknown_keys_in_the_optimizer_dicts_warn_as_in_lightning_and_are_left_out(make_trainer, regression_loader):
    # Lightning 2.6.5's RuntimeWarnings (its test_lr_scheduler_with_extra_keys_warns); the scheduler still steps.
    def make(module):
        optimizer = sgd(module)
        return {"optimizer": optimizer, "foo": 1, "lr_scheduler": {"scheduler": halve_each(optimizer), "bar": 2}}

    trainer = make_trainer(max_epochs=2)
    with pytest.warns(RuntimeWarning, match=r"Found unsupported keys in the lr scheduler dict: \{'bar'\}. HINT: "
                                            "remove them from the output of `configure_optimizers`"), \
            pytest.warns(RuntimeWarning, match=r"Found unsupported keys in the optimizer configuration: \{'foo'\}"):
        trainer.fit(Model(make), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.25)


def test_reduce_on_plateau_key_is_accepted_when_it_says_what_the_scheduler_is(make_trainer, regression_loader):
    def make(flag):
        return lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o),
                                                                        "reduce_on_plateau": flag}})(sgd(m))

    trainer = make_trainer(max_epochs=2)
    trainer.fit(Model(make(False)), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="reduce_on_plateau=True in dict 0: Cadence steps a torch ReduceLROnPlateau"):
        make_trainer(max_epochs=1).fit(Model(make(True)), regression_loader)


# --- what is refused ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: "adam", "configure_optimizers returned 'adam'"),
        (lambda m: [sgd(m), "sgd"], "returned str where an optimizer was expected"),
        (lambda m: {"lr_scheduler": None}, "dict 0 has no 'optimizer' key"),
        (lambda m: {"optimizer": sgd(m), "lr_scheduler": {"interval": "step"}},
         'The lr scheduler dict must have the key "scheduler" with its item being an lr scheduler'),
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o), "interval": "batch"}})(sgd(m)),
         'interval=\'batch\' in dict 0; use "step" or "epoch"'),
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o), "frequency": 0}})(sgd(m)),
         "frequency=0 in dict 0; use a whole number >= 1"),
        (lambda m: {"optimizer": sgd(m), "lr_scheduler": 0.5}, "returned float as an LR scheduler"),
        (lambda m: [sgd(m), sgd(m)], "returned 2 optimizers: set `self.automatic_optimization = False`"),
        # Lightning: a scheduler made from an optimizer that is not returned would change nothing that trains
        (lambda m: ([sgd(m)], [halve_each(sgd(m))]), "attached with an optimizer that wasn't returned"),
    ],
    ids=["string", "not-an-optimizer", "no-optimizer-key", "no-scheduler-key", "bad-interval",
         "bad-frequency", "not-a-scheduler", "two-optimizers-automatic", "scheduler-of-another-optimizer"],
)
def test_configure_optimizers_returning_something_unknown_is_an_error(make_trainer, regression_loader, make, match):
    with pytest.raises(ValueError, match=match):
        make_trainer(max_epochs=1).fit(Model(make), regression_loader)


class LightningOneStep(Model):
    """Lightning 1.x's signature: training_step called once per optimizer with its index."""

    def training_step(self, batch, batch_idx, optimizer_idx):
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("automatic", [True, False])
def test_a_training_step_taking_lightning_1s_optimizer_idx_is_refused_before_training(make_trainer, regression_loader,
                                                                                        automatic):
    # Lightning 2.6.5 raises this RuntimeError (its test_multiple_optimizers_automatic_optimization_raises)
    # whatever the optimization mode; Cadence called training_step without it: a bare TypeError mid-fit.
    model = LightningOneStep(lambda m: sgd(m))
    model.automatic_optimization = automatic
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="Remove the `optimizer_idx` argument from `training_step`"):
        make_trainer(max_epochs=1).fit(model, regression_loader)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_two_optimizers_under_automatic_optimization_is_lightnings_runtime_error(make_trainer, regression_loader):
    # Lightning 2.6.5: RuntimeError "Training with multiple optimizers is only supported with manual optimization"
    with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
        make_trainer(max_epochs=1).fit(Model(lambda m: (sgd(m), sgd(m))), regression_loader)


@pytest.mark.parametrize(
    "make, lightnings_words",
    [  # the regexes of Lightning 2.6.5's own tests (trainer/optimization/test_optimizers.py)
        (lambda m: 1, "Unknown configuration for model optimizers"),
        (lambda m: {"optimizer": sgd(m), "lr_scheduler": {}}, 'The lr scheduler dict must have the key "scheduler"'),
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": halve_each(o), "interval": "incorrect"}})(
            sgd(m)), 'The "interval" key in lr scheduler dict must be'),
        (lambda m: (lambda o: {"optimizer": o, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o)})(sgd(m)),
         "`configure_optimizers` must include a monitor when a `ReduceLROnPlateau`"),
    ],
    ids=["unknown", "no-scheduler-key", "bad-interval", "plateau-without-monitor"],
)
def test_configure_optimizers_errors_carry_lightnings_words(make_trainer, regression_loader, make, lightnings_words):
    with pytest.raises(ValueError, match=lightnings_words):
        make_trainer(max_epochs=1).fit(Model(make), regression_loader)


def test_a_plateau_watching_an_unlogged_metric_says_so_in_lightnings_words(make_trainer, regression_loader):
    # Lightning 2.6.5's test_lr_scheduler_strict matches this (its MisconfigurationException; a RuntimeError here)
    def make(module):
        optimizer = sgd(module)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "giraffe"}}

    with pytest.raises(RuntimeError, match=r"ReduceLROnPlateau conditioned on metric .* which is not available\. "
                                           r"Available metrics are:"):
        make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Plateau(make), regression_loader, regression_loader)


def test_a_plateau_not_strict_skips_a_step_without_its_metric_with_lightnings_warning(make_trainer, regression_loader):
    # Lightning 2.6.5's test_lr_scheduler_strict[False] matches this warning's words
    def make(module):
        optimizer = sgd(module)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "giraffe", "strict": False}}

    with pytest.warns(RuntimeWarning, match=r"ReduceLROnPlateau conditioned on metric .* which is not available but "
                                            r"strict is set to `False`"):
        make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Plateau(make), regression_loader, regression_loader)


def test_configure_optimizers_returning_none_trains_nothing_with_a_warning_as_in_lightning(make_trainer,
                                                                                          regression_loader):
    module = Model(lambda m: None)
    before = module.layer.weight.detach().clone()
    trainer = make_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match="configure_optimizers returned None: this fit will run with no optimizer"):
        trainer.fit(module, regression_loader)
    assert trainer.global_step == 8 and torch.equal(module.layer.weight, before)  # steps counted, nothing moved


def test_a_module_without_configure_optimizers_is_told_to_define_it(make_trainer, regression_loader):
    class NoOptimizer(TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

    with pytest.raises(NotImplementedError, match=r"does not define configure_optimizers\(\)"):
        make_trainer(max_epochs=1).fit(NoOptimizer(), regression_loader)


# --- manual optimization: a two-optimizer GAN-like model -------------------------------------
class TinyGAN(TrainingModule):
    """A generator and a discriminator, each with its own optimizer and per-epoch scheduler."""

    def __init__(self, initial_state):
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(2, 4)
        self.discriminator = nn.Linear(4, 1)
        self.load_state_dict(initial_state)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        return gan_step(self.generator, self.discriminator, real, *self.optimizers(), self.manual_backward)

    def on_train_epoch_end(self):
        for scheduler in self.lr_schedulers():  # manual optimization steps its own schedulers
            scheduler.step()

    def configure_optimizers(self):
        return gan_optimizers(self.generator, self.discriminator)


def gan_optimizers(generator, discriminator):
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=0.01)
    optimizer_d = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (optimizer_g, optimizer_d)]
    return [optimizer_g, optimizer_d], schedulers


def gan_step(generator, discriminator, real, optimizer_g, optimizer_d, backward):
    noise = real[:, :2] * 0.5  # deterministic "noise": both sides compute the same thing
    fake = generator(noise)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    loss_d = F.binary_cross_entropy_with_logits(discriminator(real), ones) + \
        F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
    optimizer_d.zero_grad()
    backward(loss_d)
    optimizer_d.step()
    loss_g = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
    optimizer_g.zero_grad()
    backward(loss_g)
    optimizer_g.step()
    return loss_g.detach()


def gan_initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    reference = nn.ModuleDict({"generator": nn.Linear(2, 4), "discriminator": nn.Linear(4, 1)})
    return {k: v.clone() for k, v in reference.state_dict().items()}


def test_manual_optimization_trains_two_optimizers_like_a_hand_written_loop(make_trainer, regression_loader):
    initial_state = gan_initial_state()
    reference = nn.ModuleDict({"generator": nn.Linear(2, 4), "discriminator": nn.Linear(4, 1)})
    reference.load_state_dict(initial_state)

    optimizers, schedulers = gan_optimizers(reference["generator"], reference["discriminator"])
    for _ in range(2):
        for real, _ in regression_loader:
            gan_step(reference["generator"], reference["discriminator"], real, *optimizers, torch.Tensor.backward)
        for scheduler in schedulers:
            scheduler.step()

    module = TinyGAN(initial_state)
    trainer = make_trainer(max_epochs=2)
    trainer.fit(module, regression_loader)

    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
    # As in Lightning, global_step counts optimizer steps: two per batch here.
    assert trainer.global_step == 2 * 2 * 8
    # The Trainer left the schedulers to the module: halved once per epoch, not twice.
    assert [o.param_groups[0]["lr"] for o in trainer.optimizers] == pytest.approx([0.01 / 4, 0.1 / 4])


class ManualPlateau(LinearRegression):
    """Manual optimization that steps its own ReduceLROnPlateau (or any stateful scheduler) each epoch."""

    def __init__(self, make):
        super().__init__()
        self.automatic_optimization = False
        self.make = make

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.mse_loss(self.layer(batch[0]), batch[1]))
        optimizer.step()

    def on_train_epoch_end(self):
        self.lr_schedulers().step(1.0)  # a loss that never improves

    def configure_optimizers(self):
        optimizer = sgd(self)
        return [optimizer], [self.make(optimizer)]


def test_manual_optimization_takes_schedulers_the_module_steps_itself(make_trainer, regression_loader):
    # As in Lightning: in manual optimization ReduceLROnPlateau needs no monitor, a dict's "monitor"/"strict"
    # are ignored with a RuntimeWarning, and a scheduler outside torch's API (with a state) is accepted.
    def plateau(optimizer):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

    trainer = make_trainer(max_epochs=3)
    trainer.fit(ManualPlateau(plateau), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.25)  # epoch 1 sets the best; epochs 2 and 3 halve

    with pytest.warns(RuntimeWarning, match=r"contains the key\(s\) \['monitor'\], but the keys will be ignored"):
        make_trainer(max_epochs=1).fit(ManualPlateau(lambda o: {"scheduler": plateau(o), "monitor": "x"}), regression_loader)

    class Custom:  # the module's own schedule: not a torch scheduler
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, metric):
            self.optimizer.param_groups[0]["lr"] /= 10

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    trainer = make_trainer(max_epochs=2)
    trainer.fit(ManualPlateau(Custom), regression_loader)
    assert lr_of(trainer) == pytest.approx(0.01)


def test_max_steps_counts_the_optimizer_steps_of_manual_optimization(make_trainer, regression_loader):
    trainer = make_trainer(max_steps=6)
    trainer.fit(TinyGAN(gan_initial_state()), regression_loader)
    assert trainer.global_step == 6  # three batches of two optimizer steps


def test_manual_optimization_refuses_accumulation_and_clipping(make_trainer, regression_loader):
    # Lightning 2.6.5's words (its test_trainer_manual_optimization_config matches the first), then Cadence's
    for arguments, lightnings in (({"accumulate_grad_batches": 2}, "Automatic gradient accumulation is not supported"),
                                  ({"gradient_clip_val": 1.0}, "Automatic gradient clipping is not supported"),
                                  ({"gradient_clip_val": 1}, "Automatic gradient clipping is not supported")):
        with pytest.raises(ValueError, match=rf"{lightnings} for manual optimization.*apply to automatic optimization only"):
            make_trainer(max_epochs=1, **arguments).fit(TinyGAN(gan_initial_state()), regression_loader)


def test_optimizers_and_manual_backward_outside_a_run_say_they_need_a_trainer(make_trainer, regression_loader):
    module = Model(sgd)
    with pytest.raises(RuntimeError, match=r"Model.optimizers\(\) needs a running Trainer"):
        module.optimizers()
    with pytest.raises(RuntimeError, match=r"Model.manual_backward\(\) needs a running Trainer"):
        module.manual_backward(torch.ones((), requires_grad=True))
    make_trainer(max_steps=1).fit(module, regression_loader)
    assert module.optimizers() is not None  # after fit, as in Lightning
    with pytest.raises(RuntimeError, match=r"Model.manual_backward\(\) needs a running Trainer"):
        module.manual_backward(torch.ones((), requires_grad=True))


# --- manual optimization as Lightning's GAN example writes it: toggle_optimizer -----------------
class ToggledGAN(TinyGAN):
    """Lightning's GAN template in small: ``training_step(self, batch)`` without batch_idx, the
    generator's step under ``toggle_optimizer(opt_g)``, then the discriminator's under ``opt_d``."""

    def __init__(self, initial_state):
        super().__init__(initial_state)
        self.discriminator.bias.requires_grad = False  # frozen by the user: stays frozen
        self.example_input_array = torch.zeros(2, 2)
        self.seen = []

    def forward(self, noise):
        return self.generator(noise)

    def training_step(self, batch):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        noise = real[:, :2] * 0.5
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(noise)), ones)
        opt_g.zero_grad()
        before = self.discriminator.weight.grad  # the last discriminator step's (or None): copied
        before = None if before is None else before.clone()
        self.manual_backward(g_loss)
        # The discriminator computed no gradient for the generator's loss.
        after = self.discriminator.weight.grad
        unchanged = after is None if before is None else torch.equal(before, after)
        self.seen.append(("g", self.discriminator.weight.requires_grad, unchanged))
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        d_loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(self(noise).detach()), zeros)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.seen.append(("d", self.generator.weight.requires_grad, self.discriminator.bias.requires_grad))
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def on_train_epoch_end(self):
        pass  # no schedulers here

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=0.01),
                torch.optim.Adam(self.discriminator.parameters(), lr=0.01))


def test_a_gan_with_toggle_optimizer_trains_like_a_hand_written_loop(make_trainer, regression_loader):
    initial_state = gan_initial_state()
    reference = nn.ModuleDict({"generator": nn.Linear(2, 4), "discriminator": nn.Linear(4, 1)})
    reference.load_state_dict(initial_state)
    reference["discriminator"].bias.requires_grad = False
    generator, discriminator = reference["generator"], reference["discriminator"]
    opt_g = torch.optim.Adam(generator.parameters(), lr=0.01)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=0.01)
    for real, _ in regression_loader:
        noise, ones, zeros = real[:, :2] * 0.5, torch.ones(len(real), 1), torch.zeros(len(real), 1)
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(discriminator(generator(noise)), ones).backward()
        opt_g.step()
        opt_d.zero_grad()
        ((F.binary_cross_entropy_with_logits(discriminator(real), ones)
          + F.binary_cross_entropy_with_logits(discriminator(generator(noise).detach()), zeros)) / 2).backward()
        opt_d.step()

    module = ToggledGAN(initial_state)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(module, regression_loader)

    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
    # Toggled: no discriminator gradient in the generator's step, no generator one in the
    # discriminator's; the bias frozen by the user stayed frozen; untoggled, all is as before.
    assert set(module.seen) == {("g", False, True), ("d", False, False)}
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]
    assert set(trainer.logged_metrics) >= {"d_loss", "g_loss"}
    assert module(module.example_input_array).shape == (2, 4)


# --- optimizer_step and optimizer_zero_grad overrides (automatic optimization) -----------------
class WarmUp(Model):
    """Lightning's documented warm-up: scale the learning rate in an optimizer_step override."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 4:
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (self.trainer.global_step + 2) / 5) * 0.1


def test_an_optimizer_step_override_runs_at_each_step_and_can_change_the_learning_rate(make_trainer, regression_loader):
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    module = WarmUp(lambda m: torch.optim.SGD(m.parameters(), lr=0.02))
    module.layer.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.02)
    for step, (x, y) in enumerate(regression_loader):
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 < 4:  # global_step after this step, as the override sees it
            optimizer.param_groups[0]["lr"] = min(1.0, (step + 1 + 2) / 5) * 0.1
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, regression_loader)
    assert torch.equal(module.layer.weight, reference.weight)
    assert trainer.global_step == 8


def test_an_optimizer_step_override_that_skips_the_step_leaves_global_step_and_gradients_clear(make_trainer, regression_loader):
    steps = []

    class EveryOther(Model):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()  # Lightning's way to skip a step: the closure alone
            steps.append(self.trainer.global_step)

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            optimizer.zero_grad(set_to_none=False)  # zeros instead of None

    module = EveryOther(sgd)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, regression_loader)
    assert trainer.global_step == 4 and steps == [1, 1, 2, 2, 3, 3, 4, 4]
    assert torch.count_nonzero(module.layer.weight.grad) == 0  # zeroed by the override, not set to None


# --- the setup order ---------------------------------------------------------------------------
class ReplacesParametersWhenWrapping(SingleDevice):
    """Stands for a strategy that swaps parameters when it wraps (FSDP's fully_shard turns each
    into a sharded DTensor): the optimizer must be built after the wrap, on the new parameters."""

    def wrap_module(self, module, stage):
        self.replaced = nn.Parameter(module.layer.weight.detach().clone())
        module.layer.weight = self.replaced
        return module


def test_configure_optimizers_runs_after_the_strategy_wrapped_the_model(make_trainer, regression_loader):
    strategy = ReplacesParametersWhenWrapping("cpu")
    module = Model(sgd)
    trainer = make_trainer(max_epochs=1, strategy=strategy)
    trainer.fit(module, regression_loader)
    stepped = trainer.optimizers[0].param_groups[0]["params"]
    assert any(parameter is strategy.replaced for parameter in stepped)
    assert module.layer.weight is strategy.replaced


class OneCycle(Model):
    """Lightning's common pattern: OneCycleLR needs the run's total of optimizer steps up front."""

    def __init__(self, loader):
        super().__init__(make=None)
        self.loader, self.loaders_made, self.estimated = loader, 0, None

    def train_dataloader(self):
        self.loaders_made += 1
        return self.loader

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.estimated = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.estimated)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize(("options", "estimated"), [
    ({"max_epochs": 2, "accumulate_grad_batches": 2}, 8),  # 8 batches an epoch, a step every 2, 2 epochs
    ({"max_epochs": 3, "limit_train_batches": 3}, 9),
    ({"max_epochs": 10, "max_steps": 5}, 5),
])
def test_estimated_stepping_batches_gives_one_cycle_lr_the_runs_total_of_steps(make_trainer, regression_loader,
                                                                             options, estimated):
    module, trainer = OneCycle(regression_loader), make_trainer(**options)
    trainer.fit(module)  # OneCycleLR raises if it is stepped more often than total_steps
    assert module.estimated == estimated == trainer.global_step
    assert module.loaders_made == 1  # the loader made for the estimate is the one fit trains on
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == estimated


class _Stream(torch.utils.data.IterableDataset):
    """Samples without a length: only max_steps bounds a run over them."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(64):
            x = torch.randn(4, generator=generator)
            yield x, x[:2]


def test_estimated_stepping_batches_over_a_loader_without_length_is_max_steps(make_trainer):
    module = OneCycle(torch.utils.data.DataLoader(_Stream(), batch_size=8))
    trainer = make_trainer(max_steps=5)
    trainer.fit(module)
    assert module.estimated == 5 == trainer.global_step


# --- gradients are freed before validation in fit (Lightning's on_validation_model_zero_grad) --------
class UnzeroedGradients(LinearRegression):
    """Adds ``self.extra``, a parameter no optimizer holds, so only the Trainer can free its gradient;
    records its gradient after each batch's backward. Each batch adds 8 (a sum over 8 samples)."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(()))
        self.automatic_optimization = not manual
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y) + self.extra * len(x)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    def on_after_backward(self):
        self.seen.append(self.extra.grad.item())

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=self.lr)


@pytest.mark.parametrize("manual", [True, False])
def test_validation_during_fit_frees_the_gradients_of_parameters_no_optimizer_zeroes(make_trainer, regression_loader, manual):
    model = UnzeroedGradients(manual)
    make_trainer(max_epochs=1, val_check_interval=2, num_sanity_val_steps=0).fit(model, regression_loader, regression_loader)
    assert model.seen == [8.0, 16.0] * 4  # freed by each validation, after batches 2, 4, 6 and 8


def test_validation_inside_an_accumulation_window_keeps_the_window_gradients(make_trainer, regression_loader):
    model = UnzeroedGradients(manual=False)
    trainer = make_trainer(max_epochs=1, val_check_interval=3, accumulate_grad_batches=2, num_sanity_val_steps=0)
    trainer.fit(model, regression_loader, regression_loader)
    # each batch adds 8 / 2 (the loss divided by the window); validation after batch 3 (inside the window of
    # batches 3-4) frees nothing, after batch 6 (a window's end) it does
    assert model.seen == [4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 4.0, 8.0]


def test_lr_scheduler_configs_compare_equal_to_lightnings_lr_scheduler_config(make_trainer, regression_loader):
    # Lightning's test_reducelronplateau_scheduling compares trainer.lr_scheduler_configs[0] with an
    # LRSchedulerConfig (lightning.pytorch.utilities.types) made field by field.
    class Logs(Model):
        def training_step(self, batch, batch_idx):
            self.log("foo", float(batch_idx))
            return super().training_step(batch, batch_idx)

    def make(module):
        optimizer = sgd(module)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
                "monitor": "foo"}

    trainer = make_trainer(max_epochs=1, limit_train_batches=2)
    trainer.fit(Logs(make), regression_loader)
    config = trainer.lr_scheduler_configs[0]
    assert config == LRSchedulerConfig(scheduler=config.scheduler, monitor="foo", interval="epoch", frequency=1,
                                       reduce_on_plateau=True, strict=True, name=None)
    assert config != LRSchedulerConfig(scheduler=config.scheduler, monitor="bar", reduce_on_plateau=True)


class SwapsInAWarmUp(Callback):
    """A warm-up callback as Lightning projects write it: in on_train_start it replaces
    ``trainer.strategy.lr_scheduler_configs`` with a step LambdaLR, and puts the module's back after 4 steps."""

    def on_train_start(self, trainer, module):
        self.original = trainer.lr_scheduler_configs
        warm = torch.optim.lr_scheduler.LambdaLR(trainer.optimizers[0], lambda step: min(1.0, (step + 1) / 4))
        trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(warm, interval="step")]
        self.lrs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 4:
            trainer.strategy.lr_scheduler_configs = self.original
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


class StepsEachEpoch(LinearRegression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.8)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_scheduler_configs_set_on_the_strategy_are_what_the_loop_steps(make_trainer):
    warmup = SwapsInAWarmUp()
    trainer = make_trainer(max_epochs=3, callbacks=[warmup])
    trainer.fit(StepsEachEpoch(), DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 2)), batch_size=2))
    # Lightning 2.6.5's rates for the same callback and module: the warm-up steps each batch to 0.8, then
    # the module's StepLR halves the rate at each epoch's end.
    assert warmup.lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8] + [0.4] * 6 + [0.2] * 6)
    assert trainer.strategy.lr_scheduler_configs is trainer.lr_scheduler_configs
    step_lr = trainer.lr_scheduler_configs[0].scheduler  # Lightning's tests compare the loop's config to one made
    assert trainer.lr_scheduler_configs[0] == LRSchedulerConfig(step_lr, interval="epoch", frequency=1, strict=True)
    assert trainer.lr_scheduler_configs[0] != LRSchedulerConfig(step_lr, interval="step")


def test_scheduler_configs_that_the_loop_could_not_step_are_refused(make_trainer):
    module = StepsEachEpoch()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="outside a fit"):
        trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(step)]
    with pytest.raises(ValueError, match="reduce_on_plateau"):
        LRSchedulerConfig(step, reduce_on_plateau=True)
    assert LRSchedulerConfig(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), reduce_on_plateau=True,
                             monitor="loss").reduce_on_plateau
    trainer.strategy._trainer = trainer  # as during a fit
    with pytest.raises(TypeError, match="LRSchedulerConfig objects"):
        trainer.strategy.lr_scheduler_configs = [step]
    with pytest.raises(ValueError, match=r"lr_scheduler_configs: LRSchedulerConfig\(interval='batch'\); use \"step\" or "):
        trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(step, interval="batch")]
    with pytest.raises(ValueError, match=r"LRSchedulerConfig\(frequency=0\); use a whole number >= 1"):
        trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(step, frequency=0)]


# --- trainer.strategy.optimizers (Lightning's setter; mathLab/PINA's SwitchOptimizer) ------------------
class SwitchAtStart(Callback):
    """Sets ``trainer.strategy.optimizers`` as PINA's SwitchOptimizer does (there in on_train_epoch_start)."""

    def __init__(self, make, epoch=0):
        self.make, self.epoch = make, epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.strategy.optimizers = [self.make(pl_module)]


def test_optimizers_set_on_the_strategy_are_stepped_with_the_trainers_clipping_bound_to_them(make_trainer):
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    model = LinearRegression()
    start = {name: value.detach().clone() for name, value in model.named_parameters()}
    switch = SwitchAtStart(lambda module: torch.optim.SGD([module.layer.weight], lr=0.5))
    trainer = make_trainer(max_steps=1, gradient_clip_val=0.01, callbacks=[switch])
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))

    assert trainer.strategy.optimizers is trainer.optimizers and trainer.optimizers[0].param_groups[0]["lr"] == 0.5
    weight = start["layer.weight"].clone().requires_grad_(True)
    F.mse_loss(x @ weight.T + start["layer.bias"], y).backward()
    grad = weight.grad * min(1.0, 0.01 / (weight.grad.norm() + 1e-6))  # the new optimizer's parameters' norm alone
    assert torch.allclose(model.layer.weight, start["layer.weight"] - 0.5 * grad, atol=1e-7)
    assert torch.equal(model.layer.bias, start["layer.bias"])  # not in the new optimizer


def test_optimizers_set_on_the_strategy_count_global_step_under_manual_optimization(make_trainer, regression_loader):
    switch = SwitchAtStart(lambda module: torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9), epoch=1)
    trainer = make_trainer(max_epochs=2, callbacks=[switch])
    trainer.fit(ManualLinearRegression(), regression_loader)
    assert trainer.optimizers[0].defaults["momentum"] == 0.9  # the one set, stepped by training_step
    assert all(state["momentum_buffer"] is not None for state in trainer.optimizers[0].state.values())
    assert trainer.global_step == 2 * len(regression_loader)  # its steps counted too


def test_optimizers_set_on_the_strategy_outside_a_fit_or_needing_a_closure_are_refused(make_trainer, regression_loader):
    trainer = make_trainer(max_steps=1)
    with pytest.raises(RuntimeError, match="set outside a fit"):
        trainer.strategy.optimizers = [torch.optim.SGD(LinearRegression().parameters(), lr=0.1)]
    switch = SwitchAtStart(lambda module: torch.optim.LBFGS(module.parameters()))
    with pytest.raises(ValueError, match=r"LBFGS.step\(closure\) re-evaluates the loss.*automatic_optimization = False"):
        make_trainer(max_steps=1, callbacks=[switch]).fit(LinearRegression(), regression_loader)
    with pytest.raises(ValueError, match=r"LBFGS.step\(closure\)"):  # from configure_optimizers: not torch's TypeError
        make_trainer(max_steps=1).fit(Model(lambda module: torch.optim.LBFGS(module.parameters())), regression_loader)
