"""Lightning's Trainer arguments: accelerator/devices/strategy/num_nodes, fast_dev_run, max_time,
min_epochs/min_steps, enable_model_summary, benchmark, detect_anomaly, overfit_batches,
reload_dataloaders_every_n_epochs, use_distributed_sampler, sync_batchnorm, inference_mode, and the
error for an argument Cadence does not take.

Where a test needs GPUs this machine lacks, it mocks the ``torch.cuda`` queries only.
"""

from __future__ import annotations

import datetime
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from callbacks import Callback, DummyLogger, ModelCheckpoint, ModelSummary, SyncBatchNorm
from linear_regression import LinearRegression
from strategies import DDP, SingleDevice, resolve_strategy
from trainer import Trainer
from trainer.data import prepare_loader


class Regressor(LinearRegression):
    def __init__(self):
        super().__init__(lr=0.01)
        self.first_samples: list[float] = []  # the first input value of each training batch
        self.flags: list[tuple] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.first_samples.append(x[0, 0].item())
        self.flags.append((torch.backends.cudnn.benchmark, torch.is_anomaly_enabled()))
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.flags.append(("validation", torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        self.log("val/loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", F.mse_loss(self.layer(batch[0]), batch[1]))


class Normalized(Regressor):
    """With a batch norm layer, frozen (its 4 parameters are not trainable)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(2)
        self.norm.requires_grad_(False)


def data(count: int = 32, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    x = torch.arange(count * 4, dtype=torch.float32).reshape(count, 4) / count
    return DataLoader(TensorDataset(x, x[:, :2]), batch_size=batch_size, shuffle=shuffle)


# --- unknown arguments ---------------------------------------------------------------------------
def test_a_misspelled_argument_names_the_close_match():
    # Python's words at the end, as Lightning's test_trainer_subclassing matches them
    with pytest.raises(TypeError, match=r"Trainer\(max_epoch=3\): no such argument; did you mean max_epochs\? "
                                        r"\(Trainer.__init__\(\) got an unexpected keyword argument 'max_epoch'\)"):
        Trainer(max_epoch=3)


@pytest.mark.parametrize("argument, instead", [
    ({"gpus": 2}, 'accelerator="gpu", devices=N'),
    ({"resume_from_checkpoint": "x.ckpt"}, r"trainer.fit\(model, ..., ckpt_path=path\)"),
    ({"replace_sampler_ddp": False}, "use_distributed_sampler"),
])
def test_a_lightning_argument_cadence_does_not_take_names_the_cadence_way(argument, instead):
    with pytest.raises(TypeError, match=rf"is Lightning's; Cadence does not take it. Instead: {instead}"):
        Trainer(**argument)


# --- accelerator, devices, strategy, num_nodes --------------------------------------------------------
def test_accelerator_gpu_without_a_gpu_is_answered_in_the_users_words():
    for accelerator, devices in (("gpu", "auto"), ("gpu", 2), ("cuda", 1)):
        with pytest.raises(ValueError, match=rf"Trainer\(accelerator='{accelerator}'\) asks for a CUDA GPU, but PyTorch "
                                             r'sees none .* Use accelerator="cpu" or "auto"'):
            Trainer(accelerator=accelerator, devices=devices)


def test_accelerator_and_a_strategy_that_contradict_each_other_name_both(two_gpus):
    with pytest.raises(ValueError, match=r'Trainer\(accelerator="cpu", strategy="cuda"\) contradict each other'):
        Trainer(accelerator="cpu", strategy="cuda")
    with pytest.raises(ValueError, match=r'Trainer\(accelerator="cuda", strategy=SingleDevice\(cpu\)\) contradict'):
        Trainer(accelerator="gpu", strategy=SingleDevice("cpu"))
    with pytest.raises(ValueError, match=r"Trainer\(accelerator=\"cpu\", strategy=DDP\(backend='nccl'\)\) contradict"):
        Trainer(accelerator="cpu", strategy=DDP(backend="nccl"))


def test_cpu_with_several_devices_is_ddp_over_gloo_and_a_strategy_object_takes_the_trainers_devices():
    assert isinstance(Trainer(accelerator="cpu").strategy, SingleDevice)
    assert isinstance(Trainer(accelerator="cpu", devices=None).strategy, SingleDevice)  # as "auto" (a DQN tutorial passes it)
    strategy = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn").strategy
    assert isinstance(strategy, DDP) and (strategy.backend, strategy.devices, strategy.start_method) == ("gloo", 2, "spawn")
    given = DDP(find_unused_parameters=True)
    assert Trainer(accelerator="cpu", devices=2, strategy=given).strategy is given and given.devices == 2
    with pytest.raises(ValueError, match=r"Trainer\(devices=3\) and DDP\(devices=2\) disagree"):
        Trainer(devices=3, strategy=DDP(devices=2))


def test_gpu_devices_as_lightning_writes_them(two_gpus):
    # resolve_strategy is what Trainer(...) calls; the CPU build of torch here has no NCCL to validate.
    assert resolve_strategy("auto", [1], accelerator="gpu").device == torch.device("cuda", 1)
    for devices in ([0, 1], "0,1", -1, 2):
        strategy = resolve_strategy("auto", devices, accelerator="gpu")
        assert isinstance(strategy, DDP) and strategy.backend == "nccl" and strategy.num_processes == 2
    with pytest.raises(ValueError, match=r"devices=3 asks for 3 CUDA devices; 2 is visible"):
        resolve_strategy("ddp", [0, 2], accelerator="gpu").validate()


@pytest.mark.parametrize("arguments, match", [
    ({"accelerator": "tpu"}, r"Trainer\(accelerator='tpu'\) is not a device type.*TPUs and HPUs are not supported"),
    ({"devices": [0, 0]}, r"Trainer\(devices=\[0, 0\]\): a list of devices holds distinct indices"),
    ({"devices": "two"}, r"Trainer\(devices='two'\): use an int, -1 \(every GPU\)"),
    ({"accelerator": "cpu", "devices": [0, 1]}, "CPU processes have no device indices"),
    ({"accelerator": "cpu", "devices": -1}, "-1 means every GPU"),
    ({"num_nodes": 0}, r"Trainer\(num_nodes=0\): use an int >= 1"),
    ({"strategy": "cpu", "num_nodes": 2}, r'num_nodes=2\) runs one process; training on several machines needs strategy="ddp"'),
    ({"strategy": "ddp", "num_nodes": 2}, "num_nodes=2 trains on 2 machines, which a spawned run cannot reach: .*torchrun"),
    ({"accelerator": "mps", "strategy": "ddp"}, "DDP does not run on Apple GPUs"),
])
def test_bad_device_arguments_say_what_would_work(arguments, match):
    with pytest.raises(ValueError, match=match):
        Trainer(**arguments)


# --- fast_dev_run ------------------------------------------------------------------------------------
def test_fast_dev_run_runs_a_few_batches_of_each_stage_and_writes_nothing(tmp_path, capsys):
    module = Regressor()
    trainer = Trainer(fast_dev_run=2, max_epochs=10, default_root_dir=tmp_path, enable_progress_bar=False,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")])
    trainer.fit(module, data(), data())
    assert trainer.global_step == 2 and trainer.current_epoch == 1
    assert trainer.num_val_batches == [2] and "val/loss" in trainer.callback_metrics  # no sanity check
    trainer.test(module, data(), verbose=False)
    assert trainer.num_test_batches == [2]
    assert list(tmp_path.iterdir()) == [] and trainer.checkpoint_callback is None
    # As Lightning: the logger asked for (the default's) is a DummyLogger, which records nothing.
    assert isinstance(trainer.logger, DummyLogger) and trainer.loggers == [trainer.logger]
    assert "Trainer(fast_dev_run=2): 2 batch(es) of each stage; no loggers, no checkpoints." in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"Trainer\(fast_dev_run=-1\): use True"):
        Trainer(fast_dev_run=-1)
    assert Trainer(fast_dev_run=True, logger=False).loggers == []  # none asked for: none, as Lightning


# --- max_time ----------------------------------------------------------------------------------------
class SlowSteps(Callback):
    """Each batch takes at least 20 ms of wall clock."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        time.sleep(0.02)


def test_max_time_stops_after_an_optimizer_step_and_checkpoints_like_a_normal_end(tmp_path):
    module = Regressor()
    checkpoints = ModelCheckpoint(dirpath=tmp_path)
    trainer = Trainer(max_time={"milliseconds": 300}, accumulate_grad_batches=2, strategy="cpu", logger=False,
                      enable_progress_bar=False, callbacks=[SlowSteps(), checkpoints], default_root_dir=tmp_path)
    assert trainer.max_epochs == -1  # the time limit alone ends the run
    trainer.fit(module, data(count=800, batch_size=2))
    batches = len(module.first_samples)
    assert batches < 400 and batches % 2 == 0  # stopped early, at the end of an accumulation window
    assert trainer.global_step == batches // 2 and trainer.current_epoch == 1  # the epoch ended normally
    saved = torch.load(checkpoints.last_model_path, weights_only=True)
    assert saved["loops"]["global_step"] == trainer.global_step
    assert saved["callbacks"]["Timer"]["time_elapsed"]["train"] >= 0.3

    resumed = Trainer(max_time={"milliseconds": 300}, strategy="cpu", logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, callbacks=[SlowSteps()], default_root_dir=tmp_path)
    resumed.fit(Regressor(), data(count=800, batch_size=2), ckpt_path=checkpoints.last_model_path)
    assert resumed.global_step == trainer.global_step  # the budget was spent: nothing more trains


@pytest.mark.parametrize("max_time, match", [
    ("1:00", r"Trainer\(max_time='1:00'\) is not a duration: a string is in the format DD:HH:MM:SS"),
    ({"hour": 1}, r"Trainer\(max_time=\{'hour': 1\}\): .*the keys are datetime.timedelta's"),
    (datetime.timedelta(seconds=-1), r"is a negative duration; use 0 \(stop at the first check\) or more"),
])
def test_a_bad_max_time_says_the_formats(max_time, match):
    with pytest.raises(ValueError, match=match):
        Trainer(max_time=max_time)


# --- min_epochs / min_steps --------------------------------------------------------------------------
class StopAtOnce(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.should_stop = True


@pytest.mark.parametrize("minimum, steps, epochs", [({"min_epochs": 2}, 16, 2), ({"min_steps": 5}, 5, 1), ({}, 1, 1)])
def test_should_stop_waits_for_min_epochs_and_min_steps(make_trainer, minimum, steps, epochs):
    trainer = make_trainer(max_epochs=5, callbacks=[StopAtOnce()], **minimum)
    trainer.fit(Regressor(), data())  # 8 batches per epoch
    assert (trainer.global_step, trainer.current_epoch) == (steps, epochs)


def test_should_stop_before_min_epochs_says_so_once_through_logging(make_trainer, caplog):
    # Lightning 2.6.5 logs this line once at INFO (test_trainer_min_steps_and_min_epochs_not_reached), and trains on.
    with caplog.at_level(logging.INFO):
        make_trainer(max_epochs=5, min_epochs=2, callbacks=[StopAtOnce()]).fit(Regressor(), data())
    said = [record for record in caplog.records if "`min_epochs=2` or `min_steps=None` has not been met" in record.message]
    assert len(said) == 1 and said[0].levelno == logging.INFO


# --- what else happens around the loop ----------------------------------------------------------------
def test_the_model_summary_is_printed_at_the_start_of_fit_unless_turned_off(tmp_path, capsys):
    common = dict(max_steps=1, strategy="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  default_root_dir=tmp_path)
    Trainer(**common).fit(Normalized(), data())
    err = capsys.readouterr().err
    # Lightning 2.6.5's rows for the same module:
    assert "0 | layer | Linear      | 10     | train | 0    \n1 | norm  | BatchNorm1d | 4      | train | 0    \n" in err
    assert "10        Trainable params" in err and "4         Non-trainable params" in err and "14        Total params" in err
    Trainer(enable_model_summary=False, **common).fit(Regressor(), data())
    assert "Trainable params" not in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"enable_model_summary=False\) but callbacks holds a ModelSummary"):
        Trainer(enable_model_summary=False, callbacks=[ModelSummary()])


def test_benchmark_and_detect_anomaly_hold_during_the_run_only(make_trainer):
    module = Regressor()
    before = (torch.backends.cudnn.benchmark, torch.is_anomaly_enabled())
    make_trainer(max_steps=1, benchmark=True, detect_anomaly=True).fit(module, data())
    assert module.flags == [(True, True)]
    assert (torch.backends.cudnn.benchmark, torch.is_anomaly_enabled()) == before


def test_inference_mode_false_validates_under_no_grad(make_trainer):
    module = Regressor()
    make_trainer(inference_mode=False).validate(module, data(count=4), verbose=False)
    assert module.flags == [("validation", False, False)]


def test_overfit_batches_trains_on_the_same_batches_in_order_every_epoch(make_trainer):
    module = Regressor()
    trainer = make_trainer(max_epochs=2, overfit_batches=2, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="You requested to overfit but enabled train dataloader shuffling: "
                                         r"Trainer\(overfit_batches=...\) overfits the same batches every epoch, so "
                                         "the train loader reads in order"):
        trainer.fit(module, data(shuffle=True), data())
    assert module.first_samples == [0.0, 0.5] * 2 and trainer.num_val_batches == [2]


def test_reload_dataloaders_every_n_epochs_asks_the_hooks_again(make_trainer):
    class Reloading(Regressor):
        loads = 0

        def train_dataloader(self):
            self.loads += 1
            return data()

    for every, loads in ((0, 1), (1, 3), (2, 2)):
        module = Reloading()
        make_trainer(max_epochs=3, reload_dataloaders_every_n_epochs=every).fit(module)
        assert module.loads == loads


def test_use_distributed_sampler_false_leaves_the_loader_unsharded():
    strategy = DDP(devices=2, backend="gloo")  # rank 0 of 2; nothing is launched
    sharded, count = prepare_loader(data(), "validate", shuffle=False, strategy=strategy, seed=None, limit=None)
    assert count == 4  # half of the 8 batches
    kept, count = prepare_loader(data(), "validate", shuffle=False, strategy=strategy, seed=None, limit=None, shard=False)
    assert count == 8 and not isinstance(kept.sampler, RandomSampler)


def test_sync_batchnorm_converts_the_batch_norms_of_a_ddp_run_in_place():
    module = Normalized()
    keys = list(module.state_dict())
    trainer = Trainer(strategy=DDP(devices=2, backend="gloo"), sync_batchnorm=True, logger=False)
    callback = trainer.callbacks[0]
    assert isinstance(callback, SyncBatchNorm)
    callback.setup(trainer, module, "fit")
    assert callback.configure_model(module) is module
    assert isinstance(module.norm, torch.nn.SyncBatchNorm) and list(module.state_dict()) == keys


# --- None for the arguments whose Lightning default is None; paths; iterables of loggers ------------------
def test_none_means_lightnings_default_for_the_arguments_lightning_defaults_to_none(tmp_path):
    # A config written from Lightning's signature (LightningCLI, Hydra) carries these nulls; in
    # Lightning each means the documented default (trainer/trainer.py of Lightning 2.6).
    nulls = {name: None for name in ("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
                                     "log_every_n_steps", "num_sanity_val_steps", "val_check_interval",
                                     "gradient_clip_algorithm", "deterministic")}
    given, default = Trainer(default_root_dir=tmp_path, **nulls), Trainer(default_root_dir=tmp_path)
    assert [type(c) for c in given.callbacks] == [type(c) for c in default.callbacks]
    assert given.logger is not None and given.checkpoint_callback is not None and given.progress_bar_callback is not None
    assert (given.log_every_n_steps, given.num_sanity_val_steps, given.val_check_interval,
            given.gradient_clip_algorithm, given.deterministic) == (50, 2, 1.0, None, False)  # None: clip by norm


def test_default_root_dir_starting_with_a_tilde_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    trainer = Trainer(default_root_dir="~/runs", logger=False, enable_progress_bar=False)
    assert trainer.default_root_dir == str(tmp_path / "runs")  # a str, as Lightning's
    assert trainer.log_dir == str(tmp_path / "runs")  # no logger: default_root_dir itself


def test_logger_takes_any_iterable_of_loggers(tmp_path):
    from collections import UserList  # not a list or tuple, like Hydra's ListConfig

    from callbacks import CSVLogger, TensorBoardLogger

    loggers = UserList([CSVLogger(save_dir=tmp_path), TensorBoardLogger(save_dir=tmp_path)])
    trainer = Trainer(default_root_dir=tmp_path, logger=loggers)
    assert trainer.loggers == list(loggers)
