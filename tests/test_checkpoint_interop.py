"""Checkpoints other tools read and write: what torch's safe loader accepts, Lightning's layout.

A checkpoint holds what ``torch.load(weights_only=True)`` loads: a MultiStepLR's Counter, and a
learning rate a scheduler computed with NumPy (stored as the Python number of the same value), and
a resumed run trains on exactly as the uninterrupted one. It carries Lightning's top-level keys, so
tools that read Lightning checkpoints read it; and a checkpoint in the layout Lightning 2.6 writes
(built here with plain torch: the tests never need Lightning) loads into ``load_from_checkpoint``
and ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch

from callbacks import Callback, ModelCheckpoint
from linear_regression import LinearRegression


class CosineWarmupScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The warm-up scheduler of a popular tutorial (UvA DL course, notebook 5): its learning rates
    are NumPy floats (``np.cos``), which the optimizer's param_groups then hold."""

    def __init__(self, optimizer, warmup: int, max_iters: int) -> None:
        self.warmup, self.max_num_iters = warmup, max_iters
        super().__init__(optimizer)

    def get_lr(self):
        factor = 0.5 * (1 + np.cos(np.pi * self.last_epoch / self.max_num_iters))
        if self.last_epoch <= self.warmup:
            factor *= self.last_epoch * 1.0 / self.warmup
        return [base_lr * factor for base_lr in self.base_lrs]


class TwoSchedulers(LinearRegression):
    """Adam with two schedulers: the NumPy warm-up each step, MultiStepLR (a Counter) each epoch."""

    def configure_optimizers(self):
        adam = torch.optim.Adam(self.parameters(), lr=0.05)
        return [adam], [{"scheduler": CosineWarmupScheduler(adam, warmup=3, max_iters=40), "interval": "step"},
                        torch.optim.lr_scheduler.MultiStepLR(adam, milestones=[1, 2], gamma=0.5)]


class SaveAtStep(Callback):
    """``trainer.save_checkpoint`` after optimizer step ``step``, or with ``epoch_end`` in the end
    hooks of the epoch that made it."""

    def __init__(self, path, step: int, epoch_end: bool = False) -> None:
        self.path, self.step, self.epoch_end = path, step, epoch_end

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.epoch_end:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, module):
        if trainer.global_step == self.step and self.epoch_end:
            trainer.save_checkpoint(self.path)


def _fresh() -> TwoSchedulers:
    torch.manual_seed(0)
    return TwoSchedulers()


def test_numpy_learning_rates_and_multisteplr_are_saved_and_resume_exactly(make_trainer, regression_loader, tmp_path):
    path = tmp_path / "mid.ckpt"
    reference = _fresh()
    make_trainer(max_epochs=3, callbacks=[SaveAtStep(path, 11)]).fit(reference, regression_loader)
    assert isinstance(reference.trainer.optimizers[0].param_groups[0]["lr"], np.floating)  # what the tutorial does

    state = torch.load(path, weights_only=True)  # torch's own safe loader reads it, no allow-list needed
    adam_lr = state["optimizer_states"][0]["param_groups"][0]["lr"]
    assert type(adam_lr) is float and math.isfinite(adam_lr) and adam_lr > 0
    assert type(state["lr_schedulers"][1]["milestones"]) is collections.Counter

    resumed = _fresh()
    trainer = make_trainer(max_epochs=3)
    trainer.fit(resumed, regression_loader, ckpt_path=path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name  # bit-identical to the uninterrupted run
    assert trainer.lr_scheduler_configs[1].scheduler.milestones == collections.Counter([1, 2])


def test_modelcheckpoint_saves_a_numpy_learning_rate(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(_fresh(), regression_loader)  # refused at its first checkpoint before
    assert (tmp_path / "last.ckpt").is_file()


# =============================================================================================
# Lightning's layout
# =============================================================================================
class Tutorial(LinearRegression):
    """Keeps its hyperparameters; SGD with momentum and a StepLR: state in every part of a checkpoint."""

    def __init__(self, lr: float = 0.1, width: int = 4) -> None:
        super().__init__(lr)
        self.save_hyperparameters()

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [sgd], [torch.optim.lr_scheduler.StepLR(sgd, 1, gamma=0.5)]


def test_a_checkpoint_carries_lightnings_top_level_keys(make_trainer, regression_loader, tmp_path):
    path = tmp_path / "mid.ckpt"
    make_trainer(max_epochs=2, callbacks=[SaveAtStep(path, 11)]).fit(Tutorial(lr=0.05), regression_loader)
    state = torch.load(path, weights_only=True)
    assert {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks", "optimizer_states",
            "lr_schedulers", "hyper_parameters", "hparams_name"} <= set(state)
    assert (state["epoch"], state["global_step"]) == (1, 11)  # Lightning's: trainer.current_epoch, trainer.global_step
    assert state["pytorch-lightning_version"].startswith("2.")  # a Lightning release: its loaders migrate by it
    assert state["hyper_parameters"] == {"lr": 0.05, "width": 4} and state["hparams_name"] == "kwargs"
    fit_loop = state["loops"]["fit_loop"]  # what Lightning's fit(ckpt_path=...) reads its position from
    assert fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] == 11
    assert fit_loop["epoch_progress"]["current"]["completed"] == 1  # epoch 1 under way
    assert fit_loop["epoch_loop.batch_progress"]["current"]["processed"] == 3  # its batches 0, 1 and 2 trained
    assert set(state["loops"]) >= {"fit_loop", "validate_loop", "test_loop", "predict_loop"}
    # Only callbacks with a state, as Lightning writes them (else Lightning asks for the others when it resumes).
    assert all(state["callbacks"].values()) and not any(key.startswith("SaveAtStep") for key in state["callbacks"])


def _progress(ready, started, processed, completed):
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def _lightning_checkpoint(cadence_state, epoch, epoch_progress, batch_progress, is_last_batch):
    """The checkpoint Lightning 2.6 writes at the same point as ``cadence_state`` (its
    ``CheckpointConnector.dump_checkpoint``): the same weights, optimizer and scheduler states, its
    loop progress as given, no RNG states."""
    step = cadence_state["global_step"]
    steps = {"total": {"ready": step, "completed": step}, "current": {"ready": step % 8, "completed": step % 8}}
    return {
        "epoch": epoch, "global_step": step, "pytorch-lightning_version": "2.6.6",
        "state_dict": cadence_state["state_dict"],
        "loops": {"fit_loop": {
            "state_dict": {}, "epoch_progress": {"total": epoch_progress, "current": epoch_progress},
            "epoch_loop.state_dict": {"_batches_that_stepped": step - (batch_progress["processed"] - batch_progress["completed"])},
            "epoch_loop.batch_progress": {"total": {key: value + 8 * epoch for key, value in batch_progress.items()},
                                          "current": batch_progress, "is_last_batch": is_last_batch},
            "epoch_loop.scheduler_progress": {"total": {"ready": epoch, "completed": epoch}, "current": {"ready": 0, "completed": 0}},
            "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": steps, "zero_grad": steps}},
            "epoch_loop.automatic_optimization.state_dict": {}, "epoch_loop.manual_optimization.state_dict": {},
            "epoch_loop.manual_optimization.optim_step_progress": {"total": {"ready": 0, "completed": 0},
                                                                   "current": {"ready": 0, "completed": 0}},
        }},
        "callbacks": {}, "optimizer_states": cadence_state["optimizer_states"],
        "lr_schedulers": cadence_state["lr_schedulers"], "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.05, "width": 4},
    }


# Where Lightning saves, and its progress counters there (as Lightning 2.6.6 wrote them, 8 batches an epoch).
LIGHTNING_SAVES = {
    # ModelCheckpoint(every_n_train_steps=...) after batch 0 of epoch 1: the batch is processed, not completed
    "mid-epoch": (9, 1, _progress(2, 2, 1, 1), _progress(1, 1, 1, 0), False),
    # ModelCheckpoint at the end of epoch 0 (its schedulers stepped): the epoch is processed, not completed
    "epoch end": (8, 0, _progress(1, 1, 1, 0), _progress(8, 8, 8, 8), True),
}


@pytest.mark.parametrize("where", LIGHTNING_SAVES)
def test_a_checkpoint_lightning_wrote_resumes_fit_where_it_was_written(make_trainer, regression_loader, tmp_path, where):
    step, epoch, epoch_progress, batch_progress, is_last_batch = LIGHTNING_SAVES[where]
    torch.manual_seed(0)
    reference = Tutorial(lr=0.05)
    cadence = tmp_path / "cadence.ckpt"
    make_trainer(max_epochs=3, callbacks=[SaveAtStep(cadence, step, epoch_end=is_last_batch)]).fit(reference, regression_loader)
    path = tmp_path / "lightning.ckpt"
    torch.save(_lightning_checkpoint(torch.load(cadence, weights_only=True), epoch, epoch_progress, batch_progress,
                                     is_last_batch), path)

    resumed = Tutorial.load_from_checkpoint(path)
    assert resumed.hparams == {"lr": 0.05, "width": 4}
    trainer = make_trainer(max_epochs=3)
    with pytest.warns(UserWarning, match="holds no RNG states .* will not continue exactly") as warned:
        trainer.fit(resumed, regression_loader, ckpt_path=path)
    assert len([w for w in warned if "RNG" in str(w.message)]) == 1
    assert trainer.global_step == 24
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # the schedule went on from the checkpoint's
    for name, tensor in reference.state_dict().items():  # an unshuffled loader: the same batches, the same weights
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_a_weights_only_checkpoint_lightning_wrote_loads_but_does_not_resume(make_trainer, regression_loader, tmp_path):
    path = tmp_path / "weights.ckpt"
    weights = Tutorial(lr=0.05).state_dict()
    torch.save({"epoch": 0, "global_step": 8, "pytorch-lightning_version": "2.6.6", "state_dict": weights,
                "loops": {"fit_loop": {}}, "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.05, "width": 4}}, path)
    loaded = Tutorial.load_from_checkpoint(path)
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in weights.items())
    with pytest.raises(ValueError, match="holds weights but not the training state"):
        make_trainer(max_epochs=1).fit(Tutorial(), regression_loader, ckpt_path=path)
