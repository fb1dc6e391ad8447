"""Lightning's ThroughputMonitor and Throughput: rolling rates of running totals, written at log steps."""

from __future__ import annotations

import pytest
import torch
from linear_regression import LinearRegression, regression_samples

from callbacks import Logger, Throughput, ThroughputMonitor


def test_throughput_rates_over_the_window_and_across_processes():
    throughput = Throughput(window_size=3, world_size=2, available_flops=100.0, using_sparse_model=False)
    for second in (1, 2, 3):  # each second one batch of 4 samples, 10 items, 50 FLOPs per device
        throughput.update(time=second, batches=second, samples=4 * second, lengths=10 * second, flops=50)
    metrics = throughput.compute()
    assert metrics == {  # over 2 seconds: 2 batches, 8 samples, 20 items, 2 x 50 FLOPs on each of 2 devices
        "time": 3, "batches": 3, "samples": 12, "lengths": 30,
        "device/batches_per_sec": 1.0, "batches_per_sec": 2.0, "device/samples_per_sec": 4.0, "samples_per_sec": 8.0,
        "device/items_per_sec": 10.0, "items_per_sec": 20.0, "flops_per_sec": 100.0, "device/flops_per_sec": 50.0,
        "device/mfu": 0.5}
    with pytest.raises(ValueError, match=r"Expected samples \(1\) to be greater or equal than batches \(4\)"):
        throughput.update(time=4, batches=4, samples=1)
    with pytest.raises(ValueError, match=r"Expected the value to increase, last: 3, current: 3"):
        throughput.update(time=3, batches=5, samples=20)


class Recorder(Logger):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class WithTestStep(LinearRegression):
    def test_step(self, batch, batch_idx):
        pass


def test_the_monitor_writes_each_stage_at_log_steps_and_warns_once_without_flops(make_trainer, regression_loader):
    recorder = Recorder()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    trainer = make_trainer(max_epochs=2, log_every_n_steps=4, logger=recorder, callbacks=[monitor])
    with pytest.warns(UserWarning, match=r"define a `flops_per_batch` attribute or property in LinearRegression") as caught:
        trainer.fit(LinearRegression(), regression_loader)
    assert len([w for w in caught if "flops_per_batch" in str(w.message)]) == 1
    train = [(step, row) for step, row in recorder.rows if "train/samples" in row]
    assert [(step, row["train/batches"], row["train/samples"]) for step, row in train] == [
        (3, 4, 32), (7, 8, 64), (11, 12, 96), (15, 16, 128)]  # every 4th of 16 batches of 8 samples
    assert all(row["train/device/samples_per_sec"] == 8 * row["train/device/batches_per_sec"] > 0 for _, row in train)
    recorder.rows.clear()
    trainer.test(WithTestStep(), regression_loader)
    assert [row["test/batches"] for _, row in recorder.rows if "test/batches" in row] == [4, 8]
    with pytest.raises(TypeError, match=r"ThroughputMonitor got \['windows'\]: besides batch_size_fn and length_fn"):
        ThroughputMonitor(batch_size_fn=len, windows=3)


class Validated(LinearRegression):
    def validation_step(self, batch, batch_idx):
        pass


class Stream(torch.utils.data.IterableDataset):
    """48 samples from a loader without a length: its last batch is known only when it comes."""

    def __iter__(self):
        return iter(torch.utils.data.TensorDataset(*regression_samples(48)))


@pytest.mark.parametrize("log_every_n_steps, expected", [(1, [(0, 4), (1, 6), (2, 10), (3, 12)]), (2, [(1, 6), (3, 12)])])
def test_under_accumulation_the_monitor_writes_at_window_ends_and_lightnings_steps(make_trainer, log_every_n_steps, expected):
    # 6 batches an epoch in windows of 4: optimizer steps after batches 4, 6 (the epoch's last, the loader has no
    # length), 10 and 12; written at Lightning's step (the optimizer steps before) when it is a log step.
    recorder = Recorder()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0))
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=4, log_every_n_steps=log_every_n_steps, logger=recorder,
                           callbacks=[monitor])
    with pytest.warns(UserWarning, match="flops_per_batch"):
        trainer.fit(LinearRegression(), torch.utils.data.DataLoader(Stream(), batch_size=8))
    assert [(step, row["train/batches"]) for step, row in recorder.rows if "train/batches" in row] == expected


def test_training_time_skips_validation_up_to_its_last_batch_and_the_loop_keeps_its_own_clock(make_trainer,
                                                                                                regression_loader):
    # Lightning 2.6.5's test_throughput_monitor_fit_with_validation: the monitor's clock reads are these
    # times (the loop's own clock is bound at import, so patching time.perf_counter feeds the monitor
    # alone); training's time at the second step is 7 + (19 - 13), validation's 13 - 11.
    from unittest import mock

    recorder = Recorder()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: 1, window_size=2)
    trainer = make_trainer(max_steps=2, val_check_interval=1, limit_val_batches=1, log_every_n_steps=1,
                           num_sanity_val_steps=0, logger=recorder, callbacks=[monitor])
    timings = [0, 7, 11, 13, 19, 21, 22]  # train t0, train t1, val t0, val t1, train t1, the last validation
    with mock.patch("time.perf_counter", side_effect=timings):
        trainer.fit(Validated(), regression_loader, regression_loader)
    times = [(step, row.get("train/time", row.get("validate/time"))) for step, row in recorder.rows
             if "train/time" in row or "validate/time" in row]
    assert times[:3] == [(0, 7), (1, 2), (1, 13)]


def test_the_monitor_calls_loggers_as_lightnings_logger_connector_and_counts_fits_validation_steps_on(
        make_trainer, regression_loader, tmp_path):
    # Lightning 2.6.5 with a Mock logger (its test_throughput_monitor_fit_with_validation, with clock reads for the
    # second validation too): log_metrics(metrics=..., step=...) then save(); "epoch" in training's rows; fit's
    # validation rows at the validation batches counted over the fit (the second validation's at step 2).
    from unittest import mock

    logger = mock.Mock()
    logger.save_dir = tmp_path
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: 1, window_size=2)
    trainer = make_trainer(max_steps=2, val_check_interval=1, limit_val_batches=1, log_every_n_steps=1,
                           num_sanity_val_steps=2, logger=logger, callbacks=[monitor])
    with mock.patch("time.perf_counter", side_effect=[0, 7, 11, 13, 19, 23, 29]):
        trainer.fit(Validated(), regression_loader, regression_loader)
    assert logger.log_metrics.mock_calls == [
        mock.call(metrics={"train/time": 7, "train/batches": 1, "train/samples": 1, "epoch": 0}, step=0),
        mock.call(metrics={"validate/time": 2, "validate/batches": 1, "validate/samples": 1}, step=1),
        mock.call(metrics={"train/time": 13, "train/batches": 2, "train/samples": 2, "train/device/batches_per_sec": 1 / 6,
                           "train/device/samples_per_sec": 1 / 6, "epoch": 0}, step=1),
        mock.call(metrics={"validate/time": 6, "validate/batches": 1, "validate/samples": 1}, step=2),
    ]
    assert logger.save.call_count >= 4  # after each, as Lightning's connector saves
