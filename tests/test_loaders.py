"""rebuild_dataloader keeps every setting the user chose, including how batches are formed."""

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from linear_regression import LinearRegression, regression_samples
from strategies.loaders import ContiguousShard, rebuild_dataloader


def _values(loader):
    return [batch[0].tolist() for batch in loader]


def test_rebuilding_a_loader_without_automatic_batching_keeps_single_samples():
    dataset = TensorDataset(torch.arange(5.0))
    rebuilt = rebuild_dataloader(DataLoader(dataset, batch_size=None))
    assert rebuilt.batch_size is None
    assert _values(rebuilt) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_rebuilding_a_loader_with_a_batch_sampler_keeps_its_batches():
    dataset = TensorDataset(torch.arange(10.0))
    loader = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 4, drop_last=False))
    assert _values(rebuild_dataloader(loader)) == _values(loader)


def test_rebuilding_a_batched_loader_keeps_batch_size_and_drop_last():
    dataset = TensorDataset(torch.arange(10.0))
    rebuilt = rebuild_dataloader(DataLoader(dataset, batch_size=3, drop_last=True), num_workers=0)
    assert _values(rebuilt) == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]


def test_prediction_shards_are_contiguous_blocks_that_cover_the_dataset_once():
    for length, world_size in [(10, 4), (13, 2), (1, 2), (8, 2)]:
        shards = [list(ContiguousShard(length, rank, world_size)) for rank in range(world_size)]
        assert [index for shard in shards for index in shard] == list(range(length))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [list(ContiguousShard(10, rank, 4)) for rank in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6.0).split(1))


class _RegressionStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(TensorDataset(*regression_samples(8)))


def test_a_loader_of_an_iterable_dataset_is_rebuilt_without_its_implicit_sampler():
    # DataLoader refuses an explicit sampler for an IterableDataset: the rebuilt one makes its own, as the user's did
    # (Lightning 2.6.5 trains on such a loader with workers: test_double_iter_in_iterable_dataset.py).
    for batch_size, expected in ((None, [[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]]), (2, [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]]])):
        rebuilt = rebuild_dataloader(DataLoader(_Stream(), batch_size=batch_size), num_workers=0)
        assert [batch.tolist() for batch in rebuilt] == expected


def test_fit_with_a_seed_trains_on_an_iterable_dataset(make_trainer):
    # Trainer(seed=...) gives the loader a seeded generator, which rebuilds it.
    trainer = make_trainer(max_epochs=1, seed=1)
    trainer.fit(LinearRegression(), DataLoader(_RegressionStream(), batch_size=4))
    assert trainer.global_step == 2
