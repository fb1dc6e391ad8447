"""rebuild_dataloader keeps every setting the user chose, including how batches are formed."""

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

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
