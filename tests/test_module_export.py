"""``to_torchscript``, ``to_onnx`` and ``all_gather`` on a TrainingModule, as Lightning's LightningModule
(one process here; the strategy's ``all_gather`` across processes is what DDP/FSDP run)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from linear_regression import LinearRegression


class Exportable(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x):
        return self.layer(x)


def test_to_torchscript_scripts_or_traces_saves_and_keeps_the_training_mode(tmp_path):
    module = Exportable()
    x = torch.randn(5, 4)
    with pytest.deprecated_call(match="TorchScript is deprecated"):
        scripted = module.to_torchscript(file_path=tmp_path / "model.pt")
    assert module.training and torch.allclose(scripted(x), module(x))
    assert torch.allclose(torch.jit.load(tmp_path / "model.pt")(x), module(x))
    with pytest.deprecated_call():
        traced = module.to_torchscript(method="trace", check_trace=False)  # on example_input_array; kwargs to trace
    assert torch.allclose(traced(x), module(x))
    with pytest.deprecated_call(), pytest.raises(ValueError, match="only supports 'script' or 'trace'"):
        module.to_torchscript(method="export")
    module.example_input_array = None
    with pytest.deprecated_call(), pytest.raises(ValueError, match="pass it, or set model.example_input_array"):
        module.to_torchscript(method="trace")


@pytest.mark.skipif(importlib.util.find_spec("onnx") is not None, reason="onnx is installed: nothing to refuse")
def test_to_onnx_without_onnx_says_what_to_install(tmp_path):
    with pytest.raises(ModuleNotFoundError, match=r"to_onnx\(\)` requires `onnx` to be installed: pip install onnx"):
        Exportable().to_onnx(tmp_path / "model.onnx")


def test_all_gather_in_one_process_returns_tensors_of_the_collection_unchanged_in_shape():
    gathered = Exportable().all_gather({"loss": 0.5, "parts": [torch.ones(2), torch.zeros(3, 1)]})
    assert torch.equal(gathered["loss"], torch.tensor(0.5))
    assert [tuple(t.shape) for t in gathered["parts"]] == [(2,), (3, 1)]


def test_to_tensorrt_is_refused_with_lightnings_words_and_the_way_to_do_it(monkeypatch):
    module = LinearRegression()
    # torch_tensorrt is not installed here: Lightning's ModuleNotFoundError, in its words, then how.
    with pytest.raises(ModuleNotFoundError, match=r"`LinearRegression.to_tensorrt` requires `torch_tensorrt` to be "
                                                  r"installed\. .*torch_tensorrt.compile\(module.eval\(\)"):
        module.to_tensorrt("model.trt")
    # Installed, Cadence still does not export: the same way, never a silent no-op.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_tensorrt" else None)
    with pytest.raises(NotImplementedError, match=r"to_tensorrt` is Lightning's: call torch_tensorrt.compile"):
        module.to_tensorrt("model.trt", input_sample=torch.randn(1, 4))
