"""Guards of the performance budget that time nothing: what importing loads, and where the loop
turns tensors into Python values.

The benchmarks (``benchmarks/``) measure the budget; these tests keep the two properties it rests
on from regressing: importing Cadence stays cheap, and no training step but a log step makes the
host wait for the device.
"""

from __future__ import annotations

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

from callbacks import Callback, LearningRateMonitor, ModelCheckpoint
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
}}))
"""


def test_importing_trainer_callbacks_and_strategies_loads_no_heavy_module():
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=120)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["added_heavy"] == [], f"importing Cadence loaded {report['added_heavy']}; import them lazily"
    # torch itself may import tqdm (torch.hub does when tqdm is installed); the others never load.
    assert not set(report["loaded_anywhere"]) & {"torch._dynamo", "torch.utils.tensorboard", "tensorboard", "yaml"}


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
    """Records every tensor-to-Python conversion on this thread, with where the loop was."""

    def __init__(self, where: "LoopPosition") -> None:
        super().__init__()
        self.where = where
        self.calls: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS or (name == "to" and _moves_to_cpu(args, kwargs)):
            self.calls.append((name, self.where.position))
        return func(*args, **kwargs)


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


class LoggingRegressor(TrainingModule):
    """Logs every step, per step and per epoch, and never turns a tensor into a number itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.layer(x)
        loss = F.mse_loss(prediction, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/abs_prediction", prediction.abs().mean(), on_step=True, on_epoch=True)
        return loss

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
    )  # plus the default bar, loggers and performance report (two host clock reads a batch)
    monkeypatch.setattr(sys, "stderr", TerminalLikeStream())
    recorder = SyncRecorder(position)
    with recorder:
        trainer.fit(LoggingRegressor(), _loader(10), _loader(2))

    steps_with_syncs = {step for _, (phase, step) in recorder.calls if phase in ("step", "after")}
    during_a_step = [(name, where) for name, where in recorder.calls if where[0] == "step"]
    allowed = {step for step in steps_with_syncs if step % log_every == 0} | position.epoch_last_steps
    assert trainer.global_step == 20
    assert during_a_step == [], f"host syncs inside training steps: {during_a_step}"
    assert steps_with_syncs <= allowed, (
        f"host syncs after steps {sorted(steps_with_syncs - allowed)}, which are neither log steps "
        f"(every {log_every}) nor epoch ends {sorted(position.epoch_last_steps)}: {recorder.calls}"
    )
    # The recorder does see the framework's reads where they belong (not a vacuous pass).
    assert {log_every, 2 * log_every} <= steps_with_syncs
    assert any(phase == "validation" for _, (phase, _) in recorder.calls)
