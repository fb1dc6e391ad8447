"""Several loaders at once, as in Lightning: a collection of training loaders is one CombinedLoader
(each batch holds a batch of each), evaluation runs a collection one loader after the other, and
a CombinedLoader of another mode evaluates on combined batches."""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data import DataLoader

from callbacks import Callback
from linear_regression import LinearRegression
from trainer.utilities import CombinedLoader


@pytest.mark.parametrize("mode, expected, length", [
    # Lightning's docstring example: a = range(6) in 4s, b = range(15) in 5s.
    ("max_size_cycle", [([0, 1, 2, 3], [0, 1, 2, 3, 4]), ([4, 5], [5, 6, 7, 8, 9]), ([0, 1, 2, 3], [10, 11, 12, 13, 14])], 3),
    ("max_size", [([0, 1, 2, 3], [0, 1, 2, 3, 4]), ([4, 5], [5, 6, 7, 8, 9]), (None, [10, 11, 12, 13, 14])], 3),
    ("min_size", [([0, 1, 2, 3], [0, 1, 2, 3, 4]), ([4, 5], [5, 6, 7, 8, 9])], 2),
])
def test_the_modes_combine_a_batch_of_each_loader(mode, expected, length):
    combined = CombinedLoader({"a": DataLoader(range(6), batch_size=4), "b": DataLoader(range(15), batch_size=5)}, mode)
    with pytest.raises(RuntimeError, match=r"Please call `iter\(combined_loader\)` first"):
        len(combined)
    items = list(iter(combined))
    assert len(combined) == length
    assert [(None if batch["a"] is None else batch["a"].tolist(), batch["b"].tolist()) for batch, _, _ in items] == expected
    assert [(batch_idx, dataloader_idx) for _, batch_idx, dataloader_idx in items] == [(i, 0) for i in range(length)]
    sent = pickle.loads(pickle.dumps(combined))  # DDP's spawn sends it to the workers, after a pass too
    assert [batch["b"].tolist() for batch, _, _ in sent] == [b for _, b in expected]


def test_sequential_mode_runs_each_loader_in_turn_under_its_limit():
    combined = CombinedLoader([["a", "b", "c"], ["d", "e"]], "sequential")
    combined.limits = [2, 5]
    assert list(combined) == [("a", 0, 0), ("b", 1, 0), ("d", 0, 1), ("e", 1, 1)]
    assert len(combined) == 4
    with pytest.raises(ValueError, match=r"Unsupported mode 'zip', please select one of"):
        CombinedLoader([], "zip")
    with pytest.raises(ValueError, match=r"Mismatch in number of limits \(3\) and number of iterables \(2\)"):
        combined.limits = [1, 2, 3]


def test_fit_trains_on_a_dict_of_loaders_cycling_the_shorter(make_trainer, regression_data):
    """A plain dict of training loaders is Lightning's CombinedLoader(..., "max_size_cycle")."""

    class TwoSources(LinearRegression):
        def __init__(self):
            super().__init__()
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((batch_idx, batch["extra"].tolist()))
            return super().training_step(batch["main"], batch_idx)

    module, trainer = TwoSources(), make_trainer(max_epochs=1)
    trainer.fit(module, {"main": DataLoader(regression_data, batch_size=16), "extra": DataLoader(range(3), batch_size=2)})
    assert trainer.num_training_batches == 4 and trainer.global_step == 4  # the longest: 64 samples in 16s
    assert module.seen == [(0, [0, 1]), (1, [2]), (2, [0, 1]), (3, [2])]  # the shorter one starts over
    assert set(trainer.train_dataloader) == {"main", "extra"}  # as Lightning: the collection

    limited = make_trainer(max_epochs=1, limit_train_batches=1)  # a limit caps each loader
    limited.fit(TwoSources(), {"main": DataLoader(regression_data, batch_size=16), "extra": DataLoader(range(3))})
    assert limited.num_training_batches == 1 and limited.global_step == 1


def test_a_sequential_loader_from_train_dataloader_is_refused_once_its_batches_are_counted(make_trainer):
    """Lightning's fit loop counts a sequential CombinedLoader's batches (each loader's, under the limit,
    summed) and then refuses to train on it; the count stays on the Trainer (its test_fit_multiple_train_loaders).
    Expected: Lightning 2.6.5's count for the same loaders."""

    class Sequential(LinearRegression):
        def train_dataloader(self):
            return CombinedLoader([DataLoader(range(8), batch_size=2), DataLoader(range(4), batch_size=2)], "sequential")

    trainer = make_trainer(max_epochs=1, limit_train_batches=3)
    with pytest.raises(ValueError, match=r'^`_FitLoop` does not support the `CombinedLoader\(mode="sequential"\)` mode. '
                                         r"The available modes are: \['min_size', 'max_size_cycle', 'max_size'\]"):
        trainer.fit(Sequential())
    assert trainer.num_training_batches == 5 and trainer.global_step == 0


def test_evaluation_runs_a_collection_in_turn_and_other_modes_combined(make_trainer):
    class Records(LinearRegression):
        def __init__(self):
            super().__init__()
            self.seen = []

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.seen.append((batch, dataloader_idx))

        test_step = validation_step

    module, trainer = Records(), make_trainer()
    trainer.validate(module, {"a": [0, 1], "b": [2]}, verbose=False)  # Lightning's sequential CombinedLoader
    assert module.seen == [(0, 0), (1, 0), (2, 1)] and trainer.num_val_batches == [2, 1]

    module.seen.clear()
    combined = CombinedLoader({"a": [0, 1, 2], "b": [3, 4]}, "max_size")
    trainer.validate(module, combined, verbose=False)
    assert module.seen == [({"a": 0, "b": 3}, 0), ({"a": 1, "b": 4}, 0), ({"a": 2, "b": None}, 0)]
    assert trainer.val_dataloaders == {"a": [0, 1, 2], "b": [3, 4]}
    assert combined.flattened == [[0, 1, 2], [3, 4]]  # the user's object is left as it was
    # Lightning 2.6.5 (tests_pytorch/loops/test_evaluation_loop.py): each loader's count, in every mode, and no
    # sanity-check count outside fit.
    assert trainer.num_val_batches == [3, 2] and trainer.num_sanity_val_batches == []
    trainer.test(module, CombinedLoader({"a": [0, 1, 2], "b": [3, 4]}, "min_size"), verbose=False)
    assert trainer.num_test_batches == [3, 2]


def test_fit_validates_a_combined_loader_and_counts_each_of_its_loaders(make_trainer, regression_loader):
    seen = []

    class Records(LinearRegression):
        def validation_step(self, batch, batch_idx):
            seen.append((self.trainer.sanity_checking, batch, batch_idx))

    trainer = make_trainer(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=2)
    trainer.fit(Records(), regression_loader, CombinedLoader({"a": [0, 1, 2], "b": [3, 4]}, "max_size_cycle"))
    # Lightning 2.6.5, the same script:
    assert (trainer.num_val_batches, trainer.num_sanity_val_batches) == ([3, 2], [2, 2])
    assert seen == [(True, {"a": 0, "b": 3}, 0), (True, {"a": 1, "b": 4}, 1),
                    (False, {"a": 0, "b": 3}, 0), (False, {"a": 1, "b": 4}, 1), (False, {"a": 2, "b": 3}, 2)]



def test_a_run_on_combined_loaders_resumes_mid_epoch_where_it_stopped(make_trainer, regression_data, tmp_path):
    class Records(LinearRegression):
        def __init__(self):
            super().__init__()
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch_idx, batch["extra"].tolist()))
            return super().training_step(batch["main"], batch_idx)

    class SaveAtStep3(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    def loaders():
        return {"main": DataLoader(regression_data, batch_size=16), "extra": DataLoader(range(3), batch_size=2)}

    whole = Records()
    make_trainer(max_epochs=2, callbacks=[SaveAtStep3()]).fit(whole, loaders())
    resumed = Records()
    with pytest.warns(UserWarning, match="Resuming mid-epoch on several loaders combined"):
        make_trainer(max_epochs=2).fit(resumed, loaders(), ckpt_path=tmp_path / "mid.ckpt")
    assert resumed.seen == whole.seen[3:]
