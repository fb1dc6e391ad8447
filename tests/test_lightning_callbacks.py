"""Lightning's smaller callbacks: LambdaCallback, BasePredictionWriter, GradientAccumulationScheduler,
OnExceptionCheckpoint; and those Cadence refuses, each naming the Cadence way."""

from __future__ import annotations

import pytest
import torch
from linear_regression import LinearRegression
from torch.utils.data import DataLoader, TensorDataset

import callbacks
from callbacks import (
    BasePredictionWriter, Callback, GradientAccumulationScheduler, LambdaCallback, OnExceptionCheckpoint,
)


def test_lambda_callback_runs_the_functions_given_with_the_hooks_arguments(make_trainer, regression_loader):
    seen = []
    hooks = LambdaCallback(on_train_epoch_end=lambda trainer, module: seen.append(("epoch", trainer.current_epoch)),
                           on_train_batch_end=lambda trainer, module, outputs, batch, batch_idx: seen.append(batch_idx))
    make_trainer(max_epochs=2, callbacks=[hooks, LambdaCallback(on_fit_end=lambda t, m: seen.append("end"))]).fit(
        LinearRegression(), regression_loader)
    assert seen == [*range(8), ("epoch", 0), *range(8), ("epoch", 1), "end"]
    with pytest.raises(ValueError, match=r"LambdaCallback\(on_fit_start=3\): use a function of the hook's arguments"):
        LambdaCallback(on_fit_start=3)


class Predicting(LinearRegression):
    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])


class Writer(BasePredictionWriter):
    def __init__(self, write_interval):
        super().__init__(write_interval)
        self.batches, self.epochs = [], []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((batch_idx, dataloader_idx, prediction.shape))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epochs.append(predictions)


@pytest.mark.parametrize("interval, batches, epochs", [("batch", 8, 0), ("epoch", 0, 1), ("batch_and_epoch", 8, 1)])
def test_prediction_writer_writes_each_batch_or_the_whole_pass(make_trainer, regression_loader, interval, batches, epochs):
    writer = Writer(interval)
    returned = make_trainer(callbacks=[writer]).predict(Predicting(), regression_loader, return_predictions=False)
    assert returned is None
    assert len(writer.batches) == batches and len(writer.epochs) == epochs
    if batches:
        assert writer.batches[0] == (0, 0, torch.Size([8, 2]))
    if epochs:
        assert len(writer.epochs[0]) == 8 and torch.cat(writer.epochs[0]).shape == (64, 2)


def test_prediction_writer_refuses_an_unknown_interval_and_says_what_to_implement(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"`write_interval` should be one of \['batch', 'epoch', 'batch_and_epoch'\]: "
                                         r"BasePredictionWriter\(write_interval='step'\)"):
        BasePredictionWriter("step")
    with pytest.raises(NotImplementedError, match=r"BasePredictionWriter writes each batch .* implement write_on_batch_end"):
        make_trainer(callbacks=[BasePredictionWriter()]).predict(Predicting(), regression_loader)


class CountSteps(Callback):
    def __init__(self):
        self.steps_by_epoch = {}

    def on_train_epoch_end(self, trainer, module):
        self.steps_by_epoch[trainer.current_epoch] = trainer.global_step


def test_gradient_accumulation_scheduler_changes_the_window_by_epoch(make_trainer, regression_loader):
    counts = CountSteps()
    scheduler = GradientAccumulationScheduler({1: 4, 2: 2})
    make_trainer(max_epochs=3, callbacks=[scheduler, counts]).fit(LinearRegression(), regression_loader)
    assert counts.steps_by_epoch == {0: 8, 1: 8 + 2, 2: 8 + 2 + 4}  # 8 batches an epoch: windows of 1, 4, 2
    with pytest.raises(ValueError, match=r"You have set `accumulate_grad_batches` and are using the "
                                         r"`GradientAccumulationScheduler` callback: Trainer\(accumulate_grad_batches=2\)"):
        make_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({0: 4})]).fit(
            LinearRegression(), regression_loader)
    with pytest.raises(ValueError, match=r"Accumulation factor should be an int >= 1: .*the values are numbers of "
                                         r"batches to accumulate"):
        GradientAccumulationScheduler({0: 0})
    with pytest.raises(ValueError, match=r"Epoch should be an int >= 0: .*the keys are epochs"):
        GradientAccumulationScheduler({"1": 2})

    class OwnStep(LinearRegression):  # Lightning's warning: the hook runs once per window, not per batch
        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)

    with pytest.warns(UserWarning, match=r"the hooks will not be called on every batch .*OwnStep.optimizer_step runs "
                                         r"once per accumulation window"):
        make_trainer(max_epochs=1, callbacks=[GradientAccumulationScheduler({0: 2})]).fit(OwnStep(), regression_loader)
    with pytest.raises(TypeError, match=r"use a non-empty dict"):
        GradientAccumulationScheduler({})


class Failing(LinearRegression):
    """Fails at batch 3 of epoch 1, in ``training_step`` or after it (``on_train_batch_end``)."""

    def __init__(self, where: str | None = None):
        super().__init__()
        self.where, self.trained = where, []

    def training_step(self, batch, batch_idx):
        if self.where == "step" and self.current_epoch == 1 and batch_idx == 3:
            raise RuntimeError("the data went bad")
        self.trained.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.where == "batch_end" and self.current_epoch == 1 and batch_idx == 3:
            raise RuntimeError("the data went bad")


@pytest.mark.parametrize("where, failed_at, replayed", [("step", 11, [3, 4, 5, 6, 7]), ("batch_end", 12, [4, 5, 6, 7])])
def test_on_exception_checkpoint_saves_what_fit_reached_and_it_resumes(make_trainer, regression_loader, tmp_path, where,
                                                                       failed_at, replayed):
    saver = OnExceptionCheckpoint(tmp_path / "saved")
    trainer = make_trainer(max_epochs=2, callbacks=[saver])
    with pytest.raises(RuntimeError, match="the data went bad"):
        trainer.fit(Failing(where), regression_loader)
    assert saver.ckpt_path == str(tmp_path / "saved" / "on_exception.ckpt") and trainer.global_step == failed_at
    resumed, model = make_trainer(max_epochs=2, callbacks=[OnExceptionCheckpoint(tmp_path / "saved")]), Failing()
    resumed.fit(model, regression_loader, ckpt_path=saver.ckpt_path)
    # As Lightning: a batch that failed before it was trained (in training_step) is trained again; one that failed
    # after (in on_train_batch_end, its optimizer step taken) is done. Lightning 2.6 gives the same indices and steps.
    assert model.trained == [(1, index) for index in replayed] and resumed.global_step == 16
    assert not (tmp_path / "saved" / "on_exception.ckpt").exists()  # a run that ended well removes it
    with pytest.raises(ValueError, match=r"OnExceptionCheckpoint\(filename=''\): use a file name without the extension"):
        OnExceptionCheckpoint(tmp_path, filename="")


def test_the_same_fit_run_again_after_a_failure_resumes_from_the_on_exception_checkpoint(make_trainer, regression_loader,
                                                                                          tmp_path):
    # Lightning 2.6.6: fit(ckpt_path=None) beside an OnExceptionCheckpoint continues from its file when there is one
    # (checkpoint_connector._parse_ckpt_path); run twice, a script picks up where the failed run stopped.
    make = lambda: make_trainer(max_epochs=2, callbacks=[OnExceptionCheckpoint(tmp_path / "saved")])  # noqa: E731
    with pytest.raises(RuntimeError, match="the data went bad"):
        make().fit(Failing("step"), regression_loader)
    again, model = make(), Failing()
    with pytest.warns(UserWarning, match=r"fit got no ckpt_path, and the OnExceptionCheckpoint's .*on_exception.ckpt is "
                                         r"there \(a run failed\): as in Lightning, fit resumes from it"):
        again.fit(model, regression_loader)
    assert model.trained == [(1, index) for index in range(3, 8)] and again.global_step == 16
    assert again.ckpt_path == str(tmp_path / "saved" / "on_exception.ckpt")
    fresh = Failing()
    make().fit(fresh, regression_loader)  # the run above ended well and removed the file: a new run starts over
    assert len(fresh.trained) == 16


def test_on_exception_checkpoint_is_a_checkpoint_callback_as_in_lightning(make_trainer, tmp_path):
    saver = OnExceptionCheckpoint(tmp_path)
    assert isinstance(saver, callbacks.Checkpoint)
    trainer = make_trainer(enable_checkpointing=True, callbacks=[saver, Callback()])
    # Lightning: in checkpoint_callbacks, moved after the other callbacks, and no default ModelCheckpoint beside it
    assert trainer.checkpoint_callbacks == [saver] and trainer.checkpoint_callback is saver
    assert trainer.callbacks.index(saver) > 0 and not any(isinstance(c, callbacks.ModelCheckpoint) for c in trainer.callbacks)
    ranked = callbacks.ModelCheckpoint(dirpath=tmp_path)
    assert make_trainer(enable_checkpointing=True, callbacks=[saver, ranked]).checkpoint_callbacks == [saver, ranked]


@pytest.mark.parametrize("name, way", [
    ("SpikeDetection", "divergence_threshold"), ("WandbLogger", "write a callbacks.Logger"),
    ("XLAProfiler", "not XLA"), ("ServableModuleValidator", "starts no model server"),
])
def test_lightning_callbacks_cadence_lacks_import_and_refuse_with_the_way(name, way):
    refused = getattr(callbacks, name)
    with pytest.raises(NotImplementedError, match=rf"{name} is Lightning's; Cadence does not have it. Instead: .*{way}"):
        refused(swa_lrs=0.01)


def test_a_module_deriving_from_servable_module_is_refused_where_it_is_defined():
    # Lightning's examples/pytorch/servable_module/production.py: class ProductionReadyModel(LitModule, ServableModule)
    with pytest.raises(NotImplementedError, match="ProductionReadyModel derives from ServableModule, which is "
                                                  "Lightning's; Cadence does not have it. Instead: .*to_onnx"):
        class ProductionReadyModel(Predicting, callbacks.ServableModule):
            pass


def test_a_prediction_loader_of_two_batches_hands_the_writer_two_batches(make_trainer, regression_loader):
    writer = Writer("epoch")
    make_trainer(callbacks=[writer]).predict(Predicting(), DataLoader(regression_loader.dataset, batch_size=32))
    assert [prediction.shape for prediction in writer.epochs[0]] == [torch.Size([32, 2])] * 2


def test_a_users_checkpoint_subclass_is_the_trainers_checkpointing_callback(make_trainer, regression_loader, tmp_path):
    class EveryEpoch(callbacks.Checkpoint):
        def on_train_epoch_end(self, trainer, module):
            trainer.save_checkpoint(tmp_path / f"epoch{trainer.current_epoch}.ckpt")

    class Other(Callback):
        pass

    assert isinstance(callbacks.ModelCheckpoint(), callbacks.Checkpoint)
    own, other = EveryEpoch(), Other()
    trainer = make_trainer(max_epochs=2, enable_checkpointing=True, callbacks=[own, other])
    # As in Lightning: no default ModelCheckpoint beside it, and it runs after the other callbacks
    assert trainer.checkpoint_callbacks == [own] and trainer.checkpoint_callback is own
    assert trainer.callbacks.index(own) > trainer.callbacks.index(other)
    trainer.fit(LinearRegression(), regression_loader)
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["epoch0.ckpt", "epoch1.ckpt"]


def test_the_prediction_writer_is_told_each_batchs_dataset_indices_as_lightnings_is(make_trainer):
    # A shuffled loader: the indices say which samples each batch held, so the writer can put predictions in order.
    class Indices(BasePredictionWriter):
        batch_indices, epoch_indices = [], None

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.batch_indices.append(batch_indices)
            assert torch.equal(batch[0], samples[batch_indices])  # the batch holds exactly those samples

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epoch_indices = batch_indices

    samples = torch.arange(20.0).reshape(5, 4)
    loader = DataLoader(TensorDataset(samples), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    writer = Indices("batch_and_epoch")
    make_trainer(callbacks=[writer]).predict(Predicting(), loader, return_predictions=False)
    assert [len(indices) for indices in writer.batch_indices] == [2, 2, 1]
    assert sorted(i for indices in writer.batch_indices for i in indices) == [0, 1, 2, 3, 4]
    assert writer.epoch_indices == [writer.batch_indices]  # one list per loader, as Lightning's


def test_the_rich_progress_bar_and_summary_run_drawn_as_the_plain_ones_and_refuse_rich_styling(make_trainer, capsys):
    # lightning-hydra-template's default callbacks: RichProgressBar() and RichModelSummary(max_depth=-1).
    bar, summary = callbacks.RichProgressBar(), callbacks.RichModelSummary(max_depth=-1)
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True, enable_model_summary=True, callbacks=[bar, summary])
    trainer.fit(LinearRegression(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4))
    assert trainer.progress_bar_callback is bar and trainer.global_step == 2
    assert "Trainable params" in capsys.readouterr().err  # the summary, printed once
    assert [type(c) for c in trainer.callbacks].count(callbacks.ProgressBar) == 0  # no second bar beside it
    with pytest.raises(ValueError, match=r"RichProgressBar\(theme=..., console_kwargs=...\): Cadence draws this bar "
                                         "with tqdm"):
        callbacks.RichProgressBar(theme=object())
    with pytest.raises(ValueError, match=r"RichModelSummary\(header_style=...\): Cadence prints this summary as plain"):
        callbacks.RichModelSummary(header_style="bold")
