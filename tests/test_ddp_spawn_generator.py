"""DDP spawn with a DataLoader that carries its own seeded ``generator=``: the generator travels to
the workers as its state, the run trains, and the shuffle order follows the generator's seed.

(Sent as torch pickles it, the generator's state was a tensor made on the fly, which shared memory
could not deliver: the workers died with "unable to resize file" and the launcher blamed a missing
``if __name__ == "__main__":``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from linear_regression import IndexedRegression, LinearRegression
from strategies import DDP
from trainer import Trainer

SAMPLES, BATCH_SIZE, WORLD_SIZE, EPOCHS, SEED = 32, 4, 2, 2, 7


class RecordsOrder(LinearRegression):
    """Linear regression; each rank writes the sample indices it trained on, per epoch."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return F.mse_loss(self.layer(x), y)

    def on_fit_end(self):
        Path(self.out_dir, f"rank{self.trainer.global_rank}.json").write_text(json.dumps(self.seen))


def test_a_loader_with_a_seeded_generator_trains_under_spawn_in_the_order_its_seed_gives(tmp_path):
    generator = torch.Generator().manual_seed(SEED)
    loader = DataLoader(IndexedRegression(SAMPLES, seed=0), batch_size=BATCH_SIZE, shuffle=True, generator=generator)
    model = RecordsOrder(str(tmp_path))
    before = model.layer.weight.detach().clone()
    trainer = Trainer(strategy=DDP(devices=WORLD_SIZE), max_epochs=EPOCHS, default_root_dir=tmp_path,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(model, loader)

    assert trainer.global_step == EPOCHS * SAMPLES // (WORLD_SIZE * BATCH_SIZE)
    assert not torch.equal(model.layer.weight, before)
    # As docs/distributed.md says, rank zero draws the shuffle seed from the loader's generator; the
    # workers drew it from a copy, so the caller's generator is where it was.
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(SEED).get_state())
    shuffle_seed = int(torch.randint(0, 2**31 - 1, (), generator=torch.Generator().manual_seed(SEED)))
    for rank in range(WORLD_SIZE):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sampler = DistributedSampler(IndexedRegression(SAMPLES, seed=0), num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=shuffle_seed)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            assert seen[str(epoch)] == list(sampler)
