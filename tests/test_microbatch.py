"""AutoMicrobatch: a batch that runs out of memory trains as microbatches, with the whole batch's update.

The machine has no GPU, so the module raises ``torch.OutOfMemoryError`` itself for batches above a
size, in its forward or (through an autograd function) in the middle of its backward, as a GPU
would; the run must end with the weights of the same run on a module without the limit.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from callbacks import AMP, AutoMicrobatch, Callback
from linear_regression import LinearRegression, regression_samples

Pair = collections.namedtuple("Pair", "x y")


class RaiseInBackward(torch.autograd.Function):
    """Identity forward; its backward runs out of memory for more than ``limit`` rows."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if len(grad) > ctx.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (in the test's backward: {len(grad)} rows)")
        return grad, None


class Limited(LinearRegression):
    """Linear(4, 8) -> Linear(8, 2), MSE; batches above ``limit`` samples run out of memory in
    ``where`` ("forward", "backward", or None: never). Logs the loss (mean) and the sample count (sum)."""

    def __init__(self, limit: int = 0, where: str | None = None) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        self.limit, self.where, self.sizes = limit, where, []

    def training_step(self, batch, batch_idx):
        x, y = (batch.x, batch.y) if isinstance(batch, Pair) else batch
        self.sizes.append(len(x))
        if self.where == "forward" and len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (in the test's forward: {len(x)} samples)")
        hidden = self.layer[0](x)
        if self.where == "backward":  # the second layer's gradient is made before this raises
            hidden = RaiseInBackward.apply(hidden, self.limit)
        loss = F.mse_loss(self.layer[1](hidden).float(), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        self.log("train/samples", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum")
        return {"loss": loss, "size": len(x)}


class BatchLosses(Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def fit(make_trainer, module, sizes=(10,) * 5, batch_type=lambda x, y: (x, y), **settings):
    """Two epochs on batches of ``sizes`` samples (from 0), ``module`` starting from seeded weights."""
    torch.manual_seed(0)
    module.layer.load_state_dict(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict())
    x, y = regression_samples(sum(sizes))
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    batches = [batch_type(x[start:start + size], y[start:start + size]) for start, size in zip(starts, sizes)]
    losses = BatchLosses()
    settings["callbacks"] = settings.get("callbacks", []) + [losses]
    trainer = make_trainer(max_epochs=2, **settings)
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer, losses.losses


SETTINGS = {  # each run gets its own callbacks: an AMP keeps its scaler's state
    "plain": lambda: {},
    "accumulation": lambda: {"accumulate_grad_batches": 2},
    "clipping": lambda: {"gradient_clip_val": 0.05},
    "bf16": lambda: {"callbacks": [AMP("bf16")]},
    "fp16": lambda: {"callbacks": [AMP("fp16")], "accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_a_batch_that_runs_out_of_memory_trains_as_microbatches_with_the_whole_batches_weights(
        make_trainer, name, capfd):
    reference, limited = Limited(), Limited(limit=3, where="forward")
    expected, expected_losses = fit(make_trainer, reference, **SETTINGS[name]())
    settings = SETTINGS[name]()
    settings["callbacks"] = settings.get("callbacks", []) + [AutoMicrobatch()]
    trainer, losses = fit(make_trainer, limited, **settings)
    # Up to rounding: the microbatches sum their gradients in other groupings than the whole batch.
    # bfloat16 rounds each matmul's result to 8 bits of mantissa: split or not, such a run is about 1e-3
    # from a float32 run here, and as far from the other.
    tolerance = {"rtol": 1.6e-2, "atol": 4e-3} if name == "bf16" else {"rtol": 1e-5, "atol": 1e-6}
    for ours, theirs in zip(limited.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, **tolerance)
    assert trainer.global_step == expected.global_step  # no step skipped
    # 10 samples do not fit, nor 5: 4 microbatches of 3, 3, 3 and 1 (weighted by share) from then on.
    assert limited.sizes[:7] == [10, 5, 3, 3, 3, 1, 3] and max(limited.sizes[6:]) == 3
    assert sum(size for size in limited.sizes if size <= 3) == 100  # every sample of both epochs, once
    # The batch's loss and logged values are the whole batch's: a weighted mean, a sum counted once.
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected_losses), **tolerance)
    for key in ("train/loss_step", "train/loss_epoch", "train/samples"):
        torch.testing.assert_close(trainer.callback_metrics[key], expected.callback_metrics[key], **tolerance)
    assert trainer.callback_metrics["train/samples"].item() == 50
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("AutoMicrobatch")]
    assert said == ["AutoMicrobatch: training batch 0 (epoch 0, global step 0) ran out of memory in the forward; it "
                    "and the batches after it run as 4 microbatches of up to 3 samples, gradients accumulated "
                    "within the step (the same update)."]


def test_out_of_memory_in_the_backward_drops_the_partial_gradients_and_redoes_the_batch(make_trainer):
    reference, limited = Limited(), Limited(limit=5, where="backward")
    fit(make_trainer, reference, batch_type=Pair)
    trainer, _ = fit(make_trainer, limited, batch_type=Pair, callbacks=[AutoMicrobatch()])
    for ours, theirs in zip(limited.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert limited.sizes[:4] == [10, 5, 5, 5]  # the whole batch's backward failed; it ran again as 2
    callback = next(c for c in trainer.callbacks if isinstance(c, AutoMicrobatch))
    assert callback.state_dict() == {"microbatches": 2}  # checkpoints keep the split


def test_out_of_memory_in_a_backward_inside_an_accumulation_window_cannot_be_redone_and_says_so(make_trainer):
    sizes = (4, 8, 4, 4)  # the second batch of the first window does not fit
    with pytest.raises(RuntimeError, match=r"inside an accumulation window .* AutoMicrobatch\(microbatches=2\)"):
        fit(make_trainer, Limited(limit=5, where="backward"), sizes, accumulate_grad_batches=2,
            callbacks=[AutoMicrobatch()])
    reference, limited = Limited(), Limited(limit=5, where="backward")
    fit(make_trainer, reference, sizes, accumulate_grad_batches=2)
    fit(make_trainer, limited, sizes, accumulate_grad_batches=2, callbacks=[AutoMicrobatch(microbatches=2)])
    for ours, theirs in zip(limited.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_single_sample_that_does_not_fit_raises_the_out_of_memory_error_saying_so(make_trainer):
    with pytest.raises(torch.OutOfMemoryError, match="even as microbatches of one sample") as raised:
        fit(make_trainer, Limited(limit=0, where="forward"), callbacks=[AutoMicrobatch()])
    assert "in the test's forward: 1 samples" in str(raised.value.__cause__)


@pytest.mark.parametrize("batch_type, match", [
    (lambda x, y: (x, y[:3]), r"different first sizes \(\[3, 10\]\)"),
    (lambda x, y: (x, y, object()), "holds a object, which AutoMicrobatch cannot split"),
    (lambda x, y: ["a", "b"], "holds no tensor with a batch dimension"),
])
def test_a_batch_that_cannot_be_split_is_a_clear_error(make_trainer, batch_type, match):
    class OutOfMemory(Limited):
        def training_step(self, batch, batch_idx):
            raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

    with pytest.raises(ValueError, match=f"ran out of memory and cannot be split: .*{match}"):
        fit(make_trainer, OutOfMemory(), batch_type=batch_type, callbacks=[AutoMicrobatch()])


def test_dicts_dataclasses_and_lists_of_strings_are_split_sample_by_sample(make_trainer):
    @dataclasses.dataclass
    class Inputs:
        x: torch.Tensor
        names: list

    class Named(Limited):
        def training_step(self, batch, batch_idx):
            inputs = batch["inputs"]
            assert len(inputs.names) == len(inputs.x) and inputs.names[0] == f"sample {int(batch['index'][0])}"
            assert batch["split"] == "train"
            return super().training_step((inputs.x, batch["y"]), batch_idx)

    reference, limited = Limited(), Named(limit=4, where="forward")
    fit(make_trainer, reference)
    fit(make_trainer, limited, callbacks=[AutoMicrobatch()], batch_type=lambda x, y: {
        "inputs": Inputs(x, [f"sample {i}" for i in range(len(x))]), "y": y, "index": torch.arange(len(x)),
        "split": "train"})
    for ours, theirs in zip(limited.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_batchnorm_in_training_mode_is_refused_unless_accepted(make_trainer):
    class Normalized(Limited):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(4)

    with pytest.raises(ValueError, match=r"BatchNorm layers in training mode \(norm\).*allow_batchnorm=True"):
        fit(make_trainer, Normalized(), callbacks=[AutoMicrobatch()])
    trainer, _ = fit(make_trainer, Normalized(), callbacks=[AutoMicrobatch(allow_batchnorm=True)])
    assert trainer.global_step == 10


def test_manual_optimization_is_refused(make_trainer):
    class Manual(Limited):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="self.automatic_optimization = False .* cannot be split from outside"):
        fit(make_trainer, Manual(), callbacks=[AutoMicrobatch()])
    with pytest.raises(ValueError, match="AutoMicrobatch\\(microbatches=0\\): use a whole number"):
        AutoMicrobatch(microbatches=0)


def test_the_performance_report_names_the_split(make_trainer, capfd):
    fit(make_trainer, Limited(limit=5, where="forward"), callbacks=[AutoMicrobatch()], report=True)
    err = capfd.readouterr().err
    assert "  microbatches: each batch ran as 2 from global step 0 on (AutoMicrobatch" in err
    assert err.count("AutoMicrobatch: training batch") == 1


def test_backward_hooks_run_once_per_microbatch_and_the_batch_hooks_once_per_batch(make_trainer):
    class Counts(Callback):
        def __init__(self):
            self.backward_losses, self.batch_ends = [], 0

        def on_before_backward(self, trainer, module, loss):
            self.backward_losses.append(loss.item())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batch_ends += 1

    counts = Counts()
    limited = Limited(limit=5, where="forward")
    fit(make_trainer, limited, sizes=(10, 7), callbacks=[counts, AutoMicrobatch()])
    assert counts.batch_ends == 4  # two batches, two epochs
    assert len(counts.backward_losses) == 8  # each batch as 2 microbatches (10 -> 5 + 5, 7 -> 4 + 3)
    assert limited.sizes == [10, 5, 5, 4, 3, 5, 5, 4, 3]
