"""What ``self.log`` produces, value for value as Lightning does (issue 17 §3: no silent difference).

Each expected value is Lightning 2.6.6's for the same tiny script (run under /work/venv-lightning
with the imports changed): epoch means weighted by batch size, ``callback_metrics`` in the epoch-end
hooks, what a stage keeps of the one before, the keys, the defaults of ``self.log`` in epoch hooks,
the outputs ``on_train_batch_end`` receives, and when epoch schedulers step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, Logger
from tests.linear_regression import LinearRegression, regression_samples


def loader(count: int = 10, batch_size: int = 4) -> DataLoader:
    """``count`` samples in batches of ``batch_size``: 10 in 4 makes batches of 4, 4 and 2."""
    return DataLoader(TensorDataset(*regression_samples(count)), batch_size=batch_size)


class LogsBatchSizes(LinearRegression):
    """Logs each batch's size: its epoch mean is what the weighting gives."""

    def training_step(self, batch, batch_idx):
        self.log("train/size", float(len(batch[0])), on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/size", torch.tensor(float(len(batch[0]))))
        self.log("val/given", float(len(batch[0])), batch_size=1)  # self.log(batch_size=) overrides

    def test_step(self, batch, batch_idx):
        self.log("test/size", float(len(batch[0])))


def test_epoch_means_weigh_each_value_by_the_size_of_its_batch(make_trainer):
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(LogsBatchSizes(), loader(), loader())
    # Batches of 4, 4 and 2: (4*4 + 4*4 + 2*2) / 10 = 3.6 under Lightning (the plain mean of the batch
    # means, 3.333, is what batch_size=1 gives); no host sync: the weight is the batch's shape.
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert metrics == pytest.approx({"train/size": 3.6, "val/size": 3.6, "val/given": 10 / 3})


def test_a_batch_without_a_tensor_cannot_weigh_an_epoch_mean(make_trainer):
    class Words(LinearRegression):
        def validation_step(self, batch, batch_idx):
            self.log("val/count", 1.0)

    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    with pytest.raises(ValueError, match=r"self.log found no tensor in the batch \(list\) .* self.log\(\.\.\., batch_size=n\)"):
        trainer.fit(Words(), loader(), DataLoader(["a", "b"], batch_size=2, collate_fn=list))


class Summed:
    """A metric object (torchmetrics' update/compute/reset) summing what it is given."""

    def __init__(self) -> None:
        self.total = torch.tensor(0.0)

    def update(self, value: torch.Tensor) -> None:
        self.total = self.total + value

    def compute(self) -> torch.Tensor:
        return self.total

    def reset(self) -> None:
        self.total = torch.tensor(0.0)


class ReadsAtEpochEnds(LinearRegression):
    """Logs the epoch number in validation; records what callback_metrics holds at each epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []
        self.summed = Summed()

    def training_step(self, batch, batch_idx):
        self.summed.update(torch.tensor(1.0))
        self.log("train/batches", self.summed, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/epoch", float(self.current_epoch))

    def on_validation_epoch_end(self):
        metrics = self.trainer.callback_metrics
        self.seen.append(("module", self.trainer.sanity_checking, float(metrics.get("val/epoch", -1))))

    def on_train_epoch_end(self):
        self.seen.append(("compute", float(self.summed.compute())))  # not reset before the hooks ran


class RecordsValidationEnd(Callback):
    def __init__(self, module: ReadsAtEpochEnds) -> None:
        self.module = module

    def on_validation_epoch_end(self, trainer, module):
        self.module.seen.append(("callback", trainer.sanity_checking, float(trainer.callback_metrics.get("val/epoch", -1))))

    def on_train_start(self, trainer, module):
        self.module.seen.append(("train start", sorted(trainer.callback_metrics)))


def test_callback_metrics_in_the_epoch_end_hooks_hold_this_epochs_values(make_trainer):
    module = ReadsAtEpochEnds()
    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=1, callbacks=[RecordsValidationEnd(module)])
    trainer.fit(module, loader(), loader())
    # As under Lightning: each validation's own value (the sanity check's too, then forgotten before
    # training starts), and a metric object still holds the epoch's 3 batches in on_train_epoch_end.
    assert module.seen == [
        ("callback", True, 0.0), ("module", True, 0.0), ("train start", []),
        ("callback", False, 0.0), ("module", False, 0.0), ("compute", 3.0),
        ("callback", False, 1.0), ("module", False, 1.0), ("compute", 3.0),
    ]
    assert float(trainer.callback_metrics["train/batches"]) == 3.0


def test_after_test_the_published_metrics_are_the_tests_only(make_trainer):
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    module = LogsBatchSizes()
    trainer.fit(module, loader(), loader())
    trainer.test(module, loader(), verbose=False)
    # Lightning resets them as each stage starts: fit's train/ and val/ values are gone.
    assert set(trainer.callback_metrics) == set(trainer.logged_metrics) == {"test/size"}


class LogsBothWays(LinearRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("summed", 1.0, reduce_fx="SUM")  # Lightning reads the name case-insensitively
        self.log("averaged", 1.0, on_epoch=True, reduce_fx="avg")  # and "avg" as the mean
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("v", 1.0, on_step=True, on_epoch=True)

    def on_train_epoch_end(self):
        self.log("end", 1.0)  # in an epoch hook self.log defaults to on_epoch=True: the mean, 2.0
        self.log("end", 3.0)


def test_the_keys_and_defaults_are_lightnings(make_trainer):
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(LogsBothWays(), loader(), [loader(), loader(6, 3)])
    # The key sets Lightning 2.6.6 gives for this module (suffixes before the loader's index).
    assert sorted(trainer.callback_metrics) == [
        "averaged", "averaged_epoch", "averaged_step", "end", "loss", "loss_epoch", "loss_step", "summed",
        "v/dataloader_idx_0", "v/dataloader_idx_1", "v_epoch/dataloader_idx_0", "v_epoch/dataloader_idx_1"]
    assert sorted(trainer.logged_metrics) == [
        "averaged_epoch", "averaged_step", "end", "loss_epoch", "loss_step", "summed",
        "v_epoch/dataloader_idx_0", "v_epoch/dataloader_idx_1", "v_step/dataloader_idx_0", "v_step/dataloader_idx_1"]
    assert all(isinstance(value, torch.Tensor) for value in trainer.logged_metrics.values())  # as Lightning's
    assert float(trainer.callback_metrics["end"]) == 2.0
    assert float(trainer.callback_metrics["loss"]) == float(trainer.callback_metrics["loss_epoch"])


def test_a_name_logged_per_step_and_again_in_on_train_epoch_end_is_two_metrics_the_epoch_ends_last(make_trainer,
                                                                                                     tmp_path):
    """Lightning keeps a value per hook and name: the epoch-end hook's (per epoch, its defaults there)
    does not join the batches' per-step metric; it is published after them, so it is what the bar and
    callback_metrics show at the end. Expected rows: Lightning 2.6.5's metrics.csv for this script."""
    from callbacks import CSVLogger

    class LogsTwice(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("shared", torch.tensor(100.0 + batch_idx), prog_bar=True)
            self.log("both", float(batch_idx), on_epoch=True)
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self):
            self.log("shared", torch.tensor(111.0 + self.current_epoch), prog_bar=True)  # a tensor: the quick path
            self.log("both", 7.0)

    trainer = make_trainer(max_epochs=2, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    trainer.fit(LogsTwice(), loader(16, 4))
    assert trainer.progress_bar_metrics == {"shared": 112.0}
    assert {key: float(value) for key, value in trainer.callback_metrics.items()} == {
        "shared": 112.0, "both": 7.0, "both_step": 3.0, "both_epoch": 1.5}
    rows = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()
    assert rows == ["both,both_epoch,both_step,epoch,shared,step", ",,1.0,0,101.0,1", ",,3.0,0,103.0,3",
                    "7.0,1.5,,0,111.0,3", ",,1.0,1,101.0,5", ",,3.0,1,103.0,7", "7.0,1.5,,1,112.0,7"]


def test_on_train_batch_end_gets_the_loss_without_its_graph(make_trainer):
    received = []

    class Keeps(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            received.append(outputs)

    class Returns(LinearRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return {"loss": loss, "extra": 7}

    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[Keeps()])
    trainer.fit(Returns(), loader(8))
    # Lightning's outputs: a dict, the loss detached and divided by accumulate_grad_batches as
    # backward saw it, the other keys as returned.
    assert [sorted(outputs) for outputs in received] == [["extra", "loss"]] * 2
    assert all(outputs["loss"].grad_fn is None and not outputs["loss"].requires_grad for outputs in received)
    assert received[0]["extra"] == 7


class Scheduled(LinearRegression):
    def __init__(self, scheduler: str) -> None:
        super().__init__()
        self.scheduler, self.rates = scheduler, []

    def validation_step(self, batch, batch_idx):
        self.log("val/flat", 1.0)

    def on_validation_epoch_end(self):
        self.rates.append(self.optimizers().param_groups[0]["lr"])

    def on_train_epoch_end(self):
        self.log("train/flat", 1.0)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.scheduler == "step":
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": self.scheduler}


def test_an_epoch_scheduler_steps_before_the_last_batchs_validation(make_trainer):
    module = Scheduled("step")
    make_trainer(max_epochs=2, num_sanity_val_steps=0).fit(module, loader(), loader())
    assert module.rates == [0.05, 0.025]  # Lightning 2.6.6: stepped at the epoch's last batch, before validating


@pytest.mark.parametrize("monitor", ["val/flat", "train/flat"])
def test_reduce_lr_on_plateau_watches_the_top_level_monitor_after_the_epoch_end_hooks(make_trainer, monitor):
    module = Scheduled(monitor)  # train/flat is logged in on_train_epoch_end: the scheduler steps after it
    trainer = make_trainer(max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(module, loader(), loader())
    # A flat metric with patience 0: the first epoch sets the best, each later one halves the rate.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_validate_and_test_after_fit_write_to_the_loggers_at_the_fits_step(make_trainer):
    class Remember(Logger):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    logger, module = Remember(), LogsBatchSizes()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, logger=logger)
    trainer.fit(module, loader(), loader())
    trainer.validate(module, loader(), verbose=False)
    trainer.test(module, loader(), verbose=False)
    # As Lightning writes them: at the global step (3) with the epoch count after fit (1).
    assert logger.rows[-2:] == [(3, {"val/size": pytest.approx(3.6), "val/given": pytest.approx(10 / 3), "epoch": 1}),
                                (3, {"test/size": pytest.approx(3.6), "epoch": 1})]


def test_numbers_of_any_kind_are_logged_as_lightning_logs_them_float32_tensors(make_trainer, tmp_path):
    # Lightning turns a logged number (bool, int, NumPy's float32/int64 as scikit-learn returns them)
    # into a float32 tensor: 1/3 comes back as 0.3333333432674408 in the results, the CSV and callback_metrics.
    import numpy as np

    from callbacks import CSVLogger

    class LogsNumbers(LinearRegression):
        def validation_step(self, batch, batch_idx):
            self.log_dict({"third": 1 / 3, "half": torch.tensor(0.5), "np_third": np.float32(1 / 3),
                           "np_int": np.int64(2), "flag": True})

    trainer = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path), limit_val_batches=1)
    (results,) = trainer.validate(LogsNumbers(), loader())
    third = torch.tensor(1 / 3, dtype=torch.float32).item()
    assert results == {"third": third, "half": 0.5, "np_third": third, "np_int": 2.0, "flag": 1.0}
    assert list(results) == ["third", "half", "np_third", "np_int", "flag"]  # the order they were logged in
    assert trainer.callback_metrics["third"].dtype == torch.float32
    assert str(third) in (Path(trainer.log_dir) / "metrics.csv").read_text().replace("\n", ",")


@pytest.mark.parametrize("first_the_object", [True, False])
def test_one_key_logged_as_a_metric_object_and_as_a_tensor_is_an_error_naming_the_key(make_trainer, first_the_object):
    # A MetricCollection(prefix="train_") computes "train_acc" beside the module's own metric object of that name.
    class Twice(LinearRegression):
        def training_step(self, batch, batch_idx):
            values = [Summed(), torch.tensor(1.0)]
            for value in values if first_the_object else values[::-1]:
                self.log("train_acc", value, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    first = "a metric object, then Tensor" if first_the_object else "a number, then a metric object"
    with pytest.raises(ValueError, match=rf'self.log\("train_acc", ...\) got {first}: a key holds one metric object'):
        make_trainer(max_epochs=1).fit(Twice(), loader())


class Stream(torch.utils.data.IterableDataset):
    """``dataset``'s samples from a loader without a length (its last batch is known only when it comes)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "iterable"])
def test_under_gradient_accumulation_a_log_step_is_every_nth_optimizer_step(make_trainer, sized):
    # Lightning logs at the end of a window when its optimizer steps so far (_batches_that_stepped + 1) are a
    # multiple of log_every_n_steps, never inside a window. 5 batches of 8 in windows of 2 (2, 2, 1): 3 optimizer
    # steps an epoch, at batches 1, 3, 4; over 3 epochs, steps 2, 4, 6, 8 are log steps: batch 3 of epoch 0,
    # batches 1 and 4 of epoch 1, batch 3 of epoch 2, written at steps 1, 3, 5, 7 (as Lightning 2.6.6 writes them).
    class Remember(Logger):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, metrics["epoch"], metrics.get("batch")))

    class Batches(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("batch", float(batch_idx))
            return super().training_step(batch, batch_idx)

    logger = Remember()
    batches = loader(40, 8) if sized else DataLoader(Stream(loader(40, 8).dataset), batch_size=8)
    make_trainer(max_epochs=3, accumulate_grad_batches=2, log_every_n_steps=2, logger=logger).fit(Batches(), batches)
    assert [row for row in logger.rows if row[2] is not None] == [(1, 0, 3.0), (3, 1, 1.0), (5, 1, 4.0), (7, 2, 3.0)]


def test_an_epoch_mean_of_numbers_is_summed_in_float32_as_lightnings(make_trainer):
    # Lightning sums value * batch_size in a float32 tensor: 0.1 over 100 batches of one drifts in float32
    # (10.000002 / 100), which Python's float arithmetic would not show.
    class Tenth(LinearRegression):
        def validation_step(self, batch, batch_idx):
            self.log("tenth", 0.1)

    trainer = make_trainer(max_epochs=1)
    (results,) = trainer.validate(Tenth(), loader(count=100, batch_size=1))
    total = torch.tensor(0.0)
    for _ in range(100):
        total = total + torch.tensor(0.1) * 1
    assert results["tenth"] == (total / 100).item() != torch.tensor(0.1).item()


class Rows(Logger):
    """The rows a logger receives: (step, metrics without "epoch")."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {key: value for key, value in metrics.items() if key != "epoch"}))


def test_each_training_log_step_repeats_the_latest_value_of_every_step_metric_of_the_epoch(make_trainer):
    # Lightning's loggers get, at each log step, every on_step name logged so far in the epoch (its latest
    # value), not only those logged since the last log step; a new epoch starts empty. Lightning 2.6.6, 5 batches
    # an epoch, log_every_n_steps=2: "sometimes" at batches 0 and 3 comes back at steps 3 and 7 (epoch 1, batch 2).
    class Sometimes(LinearRegression):
        def training_step(self, batch, batch_idx):
            if batch_idx in (0, 3):
                self.log("sometimes", float(batch_idx))
            if batch_idx == 1:
                self.log("once", float(batch_idx), on_step=True, on_epoch=True)
            self.log("always", float(batch_idx))
            return super().training_step(batch, batch_idx)

    logger = Rows()
    make_trainer(max_epochs=2, log_every_n_steps=2, logger=logger).fit(Sometimes(), loader(10, 2))
    assert logger.rows == [
        (1, {"sometimes": 0.0, "once_step": 1.0, "always": 1.0}), (3, {"sometimes": 3.0, "once_step": 1.0, "always": 3.0}),
        (4, {"once_epoch": 1.0}),
        (5, {"sometimes": 0.0, "always": 0.0}), (7, {"sometimes": 0.0, "once_step": 1.0, "always": 2.0}),
        (9, {"sometimes": 3.0, "once_step": 1.0, "always": 4.0}), (9, {"once_epoch": 1.0})]


def test_each_evaluation_step_row_repeats_the_step_metrics_its_loader_logged_before(make_trainer):
    # Lightning 2.6.5: a name one validation batch logged on_step is in every later step row of that loader;
    # each loader's rows are its own (counted from 0 per loader), with no "epoch".
    class Once(LinearRegression):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0 and dataloader_idx == 0:
                self.log("once", 7.0, on_step=True, on_epoch=False)
            self.log("each", float(batch_idx), on_step=True, on_epoch=False)

    logger = Rows()
    make_trainer(max_epochs=1, num_sanity_val_steps=0, logger=logger).fit(Once(), loader(6, 2), [loader(6, 2), loader(6, 2)])
    rows = [(step, row) for step, row in logger.rows if any(name.startswith("each") for name in row)]
    assert rows == [(step, {"once/dataloader_idx_0": 7.0, "each/dataloader_idx_0": float(step)}) for step in (0, 1, 2)] + [
        (step, {"each/dataloader_idx_1": float(step)}) for step in (0, 1, 2)]


def test_an_ambiguous_batch_size_is_warned_once_a_process_at_the_users_line(make_trainer):
    class TwoLogs(LinearRegression):
        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("a", loss, on_step=False, on_epoch=True)
            self.log("b", loss, on_step=False, on_epoch=True)
            return loss

    x, y = regression_samples(16)
    # every batch: x and y of 8 rows, then a tensor of 3 (the third part disagrees with the first)
    batches = [(x[i:i + 8], y[i:i + 8], torch.zeros(3)) for i in (0, 8)]
    loader = DataLoader(batches, batch_size=None)
    with pytest.warns(UserWarning, match="could not tell the batch size for certain") as warned:
        make_trainer(max_epochs=2, limit_val_batches=0).fit(TwoLogs(), loader)
    ambiguous = [w for w in warned if "could not tell the batch size" in str(w.message)]
    assert len(ambiguous) == 1  # Lightning warns once, not once per self.log line and batch
    assert ambiguous[0].filename == __file__
    assert "parts of size 8 and 3" in str(ambiguous[0].message)


class LogsEvaluationSteps(LinearRegression):
    def validation_step(self, batch, batch_idx):
        self.log("val_a", float(batch_idx), on_step=True, on_epoch=True)
        self.log("val_b", float(10 * batch_idx), on_step=True, on_epoch=False)

    def test_step(self, batch, batch_idx):
        self.log("test_a", float(batch_idx), on_step=True, on_epoch=True)


def test_evaluation_step_rows_in_metrics_csv_are_lightnings(make_trainer, tmp_path):
    from callbacks import CSVLogger

    trainer = make_trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=2, log_every_n_steps=2,
                           num_sanity_val_steps=1, logger=CSVLogger(tmp_path))
    module = LogsEvaluationSteps()
    trainer.fit(module, loader(8, 2), loader(8, 2))
    trainer.validate(module, loader(8, 2), verbose=False)
    trainer.test(module, loader(8, 2), verbose=False)
    # Lightning 2.6.5's metrics.csv for the same script: step rows have no epoch and count each loader's
    # batches since its loaders were made (fit's validation goes on across epochs; validate and test start at 0).
    assert (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines() == [
        "epoch,step,test_a_epoch,test_a_step,val_a_epoch,val_a_step,val_b",
        ",0,,,,0.0,0.0", ",1,,,,1.0,10.0", "0,2,,,0.5,,",  # fit, epoch 0's validation
        ",2,,,,0.0,0.0", ",3,,,,1.0,10.0", "1,5,,,0.5,,",  # epoch 1's
        ",0,,,,0.0,0.0", ",1,,,,1.0,10.0", "2,6,,,0.5,,",  # validate
        ",0,,0.0,,,", ",1,,1.0,,,", ",2,,2.0,,,", ",3,,3.0,,,", "2,6,1.5,,,,"]  # test


class LogsObjectsAndNumbers(LinearRegression):
    """Metric objects and numbers logged in turn, names out of alphabetical order (as the
    lightning-hydra-template's MNISTLitModule logs ``val/loss`` then ``val/acc``, two objects)."""

    def __init__(self) -> None:
        super().__init__()
        self.objects = [Summed() for _ in range(4)]

    def _log_all(self, prefix: str) -> None:
        for obj, name in zip(self.objects, "qzby"):
            obj.update(torch.tensor(1.0))
            self.log(f"{prefix}/{name}", obj, on_step=False, on_epoch=True)
            self.log(f"{prefix}/n{name}", 1.0, on_epoch=True)

    def validation_step(self, batch, batch_idx):
        self._log_all("v")

    def test_step(self, batch, batch_idx):
        self._log_all("s")


def test_epoch_values_keep_the_order_of_the_first_calls_metric_objects_among_numbers(make_trainer):
    # Lightning 2.6.5 keeps the order of the first self.log calls: the keys of callback_metrics, of a
    # printed metrics dict, of the progress bar and of the dicts validate/test return.
    expected = ["q", "nq", "z", "nz", "b", "nb", "y", "ny"]
    trainer = make_trainer()
    validated = trainer.validate(LogsObjectsAndNumbers(), loader())
    assert list(trainer.callback_metrics) == [f"v/{name}" for name in expected]
    assert list(validated[0]) == [f"v/{name}" for name in expected]
    tested = trainer.test(LogsObjectsAndNumbers(), loader())
    assert list(tested[0]) == [f"s/{name}" for name in expected]


def test_a_name_logged_per_step_and_per_epoch_comes_before_its_step_key_in_callback_metrics(make_trainer):
    """The order Lightning 2.6.5 gives (its bare name first, then the forked one; probe9/p1.py): what a
    printed ``trainer.callback_metrics`` or a loop over it shows (mathLab/PINA's runs print them)."""

    class TwoForks(LinearRegression):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("p", loss, on_step=True, on_epoch=True)
            self.log("b", 2 * loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val", super().training_step(batch, batch_idx))

    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(TwoForks(), loader(8), loader(8))
    assert list(trainer.callback_metrics) == ["p", "p_step", "b", "b_step", "val", "p_epoch", "b_epoch"]
