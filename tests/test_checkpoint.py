"""Checkpoint files: what they hold, how they load, and every way a bad one fails clearly.

A checkpoint must hold the whole state as tensors and plain data (so ``weights_only=True`` loads
it), be written atomically (a full disk or a kill leaves the previous file whole), and every bad
input (a file that would run code, a truncated one, a missing path, another model's weights)
must fail naming the file, before anything is lost.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import Callback, ModelCheckpoint
from trainer import TrainingModule


class Color(enum.Enum):
    RED = "red"


class Regressor(TrainingModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1, data_dir: Path = Path("/data"), color: Color = Color.RED,
                 activation: nn.Module | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}


class Validated(Regressor):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.mse_loss(self.net(batch[0]), batch[1]))


class EveryStage(Validated):
    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


class OtherModel(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)


@pytest.fixture
def checkpoint(make_trainer, regression_loader, tmp_path):
    """A checkpoint written by ModelCheckpoint after one epoch of 8 batches."""
    trainer = make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    trainer.fit(Regressor(activation=nn.Tanh()), regression_loader)
    return tmp_path / "ckpt" / "last.ckpt"


def test_a_checkpoint_holds_the_whole_training_state_as_plain_data(checkpoint):
    state = torch.load(checkpoint, weights_only=True)  # loads without running any code
    cadence_loops = {key: state["loops"][key] for key in ("epoch", "batches_done", "global_step", "train_batches_seen", "world_size",
                                                              "validation_pending")}
    assert cadence_loops == {"epoch": 1, "batches_done": 0, "global_step": 8, "train_batches_seen": 8, "world_size": 1,
                             "validation_pending": False}
    assert set(state["state_dict"]) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert state["optimizer_states"][0]["state"][0]["step"] == 8
    assert state["lr_schedulers"][0]["last_epoch"] == 1  # stepped once per epoch
    (rank_zero,) = state["rng"]  # one entry per process
    assert set(rank_zero["now"]) == {"python", "numpy", "torch", "cuda", "mps", "generators"}  # mps: None without one
    assert rank_zero["epoch_start"] is not None  # the RNG the epoch's shuffle was drawn from
    assert ("ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
            "'train_time_interval': None}") in state["callbacks"]  # Lightning's key
    assert state["hyper_parameters"] == {"hidden": 8, "lr": 0.1, "data_dir": "/data", "color": "red", "activation": "Tanh()"}
    assert state["hyper_parameters_inexact"] == ["activation", "color"]  # load_from_checkpoint asks for them
    assert set(state["versions"]) == {"torch", "python", "cadence"}


def test_a_checkpoint_that_would_run_code_when_loaded_is_refused(make_trainer, regression_loader, tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ("this must never print",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode()}, path)
    with pytest.raises(ValueError, match=rf"Refusing to load checkpoint {path}: it contains a pickled print, "
                                         r"which would run code"):
        make_trainer(max_epochs=1).fit(Regressor(), regression_loader, ckpt_path=path)
    # Lightning's weights_only=False (torch.load of a trusted file) does not make Cadence run code from a file either
    for stage in ("fit", "validate", "test", "predict"):
        with pytest.raises(ValueError, match=r"pickled print.*whatever weights_only= the Trainer's stages .* are given"):
            getattr(make_trainer(max_epochs=1), stage)(EveryStage(), regression_loader, ckpt_path=path, weights_only=False)


def test_a_stage_takes_lightnings_weights_only_and_reads_a_plain_checkpoint_either_way(checkpoint, make_trainer,
                                                                                      regression_loader):
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    for weights_only in (None, True, False):  # Lightning: passed on to torch.load, which reads plain data with any
        model = Validated()
        make_trainer().validate(model, regression_loader, ckpt_path=checkpoint, weights_only=weights_only)
        assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    resumed = make_trainer(max_epochs=2)
    resumed.fit(Regressor(), regression_loader, ckpt_path=checkpoint, weights_only=False)
    assert resumed.global_step == 16  # continued after the checkpoint's epoch: 8 more steps
    with pytest.raises(TypeError, match=r"Trainer.test\(weights_only='no'\): use None, True or False"):
        make_trainer().test(Validated(), regression_loader, ckpt_path=checkpoint, weights_only="no")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_truncated_or_corrupted_checkpoint_fails_naming_the_file(checkpoint, make_trainer, regression_loader, damage):
    data = checkpoint.read_bytes()
    checkpoint.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(300), "empty": b""}[damage])
    with pytest.raises(ValueError, match=rf"Checkpoint {checkpoint} is truncated or corrupted .* Use an earlier checkpoint"):
        make_trainer(max_epochs=2).fit(Regressor(), regression_loader, ckpt_path=checkpoint)


def test_a_file_the_safe_loader_refuses_is_never_answered_with_advice_to_load_it_unsafely(make_trainer, regression_loader,
                                                                                           tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_bytes(b"not a checkpoint, only some text\n" * 4)
    for load in (lambda: make_trainer(max_epochs=1).fit(Regressor(), regression_loader, ckpt_path=path),
                 lambda: Regressor.load_from_checkpoint(path)):
        with pytest.raises(ValueError, match=rf"{path} is truncated or corrupted \(Unsupported operand 110\)") as caught:
            load()
        assert "weights_only" not in str(caught.value)  # torch's own message suggests weights_only=False


def test_load_from_checkpoint_of_a_missing_file_says_so_without_fit_s_advice(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"^Checkpoint file not found: {tmp_path / 'nope.ckpt'} does not exist. Check the path.$"):
        Regressor.load_from_checkpoint(tmp_path / "nope.ckpt")  # not ckpt_path="last": no such argument here


def test_a_missing_checkpoint_fails_before_anything_starts(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(FileNotFoundError, match=rf"Checkpoint file not found: {tmp_path / 'nope.ckpt'} does not exist"):
        trainer.fit(Regressor(), regression_loader, ckpt_path=tmp_path / "nope.ckpt")  # Lightning's first words
    with pytest.raises(FileNotFoundError, match=rf"Checkpoint {tmp_path} is a directory"):
        trainer.fit(Regressor(), regression_loader, ckpt_path=tmp_path)
    with pytest.raises(TypeError, match=r"Trainer.fit\(ckpt_path=3\): pass a checkpoint path, \"last\", \"best\" or None"):
        trainer.fit(Regressor(), regression_loader, ckpt_path=3)
    assert trainer.global_step == 0 and not (tmp_path / "lightning_logs").exists()


def test_a_checkpoint_of_another_model_names_the_missing_and_unexpected_keys(checkpoint, make_trainer, regression_loader):
    with pytest.raises(ValueError, match=rf"Checkpoint {checkpoint} does not fit OtherModel: missing keys "
                                         r"\[head.bias, head.weight\], unexpected keys \[none\]"):
        make_trainer(max_epochs=2).fit(OtherModel(), regression_loader, ckpt_path=checkpoint)


def test_a_checkpoint_of_other_shapes_names_them_and_the_hyperparameters_that_wrote_it(checkpoint, make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"shapes differ for \[net.0.weight: checkpoint \(8, 4\), model \(16, 4\), .*'hidden': 8"):
        make_trainer(max_epochs=2).fit(Regressor(hidden=16), regression_loader, ckpt_path=checkpoint)


def test_a_file_without_training_state_cannot_resume_training(make_trainer, regression_loader, tmp_path):
    weights, other = tmp_path / "weights.pt", tmp_path / "other.pt"
    torch.save({"state_dict": Regressor().state_dict()}, weights)
    torch.save(Regressor().state_dict(), other)
    with pytest.raises(ValueError, match=rf"Checkpoint {weights} holds weights but not the training state"):
        make_trainer(max_epochs=1).fit(Regressor(), regression_loader, ckpt_path=weights)
    with pytest.raises(ValueError, match=rf"{other} is not a Cadence checkpoint: it has no 'state_dict'"):
        make_trainer(max_epochs=1).fit(Regressor(), regression_loader, ckpt_path=other)


def test_a_checkpoint_from_a_newer_cadence_is_refused(checkpoint, make_trainer, regression_loader):
    state = torch.load(checkpoint, weights_only=True)
    torch.save(dict(state, format=99), checkpoint)
    with pytest.raises(ValueError, match=r"has format 99, newer than this Cadence reads \(1\).*Upgrade torchcadence"):
        make_trainer(max_epochs=2).fit(Regressor(), regression_loader, ckpt_path=checkpoint)


def test_validate_with_a_checkpoint_loads_its_weights_only(checkpoint, make_trainer, regression_loader, caplog):
    model = Validated()
    with caplog.at_level(logging.INFO):  # pytest configures logging: the line goes there, as Lightning's
        make_trainer().validate(model, regression_loader, ckpt_path=checkpoint)
    assert f"Loaded model weights from the checkpoint at {checkpoint}" in caplog.messages  # Lightning's line
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())


class SaveAtStep(Callback):
    """``trainer.save_checkpoint`` once, after the first batch at which optimizer step ``step`` is done."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)


def test_a_full_disk_leaves_the_previous_checkpoint_intact_and_says_so(make_trainer, regression_loader, tmp_path, monkeypatch):
    path = tmp_path / "state.ckpt"
    make_trainer(max_epochs=1, callbacks=[SaveAtStep(path, 2)]).fit(Regressor(), regression_loader)
    before = path.read_bytes()
    save = torch.save

    def disk_fills(state, file, *args, **kwargs):
        file.write(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_fills)
    with pytest.raises(OSError, match=rf"Could not write the checkpoint {path} .*; the previous checkpoint {path} "
                                      r"is intact. The disk is full"):
        make_trainer(max_epochs=1, callbacks=[SaveAtStep(path, 4)]).fit(Regressor(), regression_loader)
    monkeypatch.setattr(torch, "save", save)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temporary left behind


def test_a_temporary_left_by_a_killed_write_is_removed_by_the_next_write(make_trainer, regression_loader, tmp_path):
    stale = tmp_path / ".state.ckpt.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    make_trainer(max_epochs=1, callbacks=[SaveAtStep(tmp_path / "state.ckpt", 2)]).fit(Regressor(), regression_loader)
    assert not stale.exists() and (tmp_path / "state.ckpt").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_checkpoint_file_follows_the_umask_like_any_file_the_user_writes(make_trainer, regression_loader, tmp_path, umask):
    previous = os.umask(umask)
    try:
        make_trainer(max_epochs=1, callbacks=[SaveAtStep(tmp_path / "state.ckpt", 2)]).fit(Regressor(), regression_loader)
    finally:
        os.umask(previous)
    assert (tmp_path / "state.ckpt").stat().st_mode & 0o777 == 0o666 & ~umask  # 0644 or 0600, not always 0600


class UnsafeState(Callback):
    def state_dict(self):
        return {"scale": np.ones(2)}  # an array: torch's safe loader refuses NumPy's classes


def test_a_snapshot_taken_to_the_host_is_what_is_written_however_training_goes_on(tmp_path):
    from strategies.checkpoint import snapshot, write_file  # the two halves of a save (asynchronous saves)

    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step():
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()

    train_step()
    state = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
             "tied": {"a": model.weight, "b": model.weight}}
    weight, exp_avg = model.weight.detach().clone(), optimizer.state[model.weight]["exp_avg"].clone()
    taken = snapshot(state, to_host=True)
    for _ in range(3):  # training changes the tensors in place before (or while) the snapshot is written
        train_step()
    write_file(taken, tmp_path / "snapshot.ckpt")

    written = torch.load(tmp_path / "snapshot.ckpt", weights_only=True)
    assert torch.equal(written["state_dict"]["weight"], weight) and not torch.equal(model.weight, weight)
    assert torch.equal(written["optimizer_states"][0]["state"][0]["exp_avg"], exp_avg)
    assert written["optimizer_states"][0]["state"][0]["step"] == 1
    assert written["tied"]["a"].data_ptr() == written["tied"]["b"].data_ptr()  # one tensor, stored once
    with pytest.raises(TypeError, match=r"checkpoint\['lr'\] is a numpy.ndarray"):
        snapshot({"lr": np.array(0.1)}, to_host=True)


def test_state_that_would_not_load_safely_is_refused_before_writing(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1, callbacks=[UnsafeState(), SaveAtStep(tmp_path / "state.ckpt", 2)])
    with pytest.raises(TypeError, match=r"checkpoint\['callbacks'\]\['UnsafeState'\]\['scale'\] is a numpy.ndarray. "
                                        r"A checkpoint holds only tensors and plain data"):
        trainer.fit(Regressor(), regression_loader)
    assert not (tmp_path / "state.ckpt").exists()


def test_save_checkpoint_before_any_fit_says_how_to_save(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match=r"no training state to write: no fit has finished on this Trainer. .* "
                                           r"torch.save\(model.state_dict"):
        trainer.save_checkpoint(tmp_path / "after.ckpt")


class FailsOnce(Regressor):
    def training_step(self, batch, batch_idx):
        if batch_idx == 4 and not getattr(self, "failed", False):
            self.failed = True
            raise ValueError("batch 4 failed")
        return super().training_step(batch, batch_idx)


def test_save_checkpoint_after_a_fit_that_raised_saves_the_state_it_failed_in(make_trainer, regression_loader, tmp_path):
    # Lightning 2.6.5 (its test_restarting_mid_epoch_raises_warning; run in its venv with a BoringModel failing at
    # batch 4 of 8): save_checkpoint after the failed fit writes global_step 4 of epoch 0, and fit(ckpt_path=...)
    # from it ends at global step 8. Cadence trains the failed batch again, so the resumed run gives the same steps.
    trainer, model = make_trainer(max_epochs=1), FailsOnce()
    with pytest.raises(ValueError, match="batch 4 failed"):
        trainer.fit(model, regression_loader)
    trainer.save_checkpoint(tmp_path / "failed.ckpt")
    written = torch.load(tmp_path / "failed.ckpt", weights_only=True)
    assert (written["global_step"], written["epoch"], len(written["optimizer_states"])) == (4, 0, 1)
    resumed = make_trainer(max_epochs=1)
    resumed.fit(model, regression_loader, ckpt_path=tmp_path / "failed.ckpt")
    assert resumed.global_step == 8


def test_save_checkpoint_with_no_model_attached_is_lightnings_attribute_error(make_trainer, tmp_path):
    # Lightning 2.6.5 (its test_trainer_save_checkpoint_no_model_attached): AttributeError("Saving a checkpoint is
    # only possible if a model is attached to the Trainer. ...") from a Trainer that never ran a stage.
    trainer = make_trainer(max_epochs=1)
    assert trainer.model is None
    with pytest.raises(AttributeError, match="Saving a checkpoint is only possible if a model is attached"):
        trainer.save_checkpoint(tmp_path / "checkpoint.ckpt")


def test_a_different_number_of_optimizers_is_an_error(checkpoint, make_trainer, regression_loader):
    class TwoOptimizers(Regressor):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(ValueError, match=rf"Checkpoint {checkpoint} has 1 LR schedulers, but configure_optimizers returned 0"):
        make_trainer(max_epochs=2).fit(TwoOptimizers(), regression_loader, ckpt_path=checkpoint)


def test_ckpt_path_last_loads_nothing_when_there_is_none_with_a_warning(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1)
    # Lightning 2.6.5's words first ('.fit(ckpt_path="last") is set, ... No checkpoint will be loaded.'), then where
    with pytest.warns(UserWarning, match=r'^\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint available\. '
                                         r'No checkpoint will be loaded: found no last.ckpt in .*; training starts from scratch'):
        trainer.fit(Regressor(), regression_loader, ckpt_path="last")
    assert trainer.global_step == 8
    model = Validated()  # Lightning 2.6.6: a warning, and validate runs the module's own weights
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r'^\.validate\(ckpt_path="last"\) is set, but there is no last checkpoint '
                                         r"available\. No checkpoint will be loaded: found no last.ckpt in .*; the module "
                                         r"keeps its weights"):
        [result] = trainer.validate(model, regression_loader, ckpt_path="last", verbose=False)
    assert trainer.ckpt_path is None and "val/loss" in result
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())


def test_a_checkpoint_after_a_validation_inside_an_accumulation_window_names_val_check_interval(make_trainer, regression_loader):
    # lightning-bolts' BYOL with accumulate_grad_batches=2 and val_check_interval=0.5 over 5-batch halves: its
    # ModelCheckpoint saved inside a window, and the warning said "ModelCheckpoint does" save at a window's end.
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2, val_check_interval=3, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(monitor="val/loss")])
    with pytest.warns(UserWarning, match=r"save_checkpoint after batch 2, inside an accumulation window of 2 batches: .* "
                                         r"unless a validation inside a window triggers it \(make val_check_interval a "
                                         r"multiple of accumulate_grad_batches\)"):
        trainer.fit(Validated(), regression_loader, regression_loader)


def test_a_checkpoint_inside_an_accumulation_window_warns_that_it_is_not_exact(make_trainer, regression_loader, tmp_path):
    class SaveAtBatch(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 4:  # the first batch of the second window of 4
                trainer.save_checkpoint(tmp_path / "state.ckpt")

    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=4, callbacks=[SaveAtBatch()])
    with pytest.warns(UserWarning, match=r"save_checkpoint after batch 4, inside an accumulation window of 4 batches: the "
                                         r"gradients accumulated so far are not saved"):
        trainer.fit(Regressor(), regression_loader)
