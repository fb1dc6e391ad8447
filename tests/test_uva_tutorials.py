"""What the UvA deep-learning course's Lightning tutorials (Lightning-AI/tutorials, course_UvA-DL)
rely on, run under Cadence with only the imports changed: each test is one difference found there."""

from __future__ import annotations


from linear_regression import LinearRegression

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import LearningRateMonitor, Logger, TensorBoardLogger


class Shaped(LinearRegression):
    def __init__(self, img_shape=(1, 4), lr: float = 0.1) -> None:
        super().__init__(lr)
        self.save_hyperparameters()
        self.start = torch.zeros((2,) + self.hparams.img_shape)  # as the energy-model tutorial's sampler


def test_a_tuple_hyperparameter_is_a_tuple_again_after_load_from_checkpoint(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_steps=1)
    trainer.fit(Shaped(img_shape=(1, 4)), regression_loader)
    trainer.save_checkpoint(tmp_path / "shaped.ckpt")
    loaded = Shaped.load_from_checkpoint(tmp_path / "shaped.ckpt")  # Lightning keeps the tuple
    assert loaded.hparams.img_shape == (1, 4) and type(loaded.hparams.img_shape) is tuple
    assert loaded.start.shape == (2, 1, 4)


class Recording(Logger):
    def __init__(self):
        super().__init__()
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((dict(metrics), step))


def test_the_epoch_learning_rate_monitor_logs_the_rates_alone(make_trainer):
    class Scheduled(LinearRegression):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    logger = Recording()
    data = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 2)), batch_size=2)
    make_trainer(max_epochs=2, logger=logger, callbacks=[LearningRateMonitor("epoch")]).fit(Scheduled(), data)
    # Lightning's monitor calls log_metrics with the rates only (no "epoch"), at each epoch's first step
    assert [call for call in logger.calls if "lr-SGD" in call[0]] == [({"lr-SGD": 0.1}, 0), ({"lr-SGD": 0.05}, 2)]


class Noisy(LinearRegression):
    """A forward that draws a random number (as a flow's dequantization noise does), recording each
    draw with the mode it ran in, and counting the forwards run by a trace."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(3, 4)
        self.draws, self.traced = [], 0

    def forward(self, x):
        self.traced += torch.jit.is_tracing()
        noise = torch.rand(())
        self.draws.append((noise.item(), self.training, torch.is_grad_enabled()))
        return self.layer(x) + noise

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def test_step(self, batch, batch_idx):
        self(batch[0])


def test_the_model_summary_runs_example_input_array_once_as_lightnings_does(make_trainer, regression_loader, capsys):
    # Lightning's summary runs example_input_array through the module (eval mode, no grad) to show the
    # layers' sizes: the random numbers training draws come after that forward's.
    summarized = Noisy()
    torch.manual_seed(0)
    make_trainer(max_steps=1).fit(summarized, regression_loader)
    torch.manual_seed(0)
    assert summarized.draws[0] == (torch.rand(()).item(), False, False)
    assert [mode for _, *mode in summarized.draws[1:]] == [[True, True]]
    assert "0 | layer | Linear | 10     | train | 48    | [3, 4]   | [3, 2]" in capsys.readouterr().err  # Lightning 2.6.5's row
    plain = Noisy()
    torch.manual_seed(0)
    make_trainer(max_steps=1, enable_model_summary=False).fit(plain, regression_loader)
    assert [mode for _, *mode in plain.draws] == [[True, True]]  # no summary, no extra forward
    assert plain.draws[0][0] != summarized.draws[1][0]


def test_log_graph_traces_the_module_at_the_start_of_every_stage(make_trainer, regression_loader, tmp_path):
    # Lightning's TensorBoardLogger(log_graph=True) writes the graph when fit starts and again when each
    # test (validate, predict) starts; each trace runs the forward (torch.jit.trace checks it: 2 runs).
    module = Noisy()
    trainer = make_trainer(max_steps=1, logger=TensorBoardLogger(tmp_path, log_graph=True), enable_model_summary=False)
    trainer.fit(module, regression_loader)
    per_trace = module.traced
    assert per_trace > 0
    trainer.test(module, regression_loader, verbose=False)
    trainer.test(module, regression_loader, verbose=False)
    assert module.traced == 3 * per_trace


class AdaptsInValidation(LinearRegression):
    """A validation_step that takes a gradient, as MAML's inner loop does (UvA tutorial 12)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            x, y = batch
            grad, = torch.autograd.grad(torch.nn.functional.mse_loss(self.layer(x), y), self.layer.weight)
        self.seen.append((self.trainer.sanity_checking, torch.is_inference_mode_enabled()))


def test_validation_within_fit_runs_under_no_grad_so_a_step_may_take_gradients(make_trainer, regression_loader):
    # Lightning's fit validates under torch.no_grad (its fit loop's _EvaluationLoop has inference_mode=False);
    # trainer.validate, test and predict use torch.inference_mode (Trainer(inference_mode=True)).
    module = AdaptsInValidation()
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(module, regression_loader, regression_loader)
    assert module.seen == [(True, False), (False, False)]  # the sanity check, then the epoch's validation
    with pytest.raises(RuntimeError, match="does not require grad"):
        trainer.validate(module, regression_loader, verbose=False)
