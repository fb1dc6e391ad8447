"""GradientCheckpointing: the same gradients with fewer activations kept, alone and with Compile and AMP.

How much is kept for backward is measured by a callback whose forward context counts the bytes
autograd saves (``torch.autograd.graph.saved_tensors_hooks``), so the tests see checkpointing
act, not only its gradients agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader

from callbacks import AMP, Callback, Compile, GradientCheckpointing
from trainer import TrainingModule


class Block(nn.Module):
    """A residual MLP block with dropout (the recomputation must draw the same mask)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.dropout(self.down(F.gelu(self.up(x))))


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


class DeepRegressor(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Deep()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Observer(Callback):
    """Counts the bytes autograd saves for backward during each forward, and copies the gradients."""

    def __init__(self) -> None:
        self.saved_bytes: list[int] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def forward_context(self):
        self.saved_bytes.append(0)

        def pack(tensor):
            self.saved_bytes[-1] += tensor.numel() * tensor.element_size()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.gradients.append({name: p.grad.clone() for name, p in module.named_parameters()})


def fit(make_trainer, loader, *callbacks, steps: int = 4) -> tuple[DeepRegressor, Observer]:
    module, observer = DeepRegressor(), Observer()
    trainer = make_trainer(max_steps=steps, seed=0, callbacks=[*callbacks, observer])
    trainer.fit(module, loader)
    return module, observer


def test_checkpointed_blocks_give_the_same_gradients_keep_fewer_activations_and_keep_their_keys(
        make_trainer, regression_loader):
    plain, plain_seen = fit(make_trainer, regression_loader)
    checkpointed, seen = fit(make_trainer, regression_loader, GradientCheckpointing(modules=Block))
    for expected, got in zip(plain_seen.gradients, seen.gradients, strict=True):
        for name, gradient in expected.items():
            assert torch.equal(got[name], gradient), name
    assert max(seen.saved_bytes) < 0.5 * min(plain_seen.saved_bytes)  # the blocks' activations were not kept
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert not any("forward" in block.__dict__ for block in checkpointed.model.blocks)  # put back after fit


def test_checkpointing_by_names_selects_those_blocks(make_trainer, regression_loader):
    _, plain_seen = fit(make_trainer, regression_loader, steps=1)
    _, seen = fit(make_trainer, regression_loader, GradientCheckpointing(modules=["model.blocks.0", "model.blocks.2"]), steps=1)
    _, all_seen = fit(make_trainer, regression_loader, GradientCheckpointing(modules=Block), steps=1)
    assert all_seen.saved_bytes[0] < seen.saved_bytes[0] < plain_seen.saved_bytes[0]


def test_a_selection_matching_nothing_is_an_error_listing_the_top_level_children(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"GradientCheckpointing\(modules=...\) selects no submodule of DeepRegressor\. "
                                         r"Its top-level children are: model \(Deep\)\."):
        fit(make_trainer, regression_loader, GradientCheckpointing(modules=nn.Conv2d))
    with pytest.raises(ValueError, match=r"GradientCheckpointing\(modules=None\): say which blocks"):
        GradientCheckpointing(modules=None)


class RunCounter:
    """An AOTAutograd forward compiler that counts how often its graphs run, running them as traced."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, graph, example_inputs):
        from functorch.compile import make_boxed_func

        def run(*args):
            self.runs += 1
            return graph(*args)

        return make_boxed_func(run)


def test_compile_checkpointing_and_amp_on_the_same_blocks_compose(make_trainer, regression_data):
    # (torch._dynamo is imported here, not at collection: ~2 s of CPU in each test process.)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    # Batches of 256, so that activations, not the blocks' bfloat16 weight copies, dominate what is saved.
    loader = DataLoader(ConcatDataset([regression_data] * 16), batch_size=256)
    _, amp_only = fit(make_trainer, loader, AMP("bf16"))
    counter = RunCounter()  # an AOT backend, as inductor: the compiled backward honours the checkpoint
    module, seen = fit(make_trainer, loader, GradientCheckpointing(modules=Block),
                       Compile(modules=Block, backend=aot_autograd(fw_compiler=counter, bw_compiler=lambda graph, _: make_boxed_func(graph))),
                       AMP("bf16"))
    assert counter.runs == 3 * 4  # each of the 3 blocks ran its compiled forward at each of the 4 steps
    assert max(seen.saved_bytes) < 0.5 * min(amp_only.saved_bytes)  # checkpointing inside the compiled blocks
    for expected, got in zip(amp_only.gradients, seen.gradients, strict=True):
        for name, gradient in expected.items():
            torch.testing.assert_close(got[name], gradient, rtol=2e-2, atol=2e-3, msg=name)  # bf16 rounding
    assert {p.dtype for p in module.parameters()} == {torch.float32}
