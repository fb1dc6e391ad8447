"""ModelCheckpoint: Lightning's arguments and file names, when it saves, what it keeps, and that its
bookkeeping survives a restart."""

from __future__ import annotations

import inspect
import math
import pickle
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Literal, Optional, Union

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from callbacks import ModelCheckpoint
from linear_regression import LinearRegression
from trainer import Trainer, TrainingModule


class Scored(TrainingModule):
    """Logs ``val/score`` from a fixed list, one value per validation (epoch)."""

    def __init__(self, scores: list[float], lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.scores = scores
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/score", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Loss(Scored):
    """Logs its real validation loss as ``val_loss``."""

    def __init__(self) -> None:
        super().__init__([])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))


def checkpoint_names(directory) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_top_k_bookkeeping_survives_a_restart(make_trainer, regression_loader, tmp_path):
    scores = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]
    directory = tmp_path / "ckpt"

    def checkpoint():
        return ModelCheckpoint(dirpath=directory, monitor="val/score", save_top_k=2, filename="{epoch}")

    first = checkpoint()
    make_trainer(max_epochs=3, callbacks=[first], num_sanity_val_steps=0).fit(Scored(scores), regression_loader, regression_loader)
    assert checkpoint_names(directory) == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"]  # scores 3 and 4

    second = checkpoint()  # a new process: only the checkpoint knows what was kept
    make_trainer(max_epochs=6, callbacks=[second], num_sanity_val_steps=0).fit(
        Scored(scores), regression_loader, regression_loader, ckpt_path=directory / "last.ckpt")
    assert checkpoint_names(directory) == ["epoch=3.ckpt", "epoch=4.ckpt", "last.ckpt"]  # scores 1 and 2; 3, 4 pruned
    assert second.best_k_models == {str(directory / "epoch=3.ckpt"): 1.0, str(directory / "epoch=4.ckpt"): 2.0}
    assert second.best_model_path == str(directory / "epoch=3.ckpt") and second.best_model_score.item() == 1.0
    assert second.kth_best_model_path == str(directory / "epoch=4.ckpt") and second.kth_value == 2.0
    kept = torch.load(directory / "epoch=4.ckpt", weights_only=True)["callbacks"][second.state_key]
    assert str(directory / "epoch=4.ckpt") in kept["best_k_models"]  # each file records itself
    assert second.state_key == ("ModelCheckpoint{'monitor': 'val/score', 'mode': 'min', 'every_n_train_steps': 0, "
                                "'every_n_epochs': 1, 'train_time_interval': None}")  # Lightning's
    second.to_yaml(tmp_path / "best.yaml")  # Lightning's: path -> score
    assert yaml.safe_load((tmp_path / "best.yaml").read_text()) == {str(directory / "epoch=3.ckpt"): 1.0,
                                                                    str(directory / "epoch=4.ckpt"): 2.0}


def test_the_checkpoint_a_run_resumed_from_is_never_pruned(make_trainer, regression_loader, tmp_path):
    # Lightning's _should_remove_checkpoint keeps the file the run resumed from, even when it leaves the top k.
    scores = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0]
    directory = tmp_path / "ckpt"

    def checkpoint():
        return ModelCheckpoint(dirpath=directory, monitor="val/score", save_top_k=1, filename="{epoch}")

    make_trainer(max_epochs=2, callbacks=[checkpoint()], num_sanity_val_steps=0).fit(Scored(scores), regression_loader, regression_loader)
    assert checkpoint_names(directory) == ["epoch=1.ckpt", "last.ckpt"]  # score 3
    second = checkpoint()
    make_trainer(max_epochs=5, callbacks=[second], num_sanity_val_steps=0).fit(
        Scored(scores), regression_loader, regression_loader, ckpt_path=directory / "epoch=1.ckpt")
    # epoch 3 (score 1) takes its place in the top 1, but the file stays: it is where this run began
    assert checkpoint_names(directory) == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert second.best_k_models == {str(directory / "epoch=3.ckpt"): 1.0}

def test_dirpath_is_a_str_with_the_home_directory_expanded_as_lightnings(tmp_path):
    assert ModelCheckpoint(dirpath="~/checkpoints").dirpath == str(Path.home() / "checkpoints")
    assert ModelCheckpoint(dirpath=Path("~/checkpoints")).dirpath == str(Path.home() / "checkpoints")
    assert ModelCheckpoint(dirpath=tmp_path).format_checkpoint_name({"epoch": 2, "step": 9}) == str(
        tmp_path / "epoch=2-step=9.ckpt")


def test_lightnings_file_names_insert_the_metric_names(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val_loss:.3f}", monitor="val_loss")
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(Loss(), regression_loader, regression_loader)
    loss = checkpoint.best_model_score.item()
    assert checkpoint.best_model_path == str(tmp_path / f"epoch=1-val_loss={loss:.3f}.ckpt")
    assert checkpoint.format_checkpoint_name({"epoch": 14, "val_loss": 0.0123}) == str(tmp_path / "epoch=14-val_loss=0.012.ckpt")
    plain = ModelCheckpoint(filename="e{epoch:02d}-acc{val/acc:.2f}", auto_insert_metric_name=False)
    assert plain.format_checkpoint_name({"epoch": 3, "val/acc": 0.5}) == "e03-acc0.50.ckpt"
    # As in Lightning, a metric name with "/" inserted into the name makes a subdirectory.
    assert ModelCheckpoint(filename="{epoch}-{val/acc:.2f}").format_checkpoint_name({"epoch": 3, "val/acc": 0.5}) == (
        "epoch=3-val/acc=0.50.ckpt")
    assert ModelCheckpoint().format_checkpoint_name({"epoch": 3, "step": 40}, ver=2) == "epoch=3-step=40-v2.ckpt"


def test_a_metric_name_with_a_slash_saves_into_a_subdirectory_as_in_lightning(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val/score:.1f}", monitor="val/score", save_top_k=1)
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(
        Scored([2.0, 1.0]), regression_loader, regression_loader)
    assert checkpoint.best_model_path == str(tmp_path / "epoch=1-val" / "score=1.0.ckpt")
    assert not (tmp_path / "epoch=0-val" / "score=2.0.ckpt").exists()  # pruned from its subdirectory


def test_by_default_every_epoch_is_saved_and_a_step_trigger_replaces_that(make_trainer, regression_loader, tmp_path):
    default = ModelCheckpoint(dirpath=tmp_path / "epochs", save_top_k=-1)
    make_trainer(max_epochs=2, callbacks=[default], limit_val_batches=0).fit(Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path / "epochs") == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    assert default.best_model_path == str(tmp_path / "epochs" / "epoch=1-step=16.ckpt")
    steps = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=5, save_top_k=-1, save_last=False)
    make_trainer(max_epochs=2, callbacks=[steps], limit_val_batches=0).fit(Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path / "steps") == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "epoch=1-step=15.ckpt"]


def test_save_last_writes_last_ckpt_when_training_ends_without_a_trigger(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=100)
    make_trainer(max_epochs=2, callbacks=[checkpoint], limit_val_batches=0).fit(Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path) == ["last.ckpt"] and checkpoint.last_model_path == str(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["global_step"] == 16


def test_last_ckpt_is_the_ranked_checkpoint_of_the_same_moment(make_trainer, regression_loader, tmp_path):
    make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}")], limit_val_batches=0).fit(
        Scored([1.0]), regression_loader)
    assert (tmp_path / "step=8.ckpt").read_bytes() == (tmp_path / "last.ckpt").read_bytes()
    assert (tmp_path / "step=8.ckpt").stat().st_ino == (tmp_path / "last.ckpt").stat().st_ino  # one file, linked


def test_save_last_link_points_at_the_newest_ranked_file(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", save_last="link", filename="{epoch}")
    make_trainer(max_epochs=3, callbacks=[checkpoint], num_sanity_val_steps=0).fit(
        Scored([2.0, 1.0, 3.0]), regression_loader, regression_loader)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and last.readlink().as_posix() == "epoch=1.ckpt"  # relative; epoch 2 was not ranked
    assert checkpoint_names(tmp_path) == ["epoch=1.ckpt", "last.ckpt"]


def test_step_checkpoints_are_written_only_after_an_optimizer_step(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1, save_last=False)
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[checkpoint], limit_val_batches=0)
    trainer.fit(Scored([1.0]), regression_loader)  # 8 batches: steps after batches 2, 5 and 7
    assert checkpoint_names(tmp_path) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
    done = [torch.load(tmp_path / f"step={step}.ckpt", weights_only=True)["loops"]["batches_done"] for step in (1, 2, 3)]
    assert done == [3, 6, 8]  # never inside an accumulation window


class SlowAt(Scored):
    """Training steps take 0.6 s at the given global steps, and a few ms otherwise."""

    def __init__(self, slow_steps: set[int]) -> None:
        super().__init__([1.0])
        self.slow_steps = slow_steps

    def training_step(self, batch, batch_idx):
        if self.global_step in self.slow_steps:
            time.sleep(0.6)
        return super().training_step(batch, batch_idx)


def test_a_train_time_interval_is_checked_after_every_step_not_only_at_log_steps(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, save_last=False,
                                 train_time_interval=timedelta(seconds=0.5))
    make_trainer(max_epochs=1, log_every_n_steps=50, callbacks=[checkpoint], limit_val_batches=0).fit(
        SlowAt({2, 5}), regression_loader)
    assert checkpoint_names(tmp_path) == ["step=3.ckpt", "step=6.ckpt"]  # the steps that ended past the interval


def test_a_missing_monitor_defers_to_validation_and_fails_after_it_saving_last(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/scroe", every_n_train_steps=4)
    trainer = make_trainer(max_epochs=1, callbacks=[checkpoint], num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match=r"monitor='val/scroe'\) found no such metric after validation; logged "
                                           r"metrics are \['val/score'\]. last.ckpt was saved"):
        trainer.fit(Scored([1.0]), regression_loader, regression_loader)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["batches_done"] == 8  # nothing lost


def test_a_step_trigger_before_the_first_validation_ranks_after_it(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", every_n_train_steps=3, save_top_k=-1,
                                 filename="{step}")
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0, val_check_interval=4).fit(
        Scored([2.0, 1.0]), regression_loader, regression_loader)
    # Steps 3, 6, 9, 12 and 15 are due; the metric is there from the validation after step 4, so step 3's
    # ranked file waits for it (last.ckpt keeps step 3 meanwhile); last.ckpt holds the end of training.
    assert checkpoint_names(tmp_path) == ["last.ckpt", "step=12.ckpt", "step=15.ckpt", "step=4.ckpt", "step=6.ckpt",
                                          "step=9.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["loops"]["global_step"] == 16


class Stream(torch.utils.data.IterableDataset):
    """A loader without a length: 64 samples of the regression problem, in batches of 8."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


def test_a_step_trigger_at_the_last_batch_of_a_loader_without_a_length_waits_for_the_validation_after_it(
        make_trainer, regression_data, tmp_path):
    # Lightning's rule, also when the epoch's length is known only at its last batch: the score of the
    # last validation is stale there, so the ranked file waits for the end-of-epoch validation.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", every_n_train_steps=8, save_top_k=-1,
                                 save_on_train_epoch_end=False, filename="{step}-{val/score:.1f}",
                                 auto_insert_metric_name=False, save_last=False)
    stream = torch.utils.data.DataLoader(Stream(regression_data), batch_size=8)
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(Scored([2.0, 1.0]), stream, stream)
    assert checkpoint_names(tmp_path) == ["16-1.0.ckpt", "8-2.0.ckpt"]


def test_with_a_relative_default_root_dir_the_checkpoint_paths_stay_relative_as_lightnings(
        make_trainer, regression_loader, tmp_path, monkeypatch):
    # Lightning joins default_root_dir (no logger) and "checkpoints" as given; a dirpath given is made absolute.
    monkeypatch.chdir(tmp_path)
    checkpoint = ModelCheckpoint()
    make_trainer(max_epochs=1, default_root_dir="runs", callbacks=[checkpoint]).fit(Scored([1.0]), regression_loader)
    assert checkpoint.dirpath == str(Path("runs", "checkpoints"))
    assert checkpoint.best_model_path == str(Path("runs", "checkpoints", "epoch=0-step=8.ckpt"))
    assert Path(checkpoint.best_model_path).is_file()
    given = ModelCheckpoint(dirpath="mine")
    assert given.dirpath == str(tmp_path.resolve() / "mine")


def test_a_nan_score_ranks_as_the_worst(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", filename="{epoch}")
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(
        Scored([2.0, math.nan]), regression_loader, regression_loader)
    assert checkpoint.best_model_path == str(tmp_path / "epoch=0.ckpt")


def test_a_pickled_model_checkpoint_equals_the_original(tmp_path):
    # Lightning 2.6.5's test_pickling: vars() of the unpickled callback equal the original's.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(minutes=5))
    assert vars(pickle.loads(pickle.dumps(checkpoint))) == vars(checkpoint)


def test_the_signature_gives_types_a_cli_parser_takes():
    # Lightning 2.6.5's test_save_last_cli hands inspect.signature's save_last annotation, its
    # Optional[Union[bool, Literal["link"]]], to jsonargparse's add_argument(type=...): a string there fails.
    parameters = inspect.signature(ModelCheckpoint).parameters
    assert parameters["save_last"].annotation == Optional[Union[bool, Literal["link"]]]
    assert not [name for name, parameter in parameters.items() if isinstance(parameter.annotation, str)]


def test_a_model_checkpoint_with_enable_checkpointing_false_is_refused_as_lightning(tmp_path):
    # Lightning 2.6.5 (its test_configure_model_checkpoint) raises "Trainer was configured with
    # `enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list."; enabled, the one given is the only one.
    with pytest.raises(ValueError, match="configured with `enable_checkpointing=False` but found `ModelCheckpoint`"):
        Trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint()], default_root_dir=tmp_path)
    given = ModelCheckpoint(monitor="foo")
    assert Trainer(callbacks=[given], default_root_dir=tmp_path).checkpoint_callbacks == [given]


def test_a_save_checkpoint_that_writes_no_file_gets_last_ckpt_through_it_too(make_trainer, regression_loader, tmp_path):
    # A save_checkpoint replaced (by a mock, or one that writes elsewhere) leaves no ranked file to hard-link
    # last.ckpt to: last.ckpt goes through it too. The calls are Lightning 2.6.5's with save_last=True (run in
    # its venv: epoch=0, last, epoch=1, last), also when the first score is NaN.
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", filename="{epoch}")
    trainer = make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0)
    written = []
    trainer.save_checkpoint = lambda path, **kwargs: written.append(Path(path).name)
    trainer.fit(Scored([math.nan, 3.0]), regression_loader, regression_loader)
    assert written == ["epoch=0.ckpt", "last.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert checkpoint.best_model_score == 3.0


def test_a_filename_naming_an_unknown_metric_puts_zero_as_lightning_and_says_so(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val/los:.2f}")
    with pytest.warns(UserWarning, match=r"filename='\{epoch\}-\{val/los:.2f\}'\) names 'val/los', which is not among "
                                         r"the logged metrics \['val/score'\]: it is 0 in the file name"):
        make_trainer(max_epochs=1, callbacks=[checkpoint]).fit(Scored([1.0]), regression_loader, regression_loader)
    assert (tmp_path / "epoch=0-val" / "los=0.00.ckpt").exists()


def test_verbose_says_what_was_saved_in_the_progress_bars_epochs(make_trainer, regression_loader, tmp_path, capsys):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/score", filename="{epoch}", verbose=True)
    make_trainer(max_epochs=2, callbacks=[checkpoint], num_sanity_val_steps=0).fit(
        Scored([2.0, 3.0]), regression_loader, regression_loader)
    err = capsys.readouterr().err
    assert (f"Epoch 1/2, global step 8: 'val/score' reached 2.00000 (best 2.00000), saving model to "
            f"'{tmp_path / 'epoch=0.ckpt'}' as top 1") in err
    assert "Epoch 2/2, global step 16: 'val/score' was not in top 1" in err


def test_several_validations_an_epoch_save_after_each_unless_told_to_save_at_epoch_ends(make_trainer, regression_loader, tmp_path):
    after_each = ModelCheckpoint(dirpath=tmp_path / "each", save_top_k=-1, filename="{step}")
    make_trainer(max_epochs=1, callbacks=[after_each], num_sanity_val_steps=0, val_check_interval=0.5).fit(
        Scored([1.0]), regression_loader, regression_loader)
    assert checkpoint_names(tmp_path / "each") == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    at_ends = ModelCheckpoint(dirpath=tmp_path / "ends", save_top_k=-1, filename="{step}", save_on_train_epoch_end=True)
    make_trainer(max_epochs=1, callbacks=[at_ends], num_sanity_val_steps=0, val_check_interval=0.5).fit(
        Scored([1.0]), regression_loader, regression_loader)
    assert checkpoint_names(tmp_path / "ends") == ["last.ckpt", "step=8.ckpt"]
    # Validation every second epoch: saved when it runs, so the ranking never reads an older epoch's metric.
    sparse = ModelCheckpoint(dirpath=tmp_path / "sparse", monitor="val/score", save_top_k=-1, filename="{epoch}")
    make_trainer(max_epochs=4, callbacks=[sparse], num_sanity_val_steps=0, check_val_every_n_epoch=2).fit(
        Scored([9.0, 1.0, 9.0, 2.0]), regression_loader, regression_loader)
    assert sparse.best_k_models == {str(tmp_path / "sparse" / "epoch=1.ckpt"): 1.0,
                                    str(tmp_path / "sparse" / "epoch=3.ckpt"): 2.0}


def test_a_name_already_on_disk_gets_a_version_unless_the_counter_is_off(make_trainer, regression_loader, tmp_path):
    for _ in range(2):
        make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=tmp_path / "counted")]).fit(
            Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path / "counted") == ["epoch=0-step=8-v1.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    for _ in range(2):
        make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "overwritten", enable_version_counter=False)]).fit(Scored([1.0]), regression_loader)
    assert checkpoint_names(tmp_path / "overwritten") == ["epoch=0-step=8.ckpt", "last.ckpt"]


def test_another_runs_files_in_the_directory_are_pointed_out_at_the_users_line(make_trainer, regression_loader, tmp_path):
    (tmp_path / "old.ckpt").write_bytes(b"")
    trainer = make_trainer(max_epochs=1, limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    with pytest.warns(UserWarning, match=f"Checkpoint directory {tmp_path} exists and is not empty") as warned:
        fit_line = sys._getframe().f_lineno + 1
        trainer.fit(Scored([1.0]), regression_loader)
    assert (warned[0].filename, warned[0].lineno) == (__file__, fit_line)  # not a line inside Cadence


def test_weights_only_checkpoints_load_for_evaluation_but_not_for_resuming(make_trainer, regression_loader, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, filename="{epoch}")
    trainer = make_trainer(max_epochs=1, callbacks=[checkpoint], limit_val_batches=0)
    model = Scored([1.0], lr=0.05)
    trainer.fit(model, regression_loader)
    state = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)
    assert "optimizer_states" not in state and "callbacks" not in state and state["hyper_parameters"] == {"lr": 0.05}
    loaded = Scored.load_from_checkpoint(tmp_path / "epoch=0.ckpt", scores=[3.0])
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
    [result] = make_trainer().validate(Scored([3.0]), regression_loader, ckpt_path=tmp_path / "epoch=0.ckpt")
    assert result == {"val/score": 3.0}
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt", weights_only=True)  # Lightning's argument, after fit too
    assert set(torch.load(tmp_path / "after_fit.ckpt", weights_only=True)) == set(state)
    with pytest.raises(ValueError, match=r"save_checkpoint\(storage_options=...\): Cadence writes local files only"):
        trainer.save_checkpoint(tmp_path / "remote.ckpt", storage_options={"anon": True})
    with pytest.raises(ValueError, match=r"epoch=0.ckpt holds weights only \(written with ModelCheckpoint\(save_weights_"
                                         r"only=True\) or save_checkpoint\(path, weights_only=True\)\).* fit cannot resume"):
        make_trainer(max_epochs=2).fit(Scored([1.0]), regression_loader, ckpt_path=tmp_path / "epoch=0.ckpt")


class FailsAt(Scored):
    def training_step(self, batch, batch_idx):
        if self.global_step == 5:
            raise ValueError("bad batch")
        return super().training_step(batch, batch_idx)


def test_save_on_exception_saves_the_state_the_run_failed_in(make_trainer, regression_loader, tmp_path, capsys):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_last=False)
    with pytest.raises(ValueError, match="bad batch"):
        make_trainer(max_epochs=1, callbacks=[checkpoint], limit_val_batches=0).fit(FailsAt([1.0]), regression_loader)
    assert checkpoint_names(tmp_path) == ["epoch=0-step=5.ckpt"]
    assert f"An ValueError was raised with message: bad batch, saved checkpoint to {tmp_path / 'epoch=0-step=5.ckpt'}" in (
        capsys.readouterr().err)


def test_a_checkpoint_from_another_directory_restores_only_its_best_model_path(make_trainer, regression_loader, tmp_path):
    make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "a")], limit_val_batches=0).fit(
        Scored([1.0] * 2), regression_loader)
    moved = ModelCheckpoint(dirpath=tmp_path / "b")
    # Lightning 2.6.5's words first (its test_model_checkpoint_saveload_ckpt matches "The dirpath has changed from").
    with pytest.warns(UserWarning, match=r"^The dirpath has changed from '.*a' to '.*b', .* only best_model_path is"):
        make_trainer(max_epochs=2, callbacks=[moved], limit_val_batches=0).fit(Scored([1.0] * 2), regression_loader,
                                                                               ckpt_path=tmp_path / "a" / "last.ckpt")
    assert checkpoint_names(tmp_path / "a") == ["epoch=0-step=8.ckpt", "last.ckpt"]  # nothing deleted there


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "best"}, r'ModelCheckpoint\(mode="best"\): use "min" or "max"'),
    ({"save_top_k": -2}, r"ModelCheckpoint\(save_top_k=-2\): use -1 \(all\), 0, or a positive int"),
    ({"save_top_k": 3}, r"ModelCheckpoint\(save_top_k=3, monitor=None\) is not a valid configuration: without a monitored metric"),
    ({"every_n_train_steps": -1}, r"ModelCheckpoint\(every_n_train_steps=-1\): use an int >= 0 \(0: off\) or None"),
    ({"every_n_epochs": 1.5}, r"ModelCheckpoint\(every_n_epochs=1.5\): use an int >= 0 \(0: off\) or None"),
    ({"train_time_interval": -1}, r"ModelCheckpoint\(train_time_interval=-1\): use a datetime.timedelta"),
    ({"every_n_train_steps": 10, "every_n_epochs": 1}, r"give one of them, as in Lightning; for several schedules, "
                                                       r"pass one ModelCheckpoint per schedule"),
    ({"monitor": ""}, r"ModelCheckpoint\(monitor=''\): use the name of a logged metric, or None"),
    ({"filename": 7}, r"ModelCheckpoint\(filename=7\): use a format string"),
    ({"dirpath": 7}, r"ModelCheckpoint\(dirpath=7\): use a directory path or None"),
    ({"save_last": "yes"}, r"ModelCheckpoint\(save_last='yes'\): use True, False or \"link\""),
    ({"save_weights_only": 1}, r"ModelCheckpoint\(save_weights_only=1\): use True or False"),
])
def test_bad_model_checkpoint_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**kwargs)


def test_a_dirpath_that_is_a_file_is_an_error(make_trainer, regression_loader, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(dirpath='.*file'\) is a file; use a directory"):
        make_trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=tmp_path / "file")], limit_val_batches=0).fit(
            Scored([1.0]), regression_loader)


def test_test_best_after_fit_uses_the_checkpoint_that_configure_callbacks_gave_fit(make_trainer, regression_loader):
    # Each stage calls configure_callbacks again, and its new ModelCheckpoint replaces fit's: "best" is fit's, as in Lightning.
    class Configured(LinearRegression):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

        test_step = validation_step

        def configure_callbacks(self):
            return [ModelCheckpoint(monitor="val_loss", filename="best-{epoch}")]

    trainer = make_trainer(max_epochs=2)
    trainer.fit(Configured(), regression_loader, regression_loader)
    best = trainer.checkpoint_callback.best_model_path
    assert Path(best).name in ("best-epoch=0.ckpt", "best-epoch=1.ckpt")
    trainer.test(ckpt_path="best", dataloaders=regression_loader)
    assert trainer.ckpt_path == best


class StepValue(LinearRegression):
    """Logs the global step in training_step (on_step only, Lightning's default there)."""

    def training_step(self, batch, batch_idx):
        self.log("step_value", float(self.global_step))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        pass


def test_a_validation_mid_epoch_sees_the_latest_step_value_before_any_log_step(make_trainer, regression_loader, tmp_path):
    # Lightning's callback_metrics holds the last batch's step values when validation runs, log step or not:
    # validating every 2 of 8 batches (log_every_n_steps=50 never reached), the monitor reads steps 1, 3, 5, 7.
    seen = []

    class Seen(ModelCheckpoint):
        def on_validation_end(self, trainer, module):
            seen.append(float(trainer.callback_metrics["step_value"]))
            super().on_validation_end(trainer, module)

    checkpoint = Seen(dirpath=tmp_path, monitor="step_value", mode="max", save_top_k=1, save_last=False)
    trainer = make_trainer(max_epochs=1, val_check_interval=0.25, num_sanity_val_steps=0, callbacks=[checkpoint])
    trainer.fit(StepValue(), regression_loader, regression_loader)
    assert seen == [1.0, 3.0, 5.0, 7.0]
    assert float(checkpoint.best_model_score) == 7.0 and Path(checkpoint.best_model_path).name == "epoch=0-step=8.ckpt"


@pytest.mark.parametrize("log_every_n_steps", [1, 50])
def test_a_step_triggered_checkpoint_ranks_by_this_steps_training_value(make_trainer, regression_loader, tmp_path,
                                                                        log_every_n_steps):
    # Lightning ranks an every_n_train_steps save by the value training_step logged at that very step: the
    # score rises 1, 2, 3, 4 over 2 epochs of 2 batches, so the best is 4.0, in the file of step 4.
    class Rising(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("train_score", float(self.global_step + 1))
            return super().training_step(batch, batch_idx)

    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="train_score", mode="max", save_top_k=1, save_last=False,
                                 every_n_train_steps=1, every_n_epochs=0, save_on_train_epoch_end=False)
    trainer = make_trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, callbacks=[checkpoint],
                           log_every_n_steps=log_every_n_steps)
    trainer.fit(Rising(), regression_loader)
    assert float(checkpoint.best_model_score) == 4.0
    assert Path(checkpoint.best_model_path).name == "epoch=1-step=4.ckpt"
