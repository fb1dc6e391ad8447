"""ProgressBar as Lightning's TQDMProgressBar: refresh_rate=0 turns it off, the bars and totals
subclasses read, get_metrics, leave, process_position; drawn on a terminal, lines otherwise."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from linear_regression import LinearRegression

from callbacks import ProgressBar, TQDMProgressBar


class Validated(LinearRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y), prog_bar=True)


class Terminal(io.StringIO):
    """A terminal on stderr, which the test machine lacks: tqdm then draws."""

    def isatty(self):
        return True


class Seen(ProgressBar):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.totals = {}

    def on_sanity_check_end(self, trainer, module):
        self.totals["sanity"] = self.val_progress_bar.total
        super().on_sanity_check_end(trainer, module)

    def on_validation_epoch_end(self, trainer, module):
        self.totals["val"] = self.val_progress_bar.total  # the sanity check's first, then each epoch's

    def get_metrics(self, trainer, module):
        return {**super().get_metrics(trainer, module), "my_metric": 123}


def test_the_bars_and_their_totals_are_there_for_subclasses(make_trainer, regression_loader, capsys):
    bar = Seen()
    trainer = make_trainer(max_epochs=2, enable_progress_bar=True, callbacks=[bar], limit_val_batches=5,
                           log_every_n_steps=2)
    assert trainer.progress_bar_callback is bar and TQDMProgressBar is ProgressBar
    trainer.fit(Validated(), regression_loader, regression_loader)
    assert bar.totals == {"sanity": 2, "val": 5}
    assert (bar.train_progress_bar.total, bar.train_progress_bar.n, bar.total_train_batches) == (8, 8, 8)
    assert bar.refresh_rate == 1 and bar.is_enabled and bar.trainer is trainer
    err = capsys.readouterr().err  # not a terminal: one line per epoch, with what get_metrics returns
    assert "Epoch 2/2: step 16, train_loss=" in err and "my_metric=123" in err
    pickle.dumps(bar)


def test_total_val_batches_is_zero_in_an_epoch_that_does_not_validate(make_trainer, regression_loader):
    # Lightning 2.6.5 (its test_check_val_every_n_epoch): with check_val_every_n_epoch=2 the bar's
    # total_val_batches read at each training epoch's end is [0, 2, 0, 2].
    totals = []

    class Totals(ProgressBar):
        def on_train_epoch_end(self, trainer, module):
            totals.append(self.total_val_batches)

    trainer = make_trainer(max_epochs=4, enable_progress_bar=True, callbacks=[Totals()], limit_val_batches=2,
                           check_val_every_n_epoch=2, num_sanity_val_steps=0)
    trainer.fit(Validated(), regression_loader, regression_loader)
    assert totals == [0, 2, 0, 2]


def test_refresh_rate_zero_keeps_the_bar_object_and_shows_nothing(make_trainer, regression_loader, capsys):
    bar = ProgressBar(refresh_rate=0)
    trainer = make_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(Validated(), regression_loader, regression_loader)
    assert trainer.progress_bar_callback is bar and bar.is_disabled
    assert "Epoch 1/1" not in capsys.readouterr().err


# As Lightning 2.6.5: one bar at train start, and with leave one more per epoch (3 for 2 epochs).
@pytest.mark.parametrize("leave, bars", [(False, 1), (True, 3)])
def test_on_a_terminal_the_bar_is_drawn_one_per_fit_or_one_per_epoch(make_trainer, regression_loader, monkeypatch,
                                                                     leave, bars):
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    made = []

    class Counting(ProgressBar):
        def init_train_tqdm(self):
            made.append(super().init_train_tqdm())
            return made[-1]

    trainer = make_trainer(max_epochs=2, enable_progress_bar=True, callbacks=[Counting(leave=leave)],
                           log_every_n_steps=2)
    trainer.fit(Validated(), regression_loader, regression_loader)
    drawn = terminal.getvalue()
    assert len(made) == bars
    assert "Epoch 2/2: 100%" in drawn and "8/8" in drawn and "train_loss=" in drawn and "val_loss=" in drawn


def test_bars_that_are_not_drawn_start_no_tqdm_monitor_thread_and_drawn_ones_keep_it(make_trainer, regression_loader,
                                                                                      monkeypatch):
    """tqdm starts a monitor thread for any bar, drawn or not, that wakes every 10 s to redraw a stalled bar;
    one that is not drawn (stderr not a terminal) has nothing to redraw, and the run keeps one thread fewer."""
    from tqdm import TMonitor

    class Watching(ProgressBar):
        monitors = drawn = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.drawn = not self.train_progress_bar.disable
            self.monitors = monitors()

    def monitors():
        return {thread for thread in threading.enumerate() if isinstance(thread, TMonitor) and thread.is_alive()}

    earlier = monitors()  # a drawn bar another test left open keeps its monitor

    not_drawn = Watching()
    make_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[not_drawn]).fit(Validated(), regression_loader)
    assert not not_drawn.drawn and not_drawn.monitors - earlier == set()
    monkeypatch.setattr("sys.stderr", Terminal())
    drawn = Watching()
    make_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[drawn]).fit(Validated(), regression_loader)
    assert drawn.drawn and drawn.monitors  # (another test's bar class in this process may have its own monitor too)


def test_a_bar_under_a_test_run_counts_the_test_batches(make_trainer, regression_loader):
    class Tested(Validated):
        def test_step(self, batch, batch_idx):
            self.validation_step(batch, batch_idx)

    bar = ProgressBar()
    trainer = make_trainer(enable_progress_bar=True, callbacks=[bar], limit_test_batches=3)
    trainer.test(Tested(), regression_loader, verbose=False)
    assert (bar.test_progress_bar.total, bar.test_progress_bar.n, bar.total_test_batches) == (3, 3, 3)
    with pytest.raises(TypeError, match=r"ProgressBar.predict_progress_bar is made when its stage starts"):
        bar.predict_progress_bar


class Stream(torch.utils.data.IterableDataset):
    """``regression_data`` without a length: the epoch's batches are unknown ahead."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


@pytest.mark.parametrize("sized", [True, False])
def test_with_max_epochs_minus_one_the_bar_counts_the_steps_max_steps_leaves(make_trainer, regression_data, sized):
    # Lightning's total_train_batches: min(the epoch's batches, max_steps - global_step) when max_epochs=-1,
    # so a loader without a length (or a long one) shows a bar that ends at max_steps.
    loader = DataLoader(regression_data if sized else Stream(regression_data), batch_size=8)  # 8 batches
    bar = ProgressBar()
    trainer = make_trainer(max_epochs=-1, max_steps=5, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(LinearRegression(), loader)
    assert (trainer.global_step, bar.train_progress_bar.total, bar.train_progress_bar.n) == (5, 5, 5)


def test_print_goes_through_tqdm_write_and_tqdm_miniters_raises_the_refresh_rate(make_trainer, regression_loader,
                                                                                  monkeypatch):
    # As Lightning 2.6.5: self.print writes through tqdm.write with the print's keywords once a bar is
    # made (also when it is not drawn); TQDM_MINITERS=2 makes refresh_rate=1 a 2 (and 0 a 2).
    written = []
    monkeypatch.setattr("tqdm.tqdm.write", lambda text, **kwargs: written.append((text, kwargs)))

    class Printing(Validated):
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.print("training", 1, end="")
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=1, enable_progress_bar=True)
    trainer.fit(Printing(), regression_loader)
    assert written == [("training 1", {"end": ""})]
    monkeypatch.setenv("TQDM_MINITERS", "2")
    assert (ProgressBar(refresh_rate=1).refresh_rate, ProgressBar(refresh_rate=0).refresh_rate,
            ProgressBar(refresh_rate=5).refresh_rate) == (2, 2, 5)


def test_get_standard_metrics_gives_the_loggers_version_as_v_num(make_trainer, regression_loader, tmp_path):
    """Lightning's ``callbacks.progress.progress_bar.get_standard_metrics``: bar subclasses add it to their
    metrics (mathLab/PINA's PINAProgressBar). The default loggers' version is one number, as Lightning's one
    TensorBoardLogger's; two loggers with other versions are joined; a long string keeps its last 4 places."""
    from callbacks import CSVLogger, TensorBoardLogger, get_standard_metrics

    trainer = make_trainer(max_steps=1, logger=True, default_root_dir=tmp_path)
    trainer.fit(LinearRegression(), regression_loader)
    assert get_standard_metrics(trainer) == {"v_num": 0}
    trainer = make_trainer(max_steps=1, logger=[TensorBoardLogger(tmp_path, version=3),
                                                 CSVLogger(tmp_path, name="csv", version="run-2024-abcd")])
    assert get_standard_metrics(trainer) == {"v_num": "abcd"}  # "3_run-2024-abcd", its last 4 places
    assert get_standard_metrics(make_trainer(max_steps=1, logger=False)) == {}
