"""Lightning's profilers (SimpleProfiler, AdvancedProfiler, PyTorchProfiler, PassThroughProfiler):
Trainer(profiler=...), trainer.profiler, what each records over a fit and where its report goes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.nn.functional as F
from linear_regression import LinearRegression
from processes import THIS_CHECKOUT
from torch.utils.data import DataLoader

from callbacks import (
    AdvancedProfiler, Callback, EarlyStopping, PassThroughProfiler, ProfiledHooks, PyTorchProfiler, SimpleProfiler,
)
from callbacks.profilers import Profiler
from trainer import Trainer


class Validated(LinearRegression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def on_train_epoch_end(self):
        pass


class Counting(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        pass


@pytest.mark.parametrize(("profiler", "kind"), [
    (None, PassThroughProfiler), ("simple", SimpleProfiler), ("Simple", SimpleProfiler),
    ("advanced", AdvancedProfiler), ("pytorch", PyTorchProfiler)])
def test_trainer_profiler_is_the_profiler_given_by_name_or_a_pass_through(profiler, kind):
    assert isinstance(Trainer(strategy="cpu", profiler=profiler).profiler, kind)


def test_a_profiler_object_is_the_trainers_and_runs_first_among_the_callbacks():
    profiler = SimpleProfiler()
    trainer = Trainer(strategy="cpu", profiler=profiler, callbacks=[Counting()], report=False)
    assert trainer.profiler is profiler
    assert isinstance(trainer.callbacks[0], ProfiledHooks) and trainer.callbacks[0].profiler is profiler


def test_an_unknown_profiler_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Trainer\(profiler='xla'\): use None, \"simple\" \(time per hook\), "
                                         r"\"advanced\".* not XLA"):
        Trainer(strategy="cpu", profiler="xla")
    with pytest.raises(ValueError, match=r"Trainer\(profiler='fast'\): use None, \"simple\""):
        Trainer(strategy="cpu", profiler="fast")


def test_simple_profiler_times_every_hook_step_and_phase_of_fit_by_lightnings_names(make_trainer, regression_loader,
                                                                                      tmp_path):
    profiler = SimpleProfiler(dirpath=tmp_path / "perf", filename="profile")
    trainer = make_trainer(max_epochs=2, profiler=profiler, callbacks=[Counting(), EarlyStopping("val_loss")])
    module = Validated()
    trainer.fit(module, regression_loader, regression_loader)
    calls = {action: len(durations) for action, durations in profiler.recorded_durations.items()}
    stopping = "[Callback]EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    # Lightning calls the steps through its strategy, and names them after it
    assert calls["[Strategy]SingleDeviceStrategy.training_step"] == 16  # 8 batches, 2 epochs
    assert calls["[Strategy]SingleDeviceStrategy.validation_step"] == 2 + 16  # the sanity check's 2, then 8 a epoch
    assert calls["[TrainingModule]Validated.on_train_epoch_end"] == 2
    assert calls["[TrainingModule]Validated.configure_optimizers"] == 1
    assert calls["[Callback]Counting.on_train_batch_end"] == 16
    assert calls[f"{stopping}.on_validation_end"] == 3 and calls[f"{stopping}.setup"] == 1
    assert calls["run_training_batch"] == 16 and calls["run_training_epoch"] == 2
    # As in Lightning, also the hooks that do nothing are timed
    assert calls["[Callback]Counting.on_fit_start"] == 1 and calls[f"{stopping}.on_validation_start"] == 3
    assert calls["[TrainingModule]Validated.on_train_batch_start"] == 16
    report = (tmp_path / "perf" / "fit-profile.txt").read_text()
    assert report.startswith("FIT Profiler Report")
    for column in ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"):
        assert column in report
    assert "[Callback]Counting.on_train_batch_end" in report
    assert not any(name in vars(module) for name in ("training_step", "validation_step", "on_train_epoch_end"))
    assert "on_fit_start" not in vars(trainer.callbacks[1])  # taken away at teardown


def test_the_report_goes_to_logging_without_a_filename_and_to_log_dir_with_one(make_trainer, regression_loader, capsys,
                                                                               caplog):
    trainer = make_trainer(max_epochs=1, profiler="simple")
    with caplog.at_level(logging.INFO):  # pytest configures logging: the report goes there, as Lightning's
        trainer.fit(LinearRegression(), regression_loader)
    assert caplog.text.count("FIT Profiler Report") == 1
    profiler = SimpleProfiler(filename="perf")
    trainer = make_trainer(max_epochs=1, profiler=profiler)
    trainer.fit(LinearRegression(), regression_loader)
    trainer.validate(Validated(), regression_loader)
    assert profiler.dirpath == str(trainer.log_dir)
    assert sorted(path.name for path in Path(trainer.log_dir).glob("*-perf.txt")) == ["fit-perf.txt", "validate-perf.txt"]
    assert "FIT Profiler Report" not in capsys.readouterr().err


def test_simple_profiler_table_lists_actions_by_total_time_as_lightning_does():
    profiler = SimpleProfiler()
    profiler.recorded_durations.update({"on_fit_start": [3.0], "on_train_start": [0.5, 0.5], "training_step": [2.0]})
    profiler.start_time = time.perf_counter() - 10.0
    rows = [line for line in profiler.summary().expandtabs().splitlines() if line.startswith("|")]
    assert [row.split("|")[1].strip() for row in rows] == ["Action", "Total", "on_fit_start", "training_step",
                                                             "on_train_start"]
    mean, count, total, share = (cell.strip() for cell in rows[4].split("|")[2:6])
    assert (mean, count, total) == ("0.5", "2", "1.0") and 9.9 < float(share) < 10.1
    short = SimpleProfiler(extended=False)
    short.recorded_durations.update({"a": [1.0, 3.0], "b": [2.5]})
    rows = [line for line in short.summary().expandtabs().splitlines() if line.startswith("|")]
    assert [[cell.strip() for cell in row.split("|")[1:4]] for row in rows] == [
        ["Action", "Mean duration (s)", "Total time (s)"], ["b", "2.5", "2.5"], ["a", "2.0", "4.0"]]


def test_simple_profiler_refuses_unbalanced_actions():
    profiler = SimpleProfiler()
    with pytest.raises(ValueError, match=r"Attempting to stop recording an action \(step\) which was never started"):
        profiler.stop("step")
    profiler.start("step")
    with pytest.raises(ValueError, match="Attempted to start step which has already started"):
        profiler.start("step")


def test_a_module_times_its_own_code_through_trainer_profiler(make_trainer, regression_loader):
    class Augmenting(LinearRegression):
        def training_step(self, batch, batch_idx):
            with self.trainer.profiler.profile("augment"):
                batch = [tensor * 1.0 for tensor in batch]
            return super().training_step(batch, batch_idx)

    profiler = SimpleProfiler()
    make_trainer(max_epochs=1, profiler=profiler).fit(Augmenting(), regression_loader)
    assert len(profiler.recorded_durations["augment"]) == 8
    make_trainer(max_epochs=1).fit(Augmenting(), regression_loader)  # no profiler: the pass-through one


def test_a_subclass_of_the_profiler_interface_sees_every_action(make_trainer, regression_loader):
    class Names(Profiler):
        def __init__(self):
            super().__init__()
            self.started, self.stopped = [], []

        def start(self, action_name):
            self.started.append(action_name)

        def stop(self, action_name):
            self.stopped.append(action_name)

    names = Names()
    make_trainer(max_epochs=1, profiler=names).fit(LinearRegression(), DataLoader(regression_loader.dataset, batch_size=32))
    assert names.started.count("[Strategy]SingleDeviceStrategy.training_step") == 2
    assert sorted(names.started) == sorted(names.stopped)


def test_advanced_profiler_writes_cprofile_stats_per_action(make_trainer, regression_loader, tmp_path):
    profiler = AdvancedProfiler(dirpath=tmp_path, filename="cprofile", dump_stats=True)
    make_trainer(max_epochs=1, profiler=profiler).fit(LinearRegression(), regression_loader)
    report = (tmp_path / "fit-cprofile.txt").read_text()
    assert "Profile stats for: [Strategy]SingleDeviceStrategy.training_step" in report
    assert "mse_loss" in report and "Ordered by: cumulative time" in report
    assert (tmp_path / "fit-cprofile-[Strategy]SingleDeviceStrategy.training_step.prof").stat().st_size > 0
    with pytest.raises(ValueError, match=r"Attempting to stop recording an action \(x\) which was never started"):
        AdvancedProfiler().stop("x")


def test_pytorch_profiler_records_each_kind_of_step_in_its_own_first_window_as_lightning(make_trainer,
                                                                                          regression_loader, tmp_path):
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="torch", row_limit=200, table_kwargs={"max_name_column_width": 100})
    make_trainer(max_epochs=1, profiler=profiler).fit(Validated(), regression_loader, regression_loader)
    report = (tmp_path / "fit-torch.txt").read_text()
    # The default schedule (wait 1, warmup 1, record 3) runs once per kind of step: training's window, then
    # validation's (the sanity check's 2 steps count); the report and function_events are the last window's
    traces = sorted(path.name.split(".")[0] + "." + path.name.split(".")[1] for path in tmp_path.glob("*.pt.trace.json"))
    assert traces == ["fit-torch-[Strategy]SingleDeviceStrategy.training_step",
                      "fit-torch-[Strategy]SingleDeviceStrategy.validation_step"]
    names = [event.name for event in profiler.function_events]
    assert names.count("[pl][profile][Strategy]SingleDeviceStrategy.validation_step") == 2  # as Lightning's
    assert "[pl][profile][Strategy]SingleDeviceStrategy.training_step" not in names
    assert "[pl][profile][Strategy]SingleDeviceStrategy.validation_step" in report
    assert "[pl][module]torch.nn.modules.linear.Linear: layer" in report and "aten::mse_loss" in report


def test_pytorch_profiler_records_every_step_of_a_short_stage_or_without_a_schedule(make_trainer, regression_data,
                                                                                     tmp_path):
    two_batches = DataLoader(regression_data, batch_size=32)
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="torch")
    with pytest.warns(UserWarning, match="default schedule will be overridden as there is not enough steps.*fewer "
                                         "than 5 validation_steps"):
        make_trainer(profiler=profiler).validate(Validated(), two_batches)
    names = [event.name for event in profiler.function_events]
    assert names.count("[pl][profile][Strategy]SingleDeviceStrategy.validation_step") == 1  # from the 2nd on, as Lightning
    everything = PyTorchProfiler(dirpath=tmp_path, filename="all", schedule=None)
    make_trainer(profiler=everything).validate(Validated(), DataLoader(regression_data, batch_size=8))
    names = [event.name for event in everything.function_events]
    assert names.count("[pl][profile][Strategy]SingleDeviceStrategy.validation_step") == 8


def test_pytorch_profiler_refuses_what_it_cannot_do_with_the_way():
    with pytest.raises(ValueError, match=r"PyTorchProfiler\(sort_by_key='time'\): use one of count, cpu_memory_usage"):
        PyTorchProfiler(sort_by_key="time")
    with pytest.raises(ValueError, match=r"PyTorchProfiler\(emit_nvtx=True\).*emit_nvtx\(\):` under nsys"):
        PyTorchProfiler(emit_nvtx=True)
    with pytest.raises(ValueError, match=r"PyTorchProfiler\(record_shape=...\): not an argument of torch.profiler.profile"):
        PyTorchProfiler(record_shape=True)
    with pytest.raises(KeyError, match=r"row_limit has its own argument"):
        PyTorchProfiler(table_kwargs={"row_limit": 3})
    with pytest.raises(ValueError, match=r"PyTorchProfiler\(schedule=3\): use torch.profiler.schedule"):
        PyTorchProfiler(schedule=3)


WARNS_EACH_STEP = '''
import warnings, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer, TrainingModule

class Warns(TrainingModule):
    def __init__(self):
        super().__init__(); self.layer = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        warnings.warn("shown once")
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

Trainer(max_epochs=2, profiler="pytorch", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, report=False).fit(Warns(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
'''


def test_a_warning_from_one_line_is_shown_once_under_the_pytorch_profiler(tmp_path):
    # Python shows a warning once per line (its default filter); Lightning's run shows this one once. Cadence's
    # profiler silenced a torch warning with catch_warnings around every step, which made Python forget what it had
    # shown: the user's warning came back at each of the 16 steps.
    done = subprocess.run([sys.executable, "-c", WARNS_EACH_STEP], cwd=tmp_path, capture_output=True, text=True,  # its traces
                          timeout=240, env={**os.environ, "PYTHONPATH": THIS_CHECKOUT, "PYTHONWARNINGS": ""})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("UserWarning: shown once") == 1
