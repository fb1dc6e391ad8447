"""Lightning's read-only Trainer members (trainer/properties.py): each checked against what Lightning
2.6 answers for the same script (its values noted where Cadence's names differ)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn.functional as F

from callbacks import CSVLogger, EarlyStopping, ModelCheckpoint
from linear_regression import LinearRegression


class RecordsStages(LinearRegression):
    """Records (hook, training, validating, testing, sanity_checking) as each step and end hook sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple] = set()

    def note(self, where: str) -> None:
        trainer = self.trainer
        self.seen.add((where, trainer.training, trainer.validating, trainer.testing, trainer.sanity_checking))

    def training_step(self, batch, batch_idx):
        self.note("train")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.note("val")
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def on_validation_end(self):
        self.note("val_end")

    def test_step(self, batch, batch_idx):
        self.note("test")


def test_the_stage_flags_say_what_runs_as_in_lightning(make_trainer, regression_loader):
    module = RecordsStages()
    trainer = make_trainer(max_epochs=1, limit_val_batches=2)
    trainer.fit(module, regression_loader, regression_loader)
    trainer.test(module, regression_loader, verbose=False)
    assert module.seen == {
        ("train", True, False, False, False),
        ("val", False, False, False, True), ("val_end", False, False, False, True),  # the sanity check
        ("val", False, True, False, False), ("val_end", False, True, False, False),
        ("test", False, False, True, False),
    }
    assert not (trainer.training or trainer.validating or trainer.testing or trainer.predicting)


def test_the_arguments_and_callbacks_read_back_as_in_lightning(make_trainer, regression_loader):
    stopping, checkpoint = EarlyStopping("val/loss"), ModelCheckpoint()
    trainer = make_trainer(max_epochs=1, limit_val_batches=2, callbacks=[stopping, checkpoint])
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches) == (1.0, 2, 1.0)
    assert (trainer.num_devices, trainer.device_ids, trainer.num_nodes, trainer.node_rank, trainer.local_rank) == (1, [0], 1, 0, 0)
    assert trainer.early_stopping_callback is stopping and trainer.early_stopping_callbacks == [stopping]
    assert trainer.checkpoint_callbacks == [checkpoint] and trainer.enable_validation
    trainer.fit(RecordsStages(), regression_loader, regression_loader)
    assert trainer.num_sanity_val_batches == [2]  # the default 2 steps, under the limit


def test_ckpt_path_is_the_checkpoint_the_last_stage_loaded(make_trainer, regression_loader):
    module = RecordsStages()
    trainer = make_trainer(max_epochs=1, enable_checkpointing=True)
    assert trainer.ckpt_path is None
    trainer.fit(module, regression_loader, regression_loader)
    assert trainer.ckpt_path is None
    trainer.test(module, regression_loader, ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path  # a str, as in Lightning
    assert str(trainer.ckpt_path).endswith("epoch=0-step=8.ckpt")


class CountsSteps(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))


def test_a_ckpt_path_the_user_sets_is_loaded_by_the_stages_given_none(make_trainer, regression_loader, tmp_path):
    # Lightning's trainer.ckpt_path setter: the next stages load it until the user resets it; a ckpt_path passed
    # to a stage wins, with a warning, and the Trainer chooses again after that.
    first = make_trainer(max_epochs=1)
    first.fit(CountsSteps(), regression_loader)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    trainer, model = make_trainer(max_epochs=2), CountsSteps()
    trainer.ckpt_path = tmp_path / "epoch1.ckpt"
    trainer.fit(model, regression_loader)
    assert model.steps == 8 and trainer.global_step == 16  # resumed after epoch 0: one epoch of 8 batches trained
    trainer.test(model, regression_loader, verbose=False)
    assert trainer.ckpt_path == str(tmp_path / "epoch1.ckpt")  # still the user's
    trainer.save_checkpoint(tmp_path / "epoch2.ckpt")
    with pytest.warns(UserWarning, match=r"`trainer.ckpt_path = .*epoch1.ckpt'` was set, but then you passed "
                                         r"`trainer.test\(ckpt_path='.*epoch2.ckpt'\)`: the latter is loaded"):
        trainer.test(model, regression_loader, ckpt_path=tmp_path / "epoch2.ckpt", verbose=False)
    trainer.test(model, regression_loader, verbose=False)  # no longer the user's: nothing loaded
    assert trainer.ckpt_path is None


@pytest.mark.parametrize("stage, ckpt_path, message", [
    ("fit", "hpc", r'fit\(ckpt_path="hpc"\) loads Lightning\'s SLURM requeue checkpoint.*Pass ckpt_path="last"'),
    ("test", "registry:my-model", r"test\(ckpt_path='registry:my-model'\) downloads from Lightning's model registry"),
])
def test_lightnings_hpc_and_registry_checkpoints_are_refused_with_the_cadence_way(make_trainer, regression_loader,
                                                                                 stage, ckpt_path, message):
    with pytest.raises(ValueError, match=message):
        getattr(make_trainer(), stage)(CountsSteps(), regression_loader, ckpt_path=ckpt_path)


def test_log_dir_answers_before_fit_with_the_directory_fit_then_uses(make_trainer, regression_loader, tmp_path):
    # Lightning: trainer.log_dir (a str) is the first logger's version directory from construction on, and
    # default_root_dir without a logger (where ModelCheckpoint then writes checkpoints/).
    for case, logger in enumerate((True, CSVLogger(save_dir=tmp_path / "csv"), False)):
        trainer = make_trainer(max_epochs=1, logger=logger, default_root_dir=tmp_path / str(case), enable_checkpointing=True)
        before = trainer.log_dir
        trainer.fit(RecordsStages(), regression_loader)
        assert isinstance(before, str) and before == trainer.log_dir, logger
        assert Path(trainer.checkpoint_callback.best_model_path).parent == Path(before) / "checkpoints"
    assert Path(trainer.log_dir) == tmp_path / "2"
    assert sorted(path.name for path in (tmp_path / "2").iterdir()) == ["checkpoints"]  # and nothing else


def test_a_second_trainer_previews_the_next_free_version(make_trainer, regression_loader, tmp_path):
    make_trainer(max_epochs=1, logger=True).fit(RecordsStages(), regression_loader)
    trainer = make_trainer(max_epochs=1, logger=True)
    assert Path(trainer.log_dir).name == "version_1"
    trainer.fit(RecordsStages(), regression_loader)
    assert Path(trainer.log_dir).name == "version_1"


class ValidatesOnSeveral(LinearRegression):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.mse_loss(self.layer(batch[0]), batch[1]))


def test_the_stages_loaders_are_there_as_in_lightning_one_or_a_list(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1)
    assert trainer.val_dataloaders is None and trainer.test_dataloaders is None  # no stage has run
    module = ValidatesOnSeveral()
    trainer.fit(module, regression_loader, [regression_loader, regression_loader])
    assert isinstance(trainer.val_dataloaders, list) and len(trainer.val_dataloaders) == 2  # after fit too
    assert [loader.dataset for loader in trainer.val_dataloaders] == [regression_loader.dataset] * 2
    trainer.test(module, regression_loader)
    assert trainer.test_dataloaders.dataset is regression_loader.dataset  # one loader: the loader itself


def test_is_last_batch_is_true_in_the_last_training_batch_of_each_epoch(make_trainer, regression_loader):
    seen = []

    class Notes(LinearRegression):
        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, batch_idx, self.trainer.is_last_batch))
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=2, limit_train_batches=3)
    trainer.fit(Notes(), regression_loader)
    assert [last for _, _, last in seen] == [False, False, True, False, False, True]


class RecordsState(LinearRegression):
    """Records (hook, state.fn, state.stage, state.status) as Lightning code reads ``self.trainer.state``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def note(self, where: str) -> None:
        state = self.trainer.state
        self.seen.append((where, state.fn, state.stage, state.status))

    def setup(self, stage):
        self.note("setup")

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.note("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.note("validation_step")

    def test_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.note("test_step")

    def teardown(self, stage):
        self.note("teardown")


def test_trainer_state_says_the_method_the_running_stage_and_the_status_as_lightnings(make_trainer, regression_loader):
    # Lightning 2.6.6, the same script: the sequence below (a string enum compares equal to its value).
    from trainer.states import RunningStage, TrainerFn, TrainerStatus

    trainer, module = make_trainer(max_epochs=1, num_sanity_val_steps=1), RecordsState()
    assert (trainer.state.fn, trainer.state.stage, trainer.state.status) == (None, None, TrainerStatus.INITIALIZING)
    trainer.fit(module, regression_loader, regression_loader)
    assert (trainer.state.fn, trainer.state.stage, trainer.state.finished) == (TrainerFn.FITTING, None, True)
    trainer.test(module, regression_loader, verbose=False)
    assert module.seen == [
        ("setup", "fit", "train", "running"), ("validation_step", "fit", "sanity_check", "running"),
        ("training_step", "fit", "train", "running"), ("validation_step", "fit", "validate", "running"),
        ("teardown", "fit", "train", "running"),
        ("setup", "test", "test", "running"), ("test_step", "test", "test", "running"), ("teardown", "test", "test", "running")]
    assert RunningStage.SANITY_CHECKING.evaluating and RunningStage.SANITY_CHECKING.dataloader_prefix == "val"


def test_trainer_state_is_interrupted_after_a_stage_that_failed(make_trainer, regression_loader):
    class Fails(LinearRegression):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    trainer = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), regression_loader)
    assert trainer.state.status == "interrupted" and trainer.state.stopped and trainer.state.stage is None


def test_fit_loop_limits_continue_a_run_as_lightnings_and_its_internals_are_refused_by_name(make_trainer,
                                                                                             regression_loader):
    # The common script: fit, then `trainer.fit_loop.max_epochs = N` and fit again to train on (Lightning 2.6.5
    # continues at the epoch and step it reached: 2 epochs of 4 batches, then 1 more).
    trainer = make_trainer(max_epochs=2, limit_val_batches=0, limit_train_batches=4)
    module = LinearRegression()
    trainer.fit(module, regression_loader)
    assert (trainer.fit_loop.max_epochs, trainer.fit_loop.epoch_progress.current.completed) == (2, 2)
    trainer.fit_loop.max_epochs = 3
    trainer.fit_loop.epoch_loop.max_steps = 11
    assert (trainer.max_epochs, trainer.max_steps, trainer.fit_loop.max_steps) == (3, 11, 11)
    trainer.fit(module, regression_loader)
    assert (trainer.current_epoch, trainer.global_step) == (3, 11)  # max_steps ended the third epoch early
    with pytest.raises(AttributeError, match=r"trainer.fit_loop.total_batch_idx is Lightning's loop internals.*"
                                             r"trainer.global_step"):
        trainer.fit_loop.total_batch_idx
    with pytest.raises(AttributeError, match=r"trainer.fit_loop.connect cannot be set"):
        trainer.fit_loop.connect = None
