"""The learning-rate finder: ``Tuner(trainer).lr_find`` and the ``LearningRateFinder`` callback.

Lightning's range test: the rates tried, the suggestion, the attribute written, and above all that
the search leaves nothing behind: a fit after it trains exactly as a fit with the suggested rate
set from the start.
"""

from __future__ import annotations

import math
import sys

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, LearningRateFinder, LRFinder
from trainer import TrainingModule, Tuner


def dataset(size: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(size, 4, generator=generator)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=generator))


class Net(TrainingModule):
    """A small regression with dropout (it draws random numbers) and shuffled data."""

    def __init__(self, lr: float = 0.01, optimizer: str = "adam", scheduler: bool = False):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        make = torch.optim.Adam if self.hparams.optimizer == "adam" else torch.optim.SGD
        optimizer = make(self.parameters(), lr=self.hparams.lr)
        if not self.hparams.scheduler:
            return optimizer
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)]  # from base_lrs

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8, shuffle=True)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_lr_find_tries_the_rates_of_lightnings_exponential_sweep(make_trainer):
    model = Net()
    finder = Tuner(make_trainer(max_epochs=1)).lr_find(model, min_lr=1e-6, max_lr=1.0, num_training=20,
                                                       early_stop_threshold=None, update_attr=False)
    lrs = finder.results["lr"]
    # Lightning's sweep: the first step at min_lr, step i > 0 at min_lr * (max/min) ** ((i + 1) / n).
    expected = [1e-6] + [1e-6 * (1.0 / 1e-6) ** ((i + 1) / 20) for i in range(1, 20)]
    assert len(lrs) == len(finder.results["loss"]) == 20  # 20 steps, over three epochs of 8 batches
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert model.steps == 20


def test_linear_mode_and_accumulation_count_optimizer_steps(make_trainer):
    model = Net()
    finder = Tuner(make_trainer(max_epochs=1, accumulate_grad_batches=2)).lr_find(
        model, min_lr=0.001, max_lr=0.1, num_training=10, mode="linear", early_stop_threshold=None)
    lrs = finder.results["lr"]
    assert len(lrs) == len(finder.results["loss"]) == 10
    assert model.steps == 20  # two batches per optimizer step
    assert lrs[0] == 0.001 and lrs[1] == pytest.approx(0.001 + 2 / 10 * (0.1 - 0.001))
    assert all(later > earlier for earlier, later in zip(lrs, lrs[1:]))


def test_a_fit_after_lr_find_equals_a_fit_with_the_suggestion_set_from_the_start(make_trainer):
    model = Net()
    initial = weights(model)
    trainer = make_trainer(max_epochs=2)
    torch.manual_seed(123)
    finder = Tuner(trainer).lr_find(model, num_training=30)
    suggestion = finder.suggestion()
    assert suggestion is not None and model.hparams.lr == suggestion != 0.01
    assert_same(weights(model), initial)  # the search trained, then put everything back
    assert (trainer.global_step, trainer.current_epoch, trainer.callback_metrics) == (0, 0, {})
    trainer.fit(model)

    fresh = Net(lr=suggestion)
    reference = make_trainer(max_epochs=2)
    torch.manual_seed(123)  # the search left the RNG where it found it: dropout and shuffling match
    reference.fit(fresh)
    assert_same(weights(model), weights(fresh))
    assert trainer.global_step == reference.global_step == 16
    assert float(trainer.callback_metrics["train_loss"]) == float(reference.callback_metrics["train_loss"])


def test_the_callback_searches_at_fit_start_then_trains_as_with_the_suggestion(make_trainer):
    """With a scheduler too: it continues from the suggested rate, as if configured with it (Lightning's
    LambdaLR would go back to the configured rate at its first step)."""
    model = Net(scheduler=True)
    callback = LearningRateFinder(num_training_steps=30, early_stop_threshold=None)
    torch.manual_seed(5)
    make_trainer(max_epochs=2, callbacks=[callback]).fit(model)
    suggestion = callback.optimal_lr.suggestion()
    assert model.hparams.lr == suggestion

    fresh = Net(lr=suggestion, scheduler=True)
    torch.manual_seed(5)
    reference = make_trainer(max_epochs=2)
    reference.fit(fresh)
    assert_same(weights(model), weights(fresh))


@pytest.mark.parametrize("where", ["attribute", "hparams", "learning_rate", "attr_name"])
def test_the_suggestion_is_written_where_lightning_writes_it(make_trainer, where):
    class Named(Net):
        def __init__(self):
            super().__init__()
            if where == "attribute":
                del self.hparams["lr"]
                self.lr = 0.01
            elif where in ("learning_rate", "attr_name"):
                self.hparams[{"learning_rate": "learning_rate", "attr_name": "my_lr"}[where]] = self.hparams.pop("lr")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Named()
    finder = Tuner(make_trainer(max_epochs=1)).lr_find(model, num_training=20,
                                                       attr_name="my_lr" if where == "attr_name" else "")
    found = {"attribute": lambda: model.lr, "hparams": lambda: model.hparams.lr,
             "learning_rate": lambda: model.hparams.learning_rate, "attr_name": lambda: model.hparams.my_lr}[where]()
    assert found == finder.suggestion() != 0.01


def test_no_learning_rate_attribute_fails_before_anything_runs(make_trainer):
    class Nameless(Net):
        def __init__(self):
            super().__init__()
            self.hparams.clear()
            self.hparams.update(optimizer="sgd", scheduler=False)

        def configure_optimizers(self):
            raise AssertionError("not set up")

    with pytest.raises(AttributeError, match="should have one of these fields: \\('lr', 'learning_rate'\\)"):
        Tuner(make_trainer()).lr_find(Nameless())
    with pytest.raises(AttributeError, match="set to speed, but could not find"):
        Tuner(make_trainer()).lr_find(Nameless(), attr_name="speed")


def test_a_diverging_loss_stops_the_search_and_says_so(make_trainer, caplog):
    model = Net(optimizer="sgd")
    with caplog.at_level(logging.INFO):
        finder = Tuner(make_trainer(max_epochs=1)).lr_find(model, min_lr=1e-4, max_lr=100.0, num_training=60)
    assert 3 < len(finder.results["lr"]) == len(finder.results["loss"]) < 60
    assert "LR finder stopped early after" in caplog.text
    losses = finder.results["loss"]
    assert losses[-1] > 4 * min(losses)


def test_a_search_later_in_the_run_counts_its_own_steps(make_trainer, capsys):
    """Lightning's documented FineTuneLearningRateFinder, searching at a milestone epoch: the search
    is as one at the start of a run (Lightning compares the run's global step with its first-step
    rule, so it stops after one step with a best loss of 0)."""

    class FineTuneLearningRateFinder(LearningRateFinder):
        def __init__(self, milestones, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.milestones = milestones

        def on_fit_start(self, *args, **kwargs):
            return

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch in self.milestones or trainer.current_epoch == 0:
                self.lr_find(trainer, pl_module)

    finder = FineTuneLearningRateFinder(milestones=(1,), num_training_steps=12)
    make_trainer(max_epochs=2, callbacks=[finder]).fit(Net())
    assert len(finder.optimal_lr.results["lr"]) == 12  # the milestone's search, after 8 steps of training
    assert "stopped early" not in capsys.readouterr().err


def test_too_few_points_leave_the_learning_rate_as_it_was(make_trainer, capsys):
    model = Net()
    finder = Tuner(make_trainer(max_epochs=1)).lr_find(model, num_training=1)
    assert finder.suggestion() is None
    assert model.hparams.lr == 0.01
    assert "Failed to compute suggestion" in capsys.readouterr().err


def test_suggestion_is_the_steepest_descent_of_the_loss_over_the_rate():
    finder = LRFinder("exponential", 1e-6, 1e-1, 20)
    rates = torch.linspace(0, 2 * math.pi, steps=1000)
    finder.results = {"lr": rates.tolist(), "loss": torch.sin(rates).tolist()}
    assert finder.suggestion(skip_begin=2, skip_end=2) == pytest.approx(math.pi, abs=1e-2)  # sin falls fastest at pi
    finder.results["loss"][500] = float("nan")  # a non-finite point is left out, not chosen
    assert finder.suggestion(skip_begin=2, skip_end=2) == pytest.approx(math.pi, abs=1e-2)


def test_plot_without_matplotlib_prints_the_numbers(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    finder = LRFinder("exponential", 1e-4, 1.0, 30)
    finder.results = {"lr": [1e-4 * 10 ** (i / 10) for i in range(30)],
                      "loss": [1.0 - i / 20 + (i / 20) ** 4 for i in range(30)]}
    with pytest.warns(UserWarning, match="pip install matplotlib"):
        assert finder.plot(suggest=True) is None
    table = capsys.readouterr().out
    assert "<- suggestion" in table and f"{finder.suggestion():.3e}" in table
    rows = table.splitlines()[1:]
    assert rows[0].split()[:2] == ["1.000e-04", "1"] and 10 < len(rows) <= 26  # the curve, in at most ~25 rows


def test_plot_draws_the_curve_with_matplotlib():
    pytest.importorskip("matplotlib")
    finder = LRFinder("exponential", 1e-4, 1.0, 30)
    finder.results = {"lr": [1e-4 * 10 ** (i / 10) for i in range(30)],
                      "loss": [1.0 - i / 20 + (i / 20) ** 4 for i in range(30)]}
    figure = finder.plot(suggest=True)
    axes = figure.axes[0]
    assert axes.get_xscale() == "log" and len(axes.lines) == 2  # the curve and the suggestion


def test_a_progress_bar_shows_the_search_when_the_trainer_shows_one(make_trainer, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a terminal, which tests lack
    Tuner(make_trainer(max_epochs=1, enable_progress_bar=True)).lr_find(Net(), num_training=12)
    assert "Finding best initial lr" in capsys.readouterr().err
    Tuner(make_trainer(max_epochs=1, enable_progress_bar=False)).lr_find(Net(), num_training=12)
    assert "Finding best initial lr" not in capsys.readouterr().err


def test_the_trainers_callbacks_see_only_setup_and_teardown(make_trainer):
    class Recorder(Callback):
        def __init__(self):
            self.calls = []

        def setup(self, trainer, module, stage):
            self.calls.append(("setup", stage))

        def on_fit_start(self, trainer, module):
            self.calls.append("on_fit_start")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.calls.append("on_train_batch_end")

        def on_log(self, trainer, module, metrics, step):
            self.calls.append("on_log")

        def teardown(self, trainer, module, stage):
            self.calls.append(("teardown", stage))

    recorder = Recorder()
    trainer = make_trainer(max_epochs=1, callbacks=[recorder], log_every_n_steps=1)
    Tuner(trainer).lr_find(Net(), num_training=10)
    assert recorder.calls == [("setup", "fit"), ("teardown", "fit")]
    assert trainer.callbacks[0] is recorder and not any(isinstance(c, LearningRateFinder) for c in trainer.callbacks)


@pytest.mark.parametrize(("call", "match"), [
    (lambda tuner, model: tuner.lr_find(model, method="test"), "method='fit' is the only valid"),
    (lambda tuner, model: tuner.lr_find(model, dataloaders=[]), "`dataloaders` argument should be None"),
    (lambda tuner, model: tuner.scale_batch_size(model, method="validate", train_dataloaders=[]),
     "please consider setting `dataloaders` instead"),
    (lambda tuner, model: tuner.scale_batch_size(model, method="prediction"), "method 'prediction' is invalid"),
])
def test_the_tuners_arguments_are_checked_before_anything_runs(make_trainer, call, match):
    with pytest.raises(ValueError, match=match):
        call(Tuner(make_trainer()), Net())


def test_a_finder_callback_already_there_is_named(make_trainer):
    with pytest.raises(ValueError, match="already configured with a `LearningRateFinder`"):
        Tuner(make_trainer(callbacks=[LearningRateFinder()])).lr_find(Net())


def test_two_optimizers_are_refused(make_trainer):
    class Two(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters(), lr=0.1)]

    with pytest.raises(ValueError, match="returned 2 optimizers, but the learning rate finder only works with single"):
        Tuner(make_trainer()).lr_find(Two())


def test_bad_finder_arguments_are_refused():
    with pytest.raises(ValueError, match="`mode` should be either of"):
        LearningRateFinder(mode="cosine")
    with pytest.raises(ValueError, match="num_training_steps=0"):
        LearningRateFinder(num_training_steps=0)


def test_fast_dev_run_skips_the_search(make_trainer):
    model = Net()
    with pytest.warns(UserWarning, match="Skipping learning rate finder since `fast_dev_run` is enabled"):
        assert Tuner(make_trainer(fast_dev_run=True)).lr_find(model) is None
    assert model.hparams.lr == 0.01 and model.steps == 0


def test_lr_find_leaves_the_global_rng_as_it_was_so_a_second_search_gives_the_same_results(make_trainer):
    """As in Lightning, calling lr_find again gives the same curve: here a dataset drawn from the global RNG
    in the loader hook (Lightning's BoringModel does that) is drawn again from the same state."""

    class RandomData(Net):
        def train_dataloader(self):
            x = torch.randn(64, 4)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    torch.manual_seed(1)
    model, tuner = RandomData(), Tuner(make_trainer(max_epochs=1))
    before = torch.get_rng_state()
    first = tuner.lr_find(model, num_training=20, early_stop_threshold=None).results
    assert torch.equal(torch.get_rng_state(), before)
    assert tuner.lr_find(model, num_training=20, early_stop_threshold=None).results == first


def test_code_catching_lightnings_tuner_exit_exception_around_lr_find_runs_unchanged(make_trainer):
    # A public tune_lr helper: `from lightning.pytorch.utilities.exceptions import _TunerExitException`, then
    # lr_find inside try/except _TunerExitException ("it always throws this error"); the rate it found is set.
    from trainer.utilities import _TunerExitException

    model, found = Net(), []
    try:
        found.append(Tuner(make_trainer(max_epochs=1)).lr_find(model, num_training=20))
    except _TunerExitException:  # never reaches the caller, as in Lightning 2.6.5
        pytest.fail("lr_find let _TunerExitException out")
    assert issubclass(_TunerExitException, Exception)
    assert model.hparams.lr == found[0].suggestion() != 0.01
