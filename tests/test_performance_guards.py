"""Guards of the performance budget that time nothing: what importing loads, and where the loop
turns tensors into Python values.

The benchmarks (``benchmarks/``) measure the budget; these tests keep the two properties it rests
on from regressing: importing Cadence stays cheap, and no training step but a log step makes the
host wait for the device.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, TensorDataset

from callbacks import AMP, Callback, LearningRateMonitor, ModelCheckpoint
from strategies import SingleDevice
from strategies.prefetch import prefetch_to_device
from trainer import Trainer, TrainingModule

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------
# Import cost
# --------------------------------------------------------------------------------------------
HEAVY_MODULES = ("torch._dynamo", "torch.utils.tensorboard", "tensorboard", "yaml", "tqdm")

IMPORT_PROBE = f"""
import json, sys
import torch
loaded_by_torch = set(sys.modules)
import trainer, callbacks, strategies
added = set(sys.modules) - loaded_by_torch
heavy = {HEAVY_MODULES!r}
print(json.dumps({{
    "added_heavy": sorted(m for m in added if any(m == h or m.startswith(h + ".") for h in heavy)),
    "loaded_anywhere": [h for h in heavy if h in sys.modules],
    "command_line": sorted(m for m in added if m == "trainer.cli" or m.startswith("trainer.cli.")),
}}))
"""


def test_importing_trainer_callbacks_and_strategies_loads_no_heavy_module_and_not_the_command_line():
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=120)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["added_heavy"] == [], f"importing Cadence loaded {report['added_heavy']}; import them lazily"
    # torch itself may import tqdm (torch.hub does when tqdm is installed); the others never load.
    assert not set(report["loaded_anywhere"]) & {"torch._dynamo", "torch.utils.tensorboard", "tensorboard", "yaml"}
    # The command line (trainer/cli/) is not the loop: only `cadence` and `python -m trainer` load it.
    assert report["command_line"] == [], f"importing Cadence loaded {report['command_line']}"


# --------------------------------------------------------------------------------------------
# Host syncs in the hot loop
# --------------------------------------------------------------------------------------------
SYNCING_METHODS = {"item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu"}


def _moves_to_cpu(args: tuple, kwargs: dict) -> bool:
    """True for ``tensor.to(...)`` calls that name the CPU as the device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, torch.device) and value.type == "cpu":
            return True
        if isinstance(value, str) and value.split(":")[0] == "cpu":
            return True
    return False


class SyncRecorder(TorchFunctionMode):
    """Records every tensor-to-Python conversion on this thread, with where the loop was; those made
    inside ``GradScaler.step`` (its one read of the overflow flag) go to ``scaler_calls`` instead."""

    def __init__(self, where: "LoopPosition") -> None:
        super().__init__()
        self.where = where
        self.calls: list[tuple[str, tuple]] = []
        self.scaler_calls: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS or (name == "to" and _moves_to_cpu(args, kwargs)):
            scaler_method = _grad_scaler_method()
            if scaler_method is None:
                self.calls.append((name, self.where.position))
            else:
                self.scaler_calls.append((scaler_method, name, self.where.position))
        return func(*args, **kwargs)


def _grad_scaler_method() -> str | None:
    """The public GradScaler method on the stack (``"step"``, ``"unscale_"``, ...), or None."""
    frame, found = sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_filename.endswith("grad_scaler.py") and not frame.f_code.co_name.startswith("_"):
            found = frame.f_code.co_name
        frame = frame.f_back
    return found


class LoopPosition(Callback):
    """Where the loop is, from the hooks; placed first so it moves before the other callbacks run.

    ``("step", n)`` from the start of training step n (1-based, = global_step after it) to the end
    of its forward/backward/optimizer step; ``("after", n)`` for what follows it (the callbacks'
    on_train_batch_end, the log step, the epoch end); ``("validation", n)`` once validation starts.
    """

    def __init__(self) -> None:
        self.position: tuple = ("setup", 0)
        self.epoch_last_steps: set[int] = set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.position = ("step", trainer.global_step + 1)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.position = ("after", trainer.global_step)
        if batch_idx + 1 == trainer.num_training_batches:
            self.epoch_last_steps.add(trainer.global_step)

    def on_validation_start(self, trainer, module):
        self.position = ("validation", trainer.global_step)


class DeviceMean:
    """A metric object (torchmetrics' update/compute/reset) whose state stays a tensor."""

    def __init__(self) -> None:
        self.reset()

    def update(self, value: torch.Tensor) -> None:
        self.total, self.count = self.total + value.detach(), self.count + 1

    def compute(self) -> torch.Tensor:
        return self.total / self.count

    def reset(self) -> None:
        self.total, self.count = torch.zeros(()), 0


class LoggingRegressor(TrainingModule):
    """Logs every step, per step and per epoch (a metric object too), implements the hooks around
    backward and zero_grad, and never turns a tensor into a number itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.mean_prediction = DeviceMean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.layer(x)
        loss = F.mse_loss(prediction, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/abs_prediction", prediction.abs().mean(), on_step=True, on_epoch=True)
        self.mean_prediction.update(prediction.mean())
        self.log("train/mean_prediction", self.mean_prediction, on_step=False, on_epoch=True)
        return loss

    def on_before_backward(self, loss):
        self.last_loss = loss.detach()

    def on_after_backward(self):
        self.grad_norm = self.layer.weight.grad.norm()

    def on_before_zero_grad(self, optimizer):
        self.stepped_weight = self.layer.weight.detach().clone()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.layer(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TerminalLikeStream(io.StringIO):
    """stderr as a terminal: the progress bar then draws tqdm bars, its per-step path."""

    def isatty(self) -> bool:
        return True


def _loader(batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 4, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def test_the_framework_turns_no_tensor_into_a_python_value_between_log_steps(tmp_path, monkeypatch):
    log_every = 4
    position = LoopPosition()
    trainer = Trainer(
        max_epochs=2, strategy="cpu", default_root_dir=tmp_path, log_every_n_steps=log_every,
        callbacks=[position, ModelCheckpoint(monitor="val/loss"), LearningRateMonitor()],
        max_time={"hours": 1},  # never reached: its Timer reads the clock after every optimizer step
    )  # plus the default bar, loggers and performance report (two host clock reads a batch)
    monkeypatch.setattr(sys, "stderr", TerminalLikeStream())
    recorder = SyncRecorder(position)
    with recorder:
        trainer.fit(LoggingRegressor(), _loader(10), _loader(2))

    steps_with_syncs = {step for _, (phase, step) in recorder.calls if phase in ("step", "after")}
    during_a_step = [(name, where) for name, where in recorder.calls if where[0] == "step"]
    allowed = {step for step in steps_with_syncs if step % log_every == 0} | position.epoch_last_steps
    assert trainer.global_step == 20 and "train/mean_prediction" in trainer.callback_metrics
    assert during_a_step == [], f"host syncs inside training steps: {during_a_step}"
    assert steps_with_syncs <= allowed, (
        f"host syncs after steps {sorted(steps_with_syncs - allowed)}, which are neither log steps "
        f"(every {log_every}) nor epoch ends {sorted(position.epoch_last_steps)}: {recorder.calls}"
    )
    # The recorder does see the framework's reads where they belong (not a vacuous pass).
    assert {log_every, 2 * log_every} <= steps_with_syncs
    assert any(phase == "validation" for _, (phase, _) in recorder.calls)


def test_float16_amp_adds_no_host_sync_beyond_the_one_read_inside_grad_scaler_step(tmp_path, monkeypatch):
    log_every = 4
    position = LoopPosition()
    trainer = Trainer(
        max_epochs=2, strategy="cpu", default_root_dir=tmp_path, log_every_n_steps=log_every,
        callbacks=[position, AMP("fp16"), ModelCheckpoint(monitor="val/loss")],
    )
    monkeypatch.setattr(sys, "stderr", TerminalLikeStream())
    recorder = SyncRecorder(position)
    with recorder:
        trainer.fit(LoggingRegressor(), _loader(10), _loader(2))

    assert trainer.global_step == 20
    during_a_step = [(name, where) for name, where in recorder.calls if where[0] == "step"]
    assert during_a_step == [], f"host syncs inside training steps besides GradScaler.step's: {during_a_step}"
    # GradScaler.step reads whether a gradient overflowed, once per optimizer step; its other calls
    # here are copies between the CPU and the CPU (device to device on a GPU), which wait for nothing.
    # (Saving a checkpoint reads the scale too, at the epoch ends the other test allows.)
    reads = [(method, name, where) for method, name, where in recorder.scaler_calls if name != "to" and where[0] == "step"]
    assert reads == [("step", "item", ("step", step)) for step in range(1, 21)]
    steps_with_syncs = {step for _, (phase, step) in recorder.calls if phase == "after"}
    allowed = {step for step in steps_with_syncs if step % log_every == 0} | position.epoch_last_steps
    assert steps_with_syncs <= allowed, f"host syncs after steps {sorted(steps_with_syncs - allowed)}"


class _RecordingCopyStream:
    """The CUDA calls of strategies.prefetch.CudaCopyStream, as no-ops (this machine has no GPU)."""

    def copying(self):
        return contextlib.nullcontext()

    def record_copied(self):
        return object()

    def wait_for(self, copied):
        pass

    def used_by_compute(self, tensor):
        pass


def test_the_cuda_prefetcher_turns_no_tensor_into_a_python_value():
    # Its CUDA calls (streams, events, record_stream) never wait for the GPU; what it adds in Python,
    # finding the batch's tensors and moving them, must not read one either.
    position = LoopPosition()
    position.position = ("step", 1)
    batch = {"x": torch.ones(4, 2), "pair": (torch.zeros(4), [torch.ones(1)]), "name": "kept"}
    mover = SingleDevice(torch.device("meta"))
    with SyncRecorder(position) as recorder:
        moved = list(prefetch_to_device(enumerate([batch] * 3), mover.batch_to_device, _RecordingCopyStream()))
    assert len(moved) == 3 and moved[0][1]["x"].device.type == "meta"
    assert recorder.calls == []
