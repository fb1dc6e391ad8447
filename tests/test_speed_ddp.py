"""AMP(float16) + Compile + GradientCheckpointing + DDP: two gloo processes on the CPU train together.

One spawned fit serves every assertion (starting workers costs seconds). Each rank writes what it
saw to ``rank{r}.json``: its losses, how often its compiled block graphs ran, the loss scale, the
dtype its forward computed in, the bytes its first forward saved for backward (and what the same
forward saves without checkpointing) and its final weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import AMP, Compile, GradientCheckpointing
from strategies import DDP
from trainer import Trainer, TrainingModule

#: Forward graphs of compiled blocks run in this process (each spawned rank has its own).
GRAPH_RUNS = {"forward": 0}


def counting_backend(graph, example_inputs):
    """aot_eager (forward and backward graphs, as inductor makes them, run as traced), counting runs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(forward_graph, inputs):
        def run(*args):
            GRAPH_RUNS["forward"] += 1
            return forward_graph(*args)

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda g, _: make_boxed_func(g))(graph, example_inputs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


@contextlib.contextmanager
def saved_bytes(module: nn.Module, into: list[int]):
    """Count the bytes autograd saves for backward in the body (parameters, alive anyway, left out)."""
    parameters = {parameter.data_ptr() for parameter in module.parameters()}

    def pack(tensor):
        if tensor.data_ptr() not in parameters:
            into.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


class Deep(TrainingModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.inp, self.out = nn.Linear(4, 16), nn.Linear(16, 2)
        self.blocks = nn.Sequential(Block(), Block())
        self.losses: list[torch.Tensor] = []
        self.dtypes: set[str] = set()
        self.saved = {"checkpointed": [], "plain": []}

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        first = not self.saved["plain"]
        if first:  # the same forward with the blocks' own, unchecked forward
            with saved_bytes(self, self.saved["plain"]):
                hidden = self.inp(x)
                for block in self.blocks:
                    hidden = Block.forward(block, hidden)
                self.out(hidden)
        with saved_bytes(self, self.saved["checkpointed"] if first else []):
            output = self(x)
        self.dtypes.add(str(output.dtype))
        loss = F.mse_loss(output.float(), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)

    def on_fit_end(self):
        amp = next(c for c in self.trainer.callbacks if isinstance(c, AMP))
        record = {
            "losses": [float(loss) for loss in self.losses], "graph_runs": GRAPH_RUNS["forward"],
            "scale": amp.scaler.get_scale(), "global_step": self.trainer.global_step, "dtypes": sorted(self.dtypes),
            "saved": {kind: sum(sizes) for kind, sizes in self.saved.items()},
            "state_dict": {key: value.tolist() for key, value in self.state_dict().items()},
        }
        Path(self.out_dir, f"rank{self.trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def spawned_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed_ddp")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=generator)
    data = TensorDataset(x, x @ torch.randn(4, 2, generator=generator))
    torch.manual_seed(0)
    model = Deep(str(out))
    trainer = Trainer(
        strategy=DDP(devices=2, backend="gloo"), max_epochs=4, default_root_dir=out, seed=0,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, accumulate_grad_batches=2,
        callbacks=[GradientCheckpointing(modules=Block), Compile(modules=Block, backend=counting_backend),
                   AMP("fp16")],
    )
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True))
    return SimpleNamespace(trainer=trainer, model=model,
                           records=[json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)])


def test_amp_compile_and_checkpointing_under_ddp_train_and_the_loss_falls(spawned_run):
    for record in spawned_run.records:
        losses = record["losses"]
        assert len(losses) == 4 * 256 // (2 * 16)
        assert sum(losses[-4:]) < 0.3 * sum(losses[:4]), losses


def test_under_ddp_every_rank_steps_the_same_weights_with_the_same_loss_scale(spawned_run):
    first, second = spawned_run.records
    assert first["state_dict"] == second["state_dict"]
    assert first["scale"] == second["scale"]  # both ranks saw the same all-reduced gradients overflow, or not
    assert first["global_step"] == second["global_step"] == spawned_run.trainer.global_step == 16


def test_under_ddp_each_rank_runs_its_blocks_compiled(spawned_run):
    for record in spawned_run.records:
        assert record["graph_runs"] >= 2 * len(record["losses"])  # two blocks per training step


def test_under_ddp_amp_computes_in_float16_and_checkpointed_blocks_save_only_their_inputs(spawned_run):
    for record in spawned_run.records:
        assert record["dtypes"] == ["torch.float16"]
        saved = record["saved"]
        assert 0 < saved["checkpointed"] < saved["plain"] / 2, saved
