"""Shared test fixtures: a quiet Trainer factory and a tiny regression data set.

Kept small on purpose: a test file states the module it trains itself, so it reads on its own
(tests/linear_regression.py holds the one most of them share, by a name that says what it is).
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, TensorDataset

import processes
from callbacks import Checkpoint
from linear_regression import regression_samples
from trainer import Trainer

#: How a test fails when a DDP worker died of an abort in native code: "terminate called without
#: an active exception" from a gloo worker, seen three times in some dozens of full runs on 2
#: loaded cores and never reproduced on purpose. Workers now print every thread's Python stack
#: when it happens, so the next one says where.
NATIVE_CRASH = r"terminated with signal SIGABRT\)\. It crashed in native code"


#: Test processes for the whole suite: this machine's two cores. The multi-process tests leave a
#: core idle while their workers import torch, rendezvous or wait out a timeout; a second process
#: running other files fills it.
SUITE_PROCESSES = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # The whole suite (`python -m pytest`, as the README and .ci/run give it) runs in SUITE_PROCESSES
    # processes when pytest-xdist is installed (the "test" extra), each test file whole in one of
    # them, so that a module-scoped fixture (a spawned run several tests share) runs once. A run of
    # chosen files, or with -n given, is left as asked; -p no:xdist runs the suite in one process.
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")  # xdist's own test processes
            or config.option.numprocesses is not None or config.option.collectonly):
        return
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and len(os.sched_getaffinity(0)) > 1:
        config.option.numprocesses = SUITE_PROCESSES
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False  # files go out in the order pytest_collection_modifyitems gives


#: The files that take longest (their workers, torchrun jobs and waits; measured with the suite in
#: two processes), longest first. They start first, so that the two processes end together: one
#: of them last, behind many short files, would finish alone. Every other file follows.
LONGEST_FILES = ("test_resume.py", "test_ddp.py", "test_preemption.py", "test_examples.py", "test_fsdp.py",
                 "test_compile.py", "test_speed_ddp.py", "test_async_checkpoint.py", "test_ddp_spawn_generator.py",
                 "test_early_stopping.py", "test_microbatch.py")


def pytest_configure(config):
    # Spawned DDP and FSDP workers start from a server that imported torch once (tests/processes.py):
    # each would otherwise import it again, about 4.5 s of CPU, some 40 times in the suite.
    if os.environ.get(processes.REAL_SPAWN) != "1":
        torch.multiprocessing.start_processes = processes.preloaded_start_processes(torch.multiprocessing.start_processes)


def pytest_collection_modifyitems(items):
    first = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order
    # Such a test runs once more; any other failure, or the same crash twice, fails it.
    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[NATIVE_CRASH]))


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(**kwargs)``: a CPU Trainer that writes only under ``tmp_path`` and prints
    no bars or performance report; loggers and checkpoints are off unless the test turns them on."""

    def make(**kwargs) -> Trainer:
        kwargs.setdefault("strategy", "cpu")
        kwargs.setdefault("default_root_dir", tmp_path)
        kwargs.setdefault("enable_progress_bar", False)
        given = kwargs.get("callbacks") or []  # a ModelCheckpoint given needs enable_checkpointing on, as in Lightning
        kwargs.setdefault("enable_checkpointing", any(isinstance(c, Checkpoint) for c in
                                                      (given if isinstance(given, (list, tuple)) else [given])))
        kwargs.setdefault("logger", False)
        kwargs.setdefault("report", False)
        return Trainer(**kwargs)

    return make


@pytest.fixture
def regression_data():
    """64 samples of ``y = x @ w`` with 4 inputs and 2 outputs (a learnable problem)."""
    return TensorDataset(*regression_samples(64))


@pytest.fixture
def regression_loader(regression_data):
    """``regression_data`` in 8 batches of 8, in a fixed order."""
    return DataLoader(regression_data, batch_size=8)


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend this machine has two CUDA devices (the queries only; nothing runs on them)."""
    properties = SimpleNamespace(name="NVIDIA Test GPU", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)


@pytest.fixture(scope="session")
def resumable_reference(tmp_path_factory):
    """The final weights of tests/run_resumable.py's run, uninterrupted: what every run of it that
    was killed or stopped, then resumed, must end with (tests/test_resume.py, test_preemption.py)."""
    import run_resumable

    return run_resumable.train(tmp_path_factory.mktemp("uninterrupted")).state_dict()


@pytest.fixture(scope="module", autouse=True)
def collect_garbage_after_each_file():
    """What a test file left in reference cycles (a failed fit's traceback holding a process group
    or a store, whose C++ threads must be joined where they run) is destroyed here, in this
    process, before another file forks DataLoader workers: collected in a forked child, such an
    object aborts it ("DataLoader worker ... killed by signal: Aborted", seen once with the suite
    in two processes, where files meet in another order)."""
    yield
    gc.collect()
