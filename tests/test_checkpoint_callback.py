"""ModelCheckpoint: when it saves, what it keeps, and that its bookkeeping survives a restart."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import ModelCheckpoint
from trainer import TrainingModule


class Scored(TrainingModule):
    """Logs ``val/score`` from a fixed list, one value per validation (epoch)."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/score", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def checkpoint_names(directory) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_top_k_bookkeeping_survives_a_restart(make_trainer, regression_loader, tmp_path):
    scores = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]
    directory = tmp_path / "ckpt"

    def checkpoint():
        return ModelCheckpoint(dirpath=directory, monitor="val/score", save_top_k=2, filename="{epoch}")

    first = checkpoint()
    make_trainer(max_epochs=3, callbacks=[first], num_sanity_val_steps=0).fit(Scored(scores), regression_loader, regression_loader)
    assert checkpoint_names(directory) == ["1.ckpt", "2.ckpt", "last.ckpt"]  # scores 3 and 4

    second = checkpoint()  # a new process: only the checkpoint knows what was kept
    make_trainer(max_epochs=6, callbacks=[second], num_sanity_val_steps=0).fit(
        Scored(scores), regression_loader, regression_loader, ckpt_path=directory / "last.ckpt")
    assert checkpoint_names(directory) == ["3.ckpt", "4.ckpt", "last.ckpt"]  # scores 1 and 2; 3 and 4 pruned
    assert second.best_k_models == {str(directory / "3.ckpt"): 1.0, str(directory / "4.ckpt"): 2.0}
    assert second.best_model_path == str(directory / "3.ckpt") and second.best_model_score == 1.0
    kept = torch.load(directory / "4.ckpt", weights_only=True)["callbacks"][second.state_key]
    assert str(directory / "4.ckpt") in kept["best_k_models"]  # each file records itself


def test_last_ckpt_is_the_ranked_checkpoint_of_the_same_moment(make_trainer, regression_loader, tmp_path):
    make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}")], limit_val_batches=0).fit(
        Scored([1.0]), regression_loader)
    assert (tmp_path / "8.ckpt").read_bytes() == (tmp_path / "last.ckpt").read_bytes()


def test_step_checkpoints_are_written_only_after_an_optimizer_step(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1,
                                 every_n_epochs=None, save_last=False)
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[checkpoint], limit_val_batches=0)
    trainer.fit(Scored([1.0]), regression_loader)  # 8 batches: steps after batches 2, 5 and 7
    assert checkpoint_names(tmp_path) == ["1.ckpt", "2.ckpt", "3.ckpt"]
    done = [torch.load(tmp_path / f"{step}.ckpt", weights_only=True)["loops"]["batches_done"] for step in (1, 2, 3)]
    assert done == [3, 6, 8]  # never inside an accumulation window


def test_a_train_time_interval_is_checked_every_log_every_n_steps_optimizer_steps(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_epochs=None,
                                 save_last=False, train_time_interval=1e-9)  # always due, when checked
    make_trainer(max_epochs=1, log_every_n_steps=3, callbacks=[checkpoint], limit_val_batches=0).fit(
        Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path) == ["3.ckpt", "6.ckpt"]


def test_a_missing_monitor_warns_before_validation_and_fails_after_saving_last(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/scroe", every_n_train_steps=4)
    trainer = make_trainer(max_epochs=1, callbacks=[checkpoint], num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match=r"monitor='val/scroe'\) found no such metric at step 4 .* only last.ckpt is written"):
        with pytest.raises(RuntimeError, match=r"monitor='val/scroe'\) found no such metric after validation; logged "
                                               r"metrics are \['val/score'\]. last.ckpt was saved"):
            trainer.fit(Scored([1.0]), regression_loader, regression_loader)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["epoch"] == 1  # nothing lost


def test_a_nan_score_ranks_as_the_worst(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", filename="{epoch}")
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(
        Scored([2.0, math.nan]), regression_loader, regression_loader)
    assert checkpoint.best_model_path == str(tmp_path / "0.ckpt")


def test_a_filename_naming_an_unknown_metric_is_an_error(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val/los:.2f}")
    with pytest.raises(ValueError, match=r"filename='\{epoch\}-\{val/los:.2f\}'\) names 'val_los', which is not among "
                                         r"epoch, step and the logged metrics \['val/score'\]"):
        make_trainer(max_epochs=1, callbacks=[checkpoint]).fit(Scored([1.0]), regression_loader, regression_loader)


def test_a_checkpoint_from_another_directory_does_not_restore_its_bookkeeping(make_trainer, regression_loader, tmp_path):
    make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "a")], limit_val_batches=0).fit(
        Scored([1.0] * 2), regression_loader)
    moved = ModelCheckpoint(dirpath=tmp_path / "b")
    with pytest.warns(UserWarning, match=r"dirpath changed from .*a to .*b; the top-k bookkeeping of the old directory is not restored"):
        make_trainer(max_epochs=2, callbacks=[moved], limit_val_batches=0).fit(Scored([1.0] * 2), regression_loader, ckpt_path=tmp_path / "a" / "last.ckpt")
    assert checkpoint_names(tmp_path / "a") == ["epoch=0-step=8.ckpt", "last.ckpt"]  # nothing deleted there


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "best"}, r'ModelCheckpoint\(mode="best"\): use "min" or "max"'),
    ({"save_top_k": -2}, r"ModelCheckpoint\(save_top_k=-2\): use -1 \(all\), 0, or a positive int"),
    ({"every_n_train_steps": 0}, r"ModelCheckpoint\(every_n_train_steps=0\): use an int >= 1 or None"),
    ({"every_n_epochs": 1.5}, r"ModelCheckpoint\(every_n_epochs=1.5\): use an int >= 1 or None"),
    ({"train_time_interval": -1}, r"ModelCheckpoint\(train_time_interval=-1\): use seconds > 0 or None"),
    ({"monitor": ""}, r"ModelCheckpoint\(monitor=''\): use the name of a logged metric, or None"),
    ({"filename": 7}, r"ModelCheckpoint\(filename=7\): use a format string"),
    ({"dirpath": 7}, r"ModelCheckpoint\(dirpath=7\): use a directory path or None"),
])
def test_bad_model_checkpoint_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)


def test_a_dirpath_that_is_a_file_is_an_error(make_trainer, regression_loader, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(dirpath='.*file'\) is a file; use a directory"):
        make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "file")], limit_val_batches=0).fit(
            Scored([1.0]), regression_loader)
