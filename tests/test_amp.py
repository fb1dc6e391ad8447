"""Mixed precision: AMP("bf16" | "fp16" | "auto") and Trainer(precision=...), on the CPU.

The float16 path is checked against the recipe written by hand with ``torch.amp.GradScaler``
(scale, backward, unscale, clip, step, update), bit for bit, with accumulation, clipping and a
scheduler, in automatic and in manual optimization; a step the scaler skips changes nothing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import AMP, Callback, ModelCheckpoint
from linear_regression import LinearRegression
from strategies import DDP, SingleDevice
from trainer import Trainer, TrainingModule


class Regressor(TrainingModule):
    """A 2-layer MLP on the regression data; records the dtype its first layer computes in."""

    def __init__(self, optimizer: str = "sgd", scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.optimizer, self.scheduler = optimizer, scheduler
        self.compute_dtypes: set[torch.dtype] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net[0](x)
        self.compute_dtypes.add(hidden.dtype)
        loss = F.mse_loss(self.net[2](self.net[1](hidden)).float(), y)
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = (torch.optim.Adam(self.parameters(), lr=0.01) if self.optimizer == "adam"
                     else torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9))
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: A loss scale at which the regression data's first two optimizer steps overflow float16.
OVERFLOWING_SCALE = 2.0**18


class GradientRecorder(Callback):
    """Keeps a copy of the gradients each on_before_optimizer_step sees."""

    def __init__(self) -> None:
        self.gradients: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.gradients.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amp_computes_in_half_precision_and_keeps_float32_master_weights(make_trainer, regression_loader, dtype):
    module = Regressor()
    trainer = make_trainer(max_epochs=3, callbacks=[AMP(dtype)])
    trainer.fit(module, regression_loader)
    assert module.compute_dtypes == {dtype}
    assert {parameter.dtype for parameter in module.parameters()} == {torch.float32}
    assert all(value.dtype == torch.float32 for state in trainer.optimizers[0].state.values() for value in state.values())
    assert trainer.callback_metrics["train/loss_epoch"].dtype == torch.float32


def test_float16_steps_equal_the_hand_written_grad_scaler_recipe_with_accumulation_and_clipping(make_trainer, regression_loader):
    # The first two steps overflow float16 (OVERFLOWING_SCALE), so the scaler skips them and backs off:
    # the run covers skipped steps (no scheduler step), clipping after unscaling, and accumulation.
    reference = Regressor(scheduler=True)
    configured = reference.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOWING_SCALE)
    hand_gradients, skipped = [], 0
    for epoch in range(2):
        for index, (x, y) in enumerate(regression_loader):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(reference.net(x).float(), y)
            scaler.scale(loss / 2).backward()
            if index % 2 == 1:
                scaler.unscale_(optimizer)
                hand_gradients.append([p.grad.clone() for p in reference.parameters()])
                torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if scaler.get_scale() < scale:
                    skipped += 1
                else:
                    scheduler.step()

    module, recorder = Regressor(scheduler=True), GradientRecorder()
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5,
                           callbacks=[AMP("fp16", init_scale=OVERFLOWING_SCALE), recorder])
    trainer.fit(module, regression_loader)

    assert 0 < skipped < 8  # both paths ran: skipped steps and real ones
    assert trainer.global_step == 8  # skipped steps count, as in Lightning
    for seen, expected in zip(recorder.gradients, hand_gradients, strict=True):  # true (unscaled) gradients
        for a, b in zip(seen, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # an overflowed step's are inf/NaN
    for (name, value), expected in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), name
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8 - skipped


def test_a_skipped_float16_step_changes_no_weight_optimizer_state_or_schedule_and_is_no_nonfinite_skip(
        make_trainer, regression_loader):
    module = Regressor(optimizer="adam", scheduler=True)
    initial = copy.deepcopy(module.state_dict())
    amp = AMP("fp16", init_scale=2.0**40)  # every gradient overflows float16
    trainer = make_trainer(max_steps=2, on_nonfinite_loss="skip", callbacks=[amp])
    trainer.fit(module, regression_loader)

    assert trainer.global_step == 2
    assert all(torch.equal(value, initial[name]) for name, value in module.state_dict().items())
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    assert optimizer.state_dict()["state"] == {}  # Adam made no step: no moments, no step count
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.01
    assert trainer.num_skipped_steps == 0  # the loss was finite: not an on_nonfinite_loss skip
    assert amp.scaler.get_scale() == 2.0**38  # backed off twice


class ManualRegressor(Regressor):
    """Manual optimization with Lightning's clip_gradients between backward and step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.learning_rates: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        loss = F.mse_loss(self.net(x).float(), y)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        self.learning_rates.append(optimizer.param_groups[0]["lr"])
        return loss


def test_manual_optimization_under_float16_scales_unscales_before_clipping_and_steps_through_the_scaler(
        make_trainer, regression_loader):
    reference = Regressor()
    optimizer = reference.configure_optimizers()
    initial = copy.deepcopy(reference.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOWING_SCALE)
    for x, y in regression_loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(reference.net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    module = ManualRegressor()
    trainer = make_trainer(max_epochs=1, callbacks=[AMP("fp16", init_scale=OVERFLOWING_SCALE)])
    trainer.fit(module, regression_loader)
    assert not torch.equal(reference.net[0].weight, initial["net.0.weight"])  # some steps were not skipped
    for (name, value), expected in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), name
    assert trainer.global_step == 8  # every opt.step(), skipped or not
    assert module.learning_rates == [0.05] * 8  # the wrapper reads through to the optimizer


class TwoOptimizers(TrainingModule):
    """Both backward passes first, then both steps: the scale may only change after both steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer_a, optimizer_b = self.optimizers()
        self.manual_backward(F.mse_loss(self.a(x).float(), y))
        self.manual_backward(F.mse_loss(self.b(x).float(), y))
        optimizer_a.step()
        optimizer_b.step()
        optimizer_a.zero_grad()
        optimizer_b.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def test_two_optimizers_stepped_after_both_backwards_unscale_with_the_scale_they_were_made_with(
        make_trainer, regression_loader):
    reference = TwoOptimizers()
    optimizers = reference.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=1)  # the scale moves every step
    for x, y in regression_loader:
        for layer in (reference.a, reference.b):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(layer(x).float(), y)
            scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()  # once, after both steps (GradScaler's recipe for several optimizers)
        for optimizer in optimizers:
            optimizer.zero_grad()

    module = TwoOptimizers()
    make_trainer(max_epochs=1, callbacks=[AMP("fp16", init_scale=2.0**17, growth_interval=1)]).fit(module, regression_loader)
    for (name, value), expected in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), name


def test_the_scaler_state_is_checkpointed_and_restored(make_trainer, regression_loader, tmp_path):
    amp = AMP("fp16", init_scale=OVERFLOWING_SCALE)
    trainer = make_trainer(max_epochs=1, callbacks=[amp, ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    trainer.fit(Regressor(), regression_loader)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]["AMP"]["scaler"]
    assert saved["scale"] == amp.scaler.get_scale() < OVERFLOWING_SCALE

    resumed = AMP("fp16", init_scale=1.0)
    trainer = make_trainer(max_epochs=1, callbacks=[resumed, ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    trainer.fit(Regressor(), regression_loader, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.scaler.get_scale() == saved["scale"]  # the run was complete: nothing left to step


class LogsHalf(LinearRegression):
    def __init__(self) -> None:
        super().__init__(lr=0.01)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("half", torch.tensor(30000.0, dtype=torch.float16), on_step=True, on_epoch=True, batch_size=64)
        return loss


def test_a_half_precision_value_is_logged_as_float32_without_overflow(make_trainer, regression_loader):
    trainer = make_trainer(max_epochs=1, log_every_n_steps=2, callbacks=[AMP("fp16")])
    trainer.fit(LogsHalf(), regression_loader)
    # 30000 * batch_size 64 overflows float16 (max 65504): the epoch mean is summed in float32.
    assert trainer.callback_metrics["half_epoch"].dtype == torch.float32
    assert trainer.callback_metrics["half_epoch"].item() == 30000.0
    assert trainer.logged_metrics["half_step"] == 30000.0


def test_auto_chooses_bfloat16_on_the_cpu_and_says_so(make_trainer, regression_loader, capsys):
    module, amp = Regressor(), AMP("auto")
    make_trainer(max_steps=1, callbacks=[amp]).fit(module, regression_loader)
    assert amp.dtype == torch.bfloat16 and module.compute_dtypes == {torch.bfloat16}
    assert "AMP('auto'): bfloat16 autocast on cpu" in capsys.readouterr().err


@pytest.mark.parametrize(("capability", "dtype", "said"), [
    ((9, 0), torch.bfloat16, "bfloat16 autocast on cuda:0 (no loss scaling needed)"),
    ((7, 5), torch.float16, "float16 autocast on cuda:0 (with loss scaling: compute capability 7.5 only emulates "
                            "bfloat16, without tensor-core speed)"),
])
def test_auto_on_a_gpu_chooses_bfloat16_only_where_it_is_native(two_gpus, monkeypatch, capsys, capability, dtype, said):
    # torch.cuda.is_bf16_supported() says yes on a T4 (7.5), where bfloat16 is emulated and slow.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    amp, module = AMP("auto"), Regressor()
    trainer = Trainer(strategy=SingleDevice("cuda:0"), callbacks=[amp], logger=False, enable_progress_bar=False)
    with warnings.catch_warnings():  # a GradScaler on a machine without CUDA disables itself, saying so
        warnings.simplefilter("ignore")
        amp.setup(trainer, module, "fit")
    assert amp.dtype == dtype and (amp.scaler is not None) == (dtype == torch.float16)
    assert f"AMP('auto'): {said}." in capsys.readouterr().err


class RecordsEvaluationDtypes(Regressor):
    """Records the dtype its first layer computes in, per stage."""

    def __init__(self) -> None:
        super().__init__()
        self.evaluation_dtypes: dict[str, set[torch.dtype]] = {}

    def _record(self, stage, batch):
        self.evaluation_dtypes.setdefault(stage, set()).add(self.net[0](batch[0]).dtype)
        return self.net(batch[0])

    def validation_step(self, batch, batch_idx):
        self._record("validate", batch)

    def test_step(self, batch, batch_idx):
        self._record("test", batch)

    def predict_step(self, batch, batch_idx):
        return self._record("predict", batch)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_validation_test_and_predict_steps_compute_under_autocast_too(make_trainer, regression_loader, precision):
    module = RecordsEvaluationDtypes()
    with warnings.catch_warnings():  # "16-mixed" on the CPU: bfloat16, with a warning
        warnings.simplefilter("ignore")
        trainer = make_trainer(max_steps=2, precision=precision, limit_val_batches=2)
        trainer.fit(module, regression_loader, regression_loader)  # the sanity check and validation
        trainer.test(module, regression_loader, verbose=False)
        predictions = trainer.predict(module, regression_loader)
    assert module.evaluation_dtypes == {"validate": {torch.bfloat16}, "test": {torch.bfloat16},
                                        "predict": {torch.bfloat16}}
    assert {prediction.dtype for prediction in predictions} == {torch.bfloat16}
    assert module.compute_dtypes == {torch.bfloat16}


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16-mixed", torch.bfloat16), ("32-true", None), ("32", None), (32, None),
])
def test_lightning_precision_spellings_translate_into_an_amp_callback(make_trainer, regression_loader, precision, dtype):
    module = Regressor()
    trainer = make_trainer(max_steps=1, precision=precision)
    assert [c for c in trainer.callbacks if isinstance(c, AMP)] == ([] if dtype is None else [trainer.callbacks[0]])
    trainer.fit(module, regression_loader)
    assert module.compute_dtypes == {dtype or torch.float32}


def test_16_mixed_on_the_cpu_trains_in_bfloat16_with_a_warning_as_in_lightning(make_trainer, regression_loader):
    module = Regressor()
    trainer = make_trainer(max_steps=1, precision="16-mixed")
    with pytest.warns(UserWarning, match=r"AMP\('float16', cpu_dtype='bfloat16'\) runs bfloat16 on the CPU; "
                                         r"Trainer\(precision='16-mixed'\) asks for this, as Lightning"):
        trainer.fit(module, regression_loader)
    assert module.compute_dtypes == {torch.bfloat16}


@pytest.mark.parametrize(("precision", "modern"), [("16", "16-mixed"), (16, "16-mixed"), ("bf16", "bf16-mixed")])
def test_old_precision_spellings_work_with_a_warning_as_in_lightning(make_trainer, precision, modern):
    with pytest.warns(UserWarning, match=f"old spelling.*write precision='{modern}'"):
        trainer = make_trainer(precision=precision)
    assert isinstance(trainer.callbacks[0], AMP)


class TakesMixedPrecisionOver(SingleDevice):
    """A strategy with its own mixed precision (as FSDP's policy): Trainer(precision=) adds no AMP."""

    def mixed_precision(self, dtype):
        self.asked = dtype
        return True


def test_a_strategy_that_takes_mixed_precision_over_gets_no_amp_callback(make_trainer):
    strategy = TakesMixedPrecisionOver("cpu")
    trainer = make_trainer(strategy=strategy, precision="bf16-mixed")
    assert strategy.asked == torch.bfloat16
    assert not any(isinstance(c, AMP) for c in trainer.callbacks)


@pytest.mark.parametrize("make_strategy", [lambda: SingleDevice("cpu"), lambda: DDP(devices=2, backend="gloo")],
                         ids=["single_device", "ddp"])
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_a_strategy_without_mixed_precision_of_its_own_leaves_it_to_an_amp_callback(make_trainer, make_strategy,
                                                                                     precision, dtype):
    # Strategy.mixed_precision's default decision (False), which every strategy but FSDP keeps.
    assert make_strategy().mixed_precision(dtype) is False
    trainer = make_trainer(strategy=make_strategy(), precision=precision)
    assert [type(c) for c in trainer.callbacks if isinstance(c, AMP)] == [AMP]


@pytest.mark.parametrize("precision", ["128-true", "8-true", "mixed", 8, True])
def test_an_unknown_precision_is_an_error_listing_the_accepted_ones(make_trainer, precision):
    with pytest.raises(ValueError, match=r"Trainer\(precision=.*is not supported.*'32-true', '32', 32, '16-mixed'.*'bf16-mixed'"):
        make_trainer(precision=precision)


def test_precision_together_with_an_amp_callback_is_an_error_naming_both(make_trainer):
    with pytest.raises(ValueError, match=r"Trainer\(precision='16-mixed'\) and callbacks=\[AMP\('bfloat16'\)\] both set"):
        make_trainer(precision="16-mixed", callbacks=[AMP("bf16")])


def test_amp_arguments_are_checked(make_trainer):
    with pytest.raises(ValueError, match=r"AMP\(dtype='fp8'\): use 'bfloat16' \('bf16'\), 'float16' \('fp16'\) or 'auto'"):
        AMP("fp8")
    with pytest.raises(ValueError, match=r"AMP\('bfloat16'\) got \['init_scale'\].*bfloat16 does not need"):
        AMP("bf16", init_scale=1024.0)


class OwnsTheStep(Callback):
    """Takes over optimizer.step() (a sharpness-aware step would)."""

    owns_optimizer_step = True

    def optimizer_step(self, trainer, module, optimizer):
        optimizer.step()
        return True


class OwnsBackward(Callback):
    owns_backward = True

    def backward(self, trainer, module, loss):
        trainer.strategy.backward(loss)


@pytest.mark.parametrize(("other", "seam"), [(OwnsTheStep, "owns_optimizer_step"), (OwnsBackward, "owns_backward")])
def test_two_callbacks_owning_one_seam_is_an_error_naming_both(make_trainer, regression_loader, other, seam):
    trainer = make_trainer(max_steps=1, callbacks=[AMP("fp16"), other()])
    with pytest.raises(ValueError, match=f"AMP and {other.__name__} both set {seam}=True"):
        trainer.fit(Regressor(), regression_loader)


def test_bfloat16_owns_no_seam_so_another_callback_may_own_the_step(make_trainer, regression_loader):
    module = Regressor()
    make_trainer(max_steps=2, callbacks=[AMP("bf16"), OwnsTheStep()]).fit(module, regression_loader)
    assert module.compute_dtypes == {torch.bfloat16}
