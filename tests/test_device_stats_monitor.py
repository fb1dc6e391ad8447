"""Lightning's DeviceStatsMonitor: the device's statistics in the loggers at log steps; psutil only
when it is installed (a fake one stands in for it on a machine without it)."""

from __future__ import annotations

import csv

import pytest
from linear_regression import LinearRegression

from callbacks import CSVLogger, DeviceStatsMonitor
from callbacks.device_stats_monitor import psutil_available

FAKE_PSUTIL = """
from types import SimpleNamespace
virtual_memory = lambda: SimpleNamespace(percent=41.0)
swap_memory = lambda: SimpleNamespace(percent=3.0)
cpu_percent = lambda: 77.0
"""


class Validated(LinearRegression):
    def validation_step(self, batch, batch_idx):
        pass


def test_cpu_stats_are_logged_at_log_steps_with_lightnings_keys(make_trainer, regression_loader, tmp_path, monkeypatch):
    if not psutil_available():  # the machine lacks psutil: a module with its three functions
        (tmp_path / "fake").mkdir()
        (tmp_path / "fake" / "psutil.py").write_text(FAKE_PSUTIL)
        monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    trainer = make_trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, log_every_n_steps=2,
                           num_sanity_val_steps=0, logger=CSVLogger(tmp_path / "logs"),
                           callbacks=[DeviceStatsMonitor(filter_keys={"cpu_percent", "cpu_vm_percent"})])
    trainer.fit(Validated(), regression_loader, regression_loader)
    with open(trainer.logger.log_dir + "/metrics.csv") as file:
        rows = list(csv.DictReader(file))
    key = "DeviceStatsMonitor.on_train_batch_end/cpu_percent"
    # Lightning's clock: a batch logs when the batches before it, plus one, divide by log_every_n_steps:
    # training batch 2 (step 1) and the validation after 3 batches (step 3)
    assert [row["step"] for row in rows if row.get(key)] == ["1"]
    validation = "DeviceStatsMonitor.on_validation_batch_start/cpu_vm_percent"
    assert [(row["step"], float(row[validation])) for row in rows if row.get(validation)] == [("3", 41.0)]
    assert not any(column.endswith("cpu_swap_percent") for column in rows[0])  # filtered out


def test_device_stats_need_a_logger_and_psutil_for_cpu_stats(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"Cannot use `DeviceStatsMonitor` callback with `Trainer\(logger=False\)`"):
        make_trainer(max_epochs=1, callbacks=[DeviceStatsMonitor()]).fit(LinearRegression(), regression_loader)
    if not psutil_available():
        with pytest.raises(ModuleNotFoundError, match=r"`psutil` is not installed.*DeviceStatsMonitor\(cpu_stats=False\)"):
            make_trainer(max_epochs=1, logger=True, callbacks=[DeviceStatsMonitor()]).fit(LinearRegression(), regression_loader)
    make_trainer(max_epochs=1, logger=True, callbacks=[DeviceStatsMonitor(cpu_stats=False)]).fit(
        LinearRegression(), regression_loader)  # on the CPU: nothing to log, no psutil needed
