"""Lightning's "true" precisions: Trainer(precision="64-true" | "bf16-true" | "16-true"), TruePrecision.

What Lightning's DoublePrecision and HalfPrecision plugins do, checked through the public API: the
module converted once before configure_optimizers (configure_model's layers made in the dtype), the
default dtype set while the steps run and restored after (also after an error), each batch's
floating tensors converted before the batch transfer hooks (integer targets kept), float64 logged
values kept in float64. "64-true" is checked bit for bit against a hand-written float64 loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import AMP, Callback, TruePrecision
from linear_regression import LinearRegression
from strategies import FSDP
from trainer import Trainer

DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


def classification_loader(batch_size: int = 8) -> DataLoader:
    """32 samples of 4 float features with integer class labels (0, 1 or 2)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Classifier(LinearRegression):
    """A Linear(4, 3) classifier trained with SGD with momentum (Adam's default eps, 1e-8, is 0 in
    float16, as it is in Lightning's "16-true": 0/0 where a gradient is 0); a second layer is built late, in configure_model.
    Records what each step sees: the batch's dtypes, a fresh torch.zeros' dtype, the loss's dtype."""

    def __init__(self, late_head: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        if not late_head:
            self.head = nn.Linear(3, 3)
        self.seen: list[dict[str, torch.dtype]] = []
        self.configure_model_default: torch.dtype | None = None

    def configure_model(self):
        self.configure_model_default = torch.get_default_dtype()
        if not hasattr(self, "head"):
            self.head = nn.Linear(3, 3)

    def _loss(self, batch, stage):
        x, y = batch
        loss = F.cross_entropy(self.head(self.layer(x)), y)
        self.seen.append({"stage": stage, "x": x.dtype, "y": y.dtype, "zeros": torch.zeros(2).dtype, "loss": loss.dtype})
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, "train")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch, "validate"))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch, "test"))

    def predict_step(self, batch, batch_idx):
        self._loss(batch, "predict")
        return self.head(self.layer(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true", "16-true"])
def test_weights_inputs_new_tensors_and_loss_take_the_dtype_and_integer_labels_stay(make_trainer, precision):
    dtype, model = DTYPES[precision], Classifier()
    trainer = make_trainer(max_epochs=1, limit_train_batches=2, precision=precision, limit_val_batches=1,
                           num_sanity_val_steps=0)
    trainer.fit(model, classification_loader(), classification_loader())
    assert trainer.precision == precision
    assert {parameter.dtype for parameter in model.parameters()} == {dtype}
    optimizer = trainer.optimizers[0]  # made after the conversion: it steps the module's own parameters
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(stepped) == 4 and all(p is q for p, q in zip(stepped, model.parameters()))
    assert {state["momentum_buffer"].dtype for state in optimizer.state.values()} == {dtype}
    assert model.configure_model_default == dtype  # the late layer was made in the dtype
    assert {(s["x"], s["y"], s["zeros"], s["loss"]) for s in model.seen} == {(dtype, torch.int64, dtype, dtype)}
    assert {s["stage"] for s in model.seen} == {"train", "validate"}
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("precision", [64, "64"])
def test_64_and_its_string_mean_64_true_without_a_warning_as_in_lightning(make_trainer, precision, recwarn):
    assert make_trainer(precision=precision).precision == "64-true"
    assert not [w for w in recwarn if "precision" in str(w.message)]


def test_validate_test_and_predict_run_in_the_dtype(make_trainer):
    model = Classifier()
    trainer = make_trainer(precision="bf16-true")
    trainer.validate(model, classification_loader(), verbose=False)
    test_loss = trainer.test(model, classification_loader(batch_size=32), verbose=False)[0]["test_loss"]
    predictions = trainer.predict(model, classification_loader(batch_size=16))
    assert {(s["stage"], s["x"], s["y"], s["zeros"]) for s in model.seen} == {
        (stage, torch.bfloat16, torch.int64, torch.bfloat16) for stage in ("validate", "test", "predict")}
    assert [p.dtype for p in predictions] == [torch.bfloat16, torch.bfloat16]
    x, y = classification_loader(batch_size=32).dataset.tensors  # one batch: its mean loss, in bfloat16 by hand
    assert test_loss == F.cross_entropy(model.head(model.layer(x.bfloat16())), y).float().item()
    assert torch.get_default_dtype() == torch.float32


def test_the_default_dtype_is_restored_when_a_step_raises(make_trainer):
    class Failing(LinearRegression):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("broken step")

    with pytest.raises(RuntimeError, match="broken step"):
        make_trainer(max_steps=1, precision="64-true").fit(Failing(), classification_loader())
    assert torch.get_default_dtype() == torch.float32


def test_64_true_gives_the_weights_of_a_hand_written_float64_loop_bit_for_bit(make_trainer, regression_loader):
    torch.manual_seed(0)
    model = LinearRegression(lr=0.05)
    by_hand = nn.Linear(4, 2)
    by_hand.load_state_dict(model.layer.state_dict())
    make_trainer(max_epochs=2, precision="64-true").fit(model, regression_loader)

    by_hand.double()
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.05)
    for _ in range(2):
        for x, y in regression_loader:
            loss = F.mse_loss(by_hand(x.double()), y.double())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert model.layer.weight.dtype == torch.float64
    assert torch.equal(model.layer.weight, by_hand.weight) and torch.equal(model.layer.bias, by_hand.bias)


def test_a_resumed_bf16_true_run_continues_exactly_and_its_checkpoint_holds_bf16(make_trainer, tmp_path):
    torch.manual_seed(0)
    whole = Classifier(late_head=False)
    torch.manual_seed(0)
    first_half = Classifier(late_head=False)
    make_trainer(max_epochs=2, precision="bf16-true").fit(whole, classification_loader())

    trainer = make_trainer(max_epochs=1, precision="bf16-true")
    trainer.fit(first_half, classification_loader())
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    checkpoint = torch.load(tmp_path / "epoch1.ckpt", weights_only=True)
    assert {tensor.dtype for tensor in checkpoint["state_dict"].values()} == {torch.bfloat16}
    resumed = Classifier(late_head=False)  # a float32 module: the conversion comes before the restore
    make_trainer(max_epochs=2, precision="bf16-true").fit(resumed, classification_loader(),
                                                          ckpt_path=tmp_path / "epoch1.ckpt")
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name

    # As in Lightning, load_from_checkpoint builds a float32 module and casts the bf16 weights into it.
    loaded = Classifier.load_from_checkpoint(tmp_path / "epoch1.ckpt", late_head=False)
    assert loaded.layer.weight.dtype == torch.float32
    assert torch.equal(loaded.layer.weight, first_half.layer.weight.float())


def test_batches_are_converted_before_the_batch_transfer_hooks_as_in_lightning(make_trainer):
    class Recording(LinearRegression):
        def __init__(self):
            super().__init__()
            self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

        def on_before_batch_transfer(self, batch, dataloader_idx):
            self.dtypes.append((batch["x"].dtype, batch["index"].dtype))
            return batch

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.layer(batch["x"]), batch["y"])

    samples = [{"x": torch.randn(4), "y": torch.randn(2), "index": torch.tensor(i)} for i in range(8)]
    model = Recording()
    make_trainer(max_steps=1, precision="64-true").fit(model, DataLoader(samples, batch_size=4))
    assert model.dtypes == [(torch.float64, torch.int64)]


def test_a_float64_value_keeps_its_digits_in_callback_metrics_and_the_logs(make_trainer, regression_loader):
    class LogsAThird(LinearRegression):
        def training_step(self, batch, batch_idx):
            self.log("third", torch.tensor(1.0, dtype=torch.float64) / 3)
            return super().training_step(batch, batch_idx)

    class Logged(Callback):
        def __init__(self):
            self.values: list[float] = []

        def on_log(self, trainer, module, metrics, step):
            self.values.append(metrics["third"])

    logged = Logged()
    trainer = make_trainer(max_steps=2, precision="64-true", log_every_n_steps=1, callbacks=[logged])
    trainer.fit(LogsAThird(), regression_loader)
    assert logged.values == [1 / 3, 1 / 3]  # float32 would give 0.3333333432674408
    assert trainer.callback_metrics["third"].dtype == torch.float64 and trainer.callback_metrics["third"].item() == 1 / 3


def test_a_true_precision_callback_callback_is_the_same_as_the_precision_argument(make_trainer, regression_loader):
    model = LinearRegression()
    trainer = make_trainer(max_steps=1, callbacks=[TruePrecision("float64")])
    trainer.fit(model, regression_loader)
    assert trainer.precision == "64-true" and model.layer.weight.dtype == torch.float64


@pytest.mark.parametrize(("arguments", "message"), [
    ({"precision": "bf16-true", "callbacks": [TruePrecision("bf16")]},
     r"Trainer\(precision='bf16-true'\) and callbacks=\[TruePrecision\('bfloat16'\)\] both set the precision"),
    ({"precision": "64-true", "callbacks": [AMP("bf16")]},
     r"Trainer\(precision='64-true'\) and callbacks=\[AMP\('bfloat16'\)\] both set the precision"),
    ({"callbacks": [AMP("bf16"), TruePrecision("64")]},
     r"callbacks=\[AMP\('bfloat16'\), TruePrecision\('float64'\)\] both set the precision"),
])
def test_two_places_setting_the_precision_is_an_error_naming_both(make_trainer, arguments, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(**arguments)


def test_true_precision_under_fsdp_is_refused_with_the_way():
    with pytest.raises(ValueError, match=r"Trainer\(precision='bf16-true'\) keeps the weights in bfloat16, which "
                                         r"Cadence does not build under FSDP. Use precision='bf16-mixed'"):
        Trainer(strategy=FSDP(devices=2), precision="bf16-true", logger=False)


def test_64_true_on_an_apple_gpu_is_an_error_before_training(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"'64-true' precision .* needs float64, which Apple GPUs \(mps\) do not "
                                         r"have. Train in float64 on the CPU"):
        Trainer(strategy="mps", precision="64-true", logger=False)
    assert Trainer(strategy="mps", precision="bf16-true", logger=False).precision == "bf16-true"


@pytest.mark.parametrize("dtype", ["float32", torch.float32, "128", True])
def test_an_unknown_true_precision_dtype_is_an_error(dtype):
    with pytest.raises(ValueError, match=r"TruePrecision\(dtype=.*\): use 'float64' \('64'\), 'bfloat16'"):
        TruePrecision(dtype)


def test_complex_buffers_stay_complex_and_follow_the_default_dtype_where_lightning_says(make_trainer, regression_loader):
    # Lightning's test_double_precision with its complex buffers: model.double() leaves complex tensors
    # alone, and a complex tensor made under float64 default is complex128.
    class WithComplexBuffers(LinearRegression):
        def __init__(self):
            super().__init__()
            self.register_buffer("made_in_init", torch.complex(torch.rand(3), torch.rand(3)), persistent=False)

        def configure_model(self):
            self.register_buffer("made_in_configure_model", torch.complex(torch.rand(3), torch.rand(3)), persistent=False)

        def training_step(self, batch, batch_idx):
            self.step_complex_dtype = torch.tensor([1.2, 3.4j]).dtype
            return super().training_step(batch, batch_idx)

    model = WithComplexBuffers()
    make_trainer(max_steps=1, precision="64-true").fit(model, regression_loader)
    assert model.made_in_init.dtype == torch.complex64 and model.made_in_init.imag.abs().sum() > 0
    assert model.made_in_configure_model.dtype == torch.complex128
    assert model.step_complex_dtype == torch.complex128
    assert torch.tensor([1.2, 3.4j]).dtype == torch.complex64


def test_init_module_makes_the_model_in_the_dtype_on_the_device(make_trainer):
    trainer = make_trainer(precision="bf16-true")
    with trainer.init_module():
        model = Classifier(late_head=False)
        assert torch.get_default_dtype() == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.bfloat16, "cpu")}
    with make_trainer().init_module():  # "32-true": as without it
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"trainer.init_module\(empty_init=True\) skips initializing the weights"):
        with trainer.init_module(empty_init=True):
            pass
