"""Compile: torch.compile in place, for the whole forward or per block, proven by counting frames.

A counting backend (``GraphCounter``) stands in for inductor where only *whether* code was compiled
matters: it counts the frames dynamo compiled and how often their graphs ran, and runs them as
they are. One test uses the default inductor backend, on a tiny model (compiling is slow on 2 cores).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks import Compile, ModelCheckpoint, PerformanceReport
from linear_regression import LinearRegression
from strategies import Strategy
from trainer import Trainer, TrainingModule


class GraphCounter:
    """A torch.compile backend that runs each graph as traced, counting compiled frames and runs."""

    def __init__(self) -> None:
        self.frames = 0
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> object:
        self.frames += 1

        def run(*args):
            self.runs += 1
            return graph.forward(*args)

        return run


class Stack(TrainingModule):
    """Stock blocks only: nn.Linear and nn.Sequential, whose forwards live in torch.nn."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_whole_forward_is_compiled_in_place_and_its_checkpoint_loads_into_a_plain_model(
        make_trainer, regression_loader, tmp_path):
    counter, module = GraphCounter(), Stack()
    keys = list(module.state_dict())
    trainer = make_trainer(max_epochs=1, callbacks=[Compile(backend=counter), ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(module, regression_loader)
    assert counter.frames == 1  # one graph through the stock blocks' code, which module.compile() would skip
    assert counter.runs == 8  # every training step ran it
    assert list(module.state_dict()) == keys  # no _orig_mod. prefix
    assert "forward" not in module.__dict__  # the plain forward is back after the stage

    plain = Stack.load_from_checkpoint(tmp_path / "last.ckpt")
    for name, value in plain.state_dict().items():
        assert torch.equal(value, module.state_dict()[name]), name


class Tower(Stack):
    """Four identical stock blocks between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        hidden = self.body[0](x)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden)


def test_regional_compilation_compiles_a_stock_block_once_and_runs_it_for_every_identical_block(
        make_trainer, regression_loader):
    counter, module = GraphCounter(), Tower()
    compile_ = Compile(modules=lambda name, block: name.startswith("blocks."), backend=counter)
    make_trainer(max_epochs=1, callbacks=[compile_]).fit(module, regression_loader)
    assert counter.frames == 1  # one compile serves the four blocks: compile time does not grow with depth
    assert counter.runs == 4 * 8  # and each block ran the compiled code at each of the 8 steps


def test_inductor_gives_eager_outputs_and_gradients(make_trainer, regression_loader):
    eager, compiled = Stack(), Stack()
    make_trainer(max_steps=3).fit(eager, regression_loader)
    trainer = make_trainer(max_steps=3, log_every_n_steps=1, callbacks=[Compile()])  # default backend: inductor
    trainer.fit(compiled, regression_loader)
    for (name, value), expected in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert "train/loss" in trainer.logged_metrics  # training_step and self.log work as before


def failing_backend(graph, example_inputs):
    raise RuntimeError("no C++ compiler found")


def backend_failing_in_backward():
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=lambda graph, inputs: graph, bw_compiler=failing_backend)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_compile_that_fails_to_build_warns_once_and_trains_eagerly(make_trainer, regression_loader, where, capsys):
    backend = failing_backend if where == "forward" else backend_failing_in_backward()
    eager, module, compile_ = Stack(), Stack(), Compile(modules=nn.Linear, backend=backend)
    make_trainer(max_epochs=1).fit(eager, regression_loader)
    with pytest.warns(UserWarning, match=r"Compile: torch.compile is unavailable or failed to build \(RuntimeError: "
                                         r"no C\+\+ compiler found\); the model runs eagerly") as caught:
        make_trainer(max_epochs=1, callbacks=[compile_]).fit(module, regression_loader)
    assert len([w for w in caught if "Compile:" in str(w.message)]) == 1
    for name, value in module.state_dict().items():
        assert torch.equal(value, eager.state_dict()[name]), name
    assert "first training step took" not in capsys.readouterr().err


def test_where_torch_compile_is_unsupported_the_model_runs_eagerly_with_one_warning(
        make_trainer, regression_loader, monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)  # as on an unsupported Python
    counter = GraphCounter()
    with pytest.warns(UserWarning, match="torch.compile does not support Python .*runs eagerly"):
        make_trainer(max_epochs=1, callbacks=[Compile(backend=counter)]).fit(Stack(), regression_loader)
    assert counter.frames == 0


class BreaksTheGraph(Stack):
    def forward(self, x):
        hidden = self.body(x)
        if hidden.sum() > 0:  # data-dependent Python control flow: a graph break
            hidden = hidden * 2
        return self.head(hidden)


def test_fullgraph_makes_a_graph_break_an_error(make_trainer, regression_loader):
    with pytest.raises(RuntimeError, match=r"Compile\(fullgraph=True\): torch.compile cannot trace the model "
                                           r"\(BreaksTheGraph\) as one graph.*Compile\(fullgraph=False\)"):
        make_trainer(max_steps=1, callbacks=[Compile(fullgraph=True, backend="eager")]).fit(BreaksTheGraph(), regression_loader)
    module = BreaksTheGraph()  # without fullgraph the same model trains, compiled in pieces
    make_trainer(max_steps=1, callbacks=[Compile(backend="eager")]).fit(module, regression_loader)


def test_the_first_compiled_step_time_is_reported_once(make_trainer, regression_loader, capsys):
    make_trainer(max_epochs=2, callbacks=[Compile(backend=GraphCounter())]).fit(Stack(), regression_loader)
    reports = [line for line in capsys.readouterr().err.splitlines() if "first training step took" in line]
    assert len(reports) == 1 and "compiling the model's forward (forward and backward)" in reports[0]


class NoForward(LinearRegression):
    """Trains its ``layer`` directly in training_step and defines no forward."""


def test_compiling_a_module_without_forward_is_an_error_naming_its_submodules(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"Compile\(\) compiles NoForward.forward, which it does not define.*"
                                         r"Compile\(modules=\[...\]\).*children are: layer \(Linear\)"):
        make_trainer(max_steps=1, callbacks=[Compile()]).fit(NoForward(), regression_loader)


def test_a_selection_matching_nothing_is_an_error(make_trainer, regression_loader):
    with pytest.raises(ValueError, match=r"Compile\(modules=...\) selects no submodule of Stack.*body \(Sequential\)"):
        make_trainer(max_steps=1, callbacks=[Compile(modules=nn.Conv2d)]).fit(Stack(), regression_loader)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"mode": "fastest"}, r"Compile\(mode='fastest'\): use one of \(None, 'default', 'reduce-overhead'"),
    ({"mode": "max-autotune", "max_autotune": True}, r"takes a mode or inductor options, not both"),
    ({"mode": "max-autotune", "backend": "eager"}, r"Compile\(backend='eager'\) with a mode or options: those are inductor's"),
    ({"backend": 3}, r"Compile\(backend=3\): use a backend name"),
])
def test_compile_arguments_are_checked(arguments, message):
    with pytest.raises(ValueError, match=message):
        Compile(**arguments)


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights(make_trainer, regression_loader):
    class CopiesMidRun(Stack):
        def on_train_end(self):
            self.copy = copy.deepcopy(self)
            with torch.no_grad():
                for parameter in self.copy.parameters():
                    parameter.zero_()
            self.copy_output = self.copy(torch.ones(1, 4))

    module, compile_ = CopiesMidRun(), Compile(modules=nn.Linear, backend=GraphCounter())
    make_trainer(max_steps=2, callbacks=[compile_]).fit(module, regression_loader)
    assert compile_.failed is None
    assert torch.equal(module.copy_output, torch.zeros(1, 2))  # the copy's (zeroed) weights, not the original's


# --- CUDA-graph modes ----------------------------------------------------------------------------
class ReplaysAGraph:
    """Stands in for compiled code that replays a CUDA graph (this machine has no GPU): each call
    writes its result into the same output buffer, as a replay does, and notes the autograd mode it
    ran in and whether its input was an inference tensor."""

    def __init__(self) -> None:
        self.output = torch.zeros(2)
        self.calls: list[tuple[bool, bool, bool]] = []

    def __call__(self, module, x):
        self.calls.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), x.is_inference()))
        self.output.copy_(x.sum(0))
        return {"sum": self.output}


def test_an_evaluation_forward_replaying_cuda_graphs_runs_outside_inference_mode_and_keeps_its_outputs():
    from callbacks.compile import evaluate_replaying

    replay, kept = ReplaysAGraph(), []
    with torch.inference_mode():  # the evaluation loop's context; its batches are inference tensors
        for value in (1.0, 2.0, 3.0):
            kept.append(evaluate_replaying(replay, None, (torch.full((2, 2), value),), {}))
    assert replay.calls == [(False, False, False)] * 3  # no_grad, outside inference mode (pytorch#135892)
    assert [outputs["sum"].tolist() for outputs in kept] == [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]  # predict keeps all


class TwoGpuProcesses(Strategy):
    """A strategy that trains on cuda:0 with two processes, as far as callbacks ask (no GPU here)."""

    device = torch.device("cuda", 0)
    world_size = 2


@pytest.mark.parametrize(("arguments", "refused"), [
    ({"mode": "reduce-overhead"}, "mode='reduce-overhead'"),
    ({"mode": "max-autotune"}, "mode='max-autotune'"),
    ({"triton.cudagraphs": True}, "options triton.cudagraphs=True"),
])
def test_cuda_graph_modes_are_refused_under_several_processes_and_kept_off_the_cpu(arguments, refused):
    module = Stack()
    several = Trainer(strategy=TwoGpuProcesses(), logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=rf"Compile\({re.escape(refused)}\) records CUDA graphs, which fail under DDP "
                                         r"and FSDP \(2 processes here\).*pytorch/pytorch#140395.*"
                                         r"Compile\(mode='max-autotune-no-cudagraphs'\)"):
        Compile(**arguments).setup(several, module, "fit")
    Compile(mode="max-autotune-no-cudagraphs").setup(several, module, "fit")
    on_the_cpu = Compile(**arguments)
    on_the_cpu.setup(Trainer(strategy="cpu", logger=False, enable_progress_bar=False), module, "fit")
    assert not on_the_cpu.replays_cuda_graphs  # inductor records no graphs for the CPU


class Validates(Stack):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", F.mse_loss(self(batch[0]), batch[1]))


def test_the_compile_time_of_training_and_of_validation_is_kept_apart_for_the_report(make_trainer, regression_loader):
    report = PerformanceReport()
    make_trainer(max_epochs=1, callbacks=[Compile(backend="eager"), report], limit_val_batches=2).fit(
        Validates(), regression_loader, regression_loader)
    facts = report.facts
    assert facts.compiled and facts.compile_validation > 0 and facts.compile_training > 0
    assert facts.compile_validation < facts.validation  # the sanity check and validation compiled the eval graph
    assert f"one-time compiling (torch.compile): {facts.compile_training:.2f} s in training" in report.text


def test_fit_of_a_torch_compiled_module_names_the_cadence_way(make_trainer, regression_loader):
    with pytest.raises(TypeError, match=r"got torch.compile\(model\) \(an OptimizedModule\). Pass the module itself "
                                        r"and add callbacks.Compile"):
        make_trainer(max_epochs=1).fit(torch.compile(LinearRegression()), regression_loader)
