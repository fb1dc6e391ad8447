"""Sharded checkpoint directories (FSDP): each rank writes and reads only its own shards.

A sharded checkpoint is a directory with the same content as a one-file checkpoint::

    epoch=3-step=400.ckpt/
        state.pt            everything but the weights and optimizer states: loop counters, RNG
                            states of every rank, LR schedulers, callbacks, hyperparameters
                            (written by rank zero; read with torch.load(weights_only=True))
        .metadata           torch.distributed.checkpoint's index of the shards (rank zero)
        __0_0.distcp ...    each rank's shards of the weights ("state_dict") and of the optimizer
                            states ("optimizer_states", keyed by parameter name)

``torch.distributed.checkpoint`` (DCP) writes and reads the shards; a directory written by N
ranks loads on any number (DCP reshards), in one process too (:func:`read_whole_shards`, what
:func:`strategies.checkpoint.read_checkpoint` reads by default). DCP's own reader
unpickles ``.metadata`` and non-tensor values with plain ``pickle``; here the index goes through
an unpickler that builds only DCP's metadata classes, and values through ``weights_only=True``, so
reading a checkpoint never runs code from it. Every failure names the checkpoint directory.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from callbacks.console import MisconfigurationException
from strategies.checkpoint.files import corrupted, remove_checkpoint, replace_atomic, write_file

#: The file of a sharded checkpoint that holds its plain data.
STATE_FILE = "state.pt"
#: DCP's index of the shards, written last, by rank zero.
METADATA_FILE = ".metadata"
#: The parts of the training state stored as shards; the rest goes into STATE_FILE.
SHARDED_KEYS = ("state_dict", "optimizer_states")


def is_sharded_checkpoint(path: Path) -> bool:
    """True for a directory that looks like a sharded checkpoint (holds either of its two files)."""
    return path.is_dir() and ((path / STATE_FILE).exists() or (path / METADATA_FILE).exists())


def check_complete(path: Path) -> None:
    """Raise a ValueError naming ``path`` unless it holds a whole sharded checkpoint: the state
    file, the index, and every shard file at least as long as the index says. Cheap (file sizes
    only), so it runs before any process starts."""
    missing = [name for name in (STATE_FILE, METADATA_FILE) if not (path / name).is_file()]
    if missing:
        raise MisconfigurationException(
            f"Checkpoint {path} is incomplete: it has no {' and no '.join(missing)}. A sharded checkpoint is "
            "renamed into place only after every rank wrote its shards, so this directory was copied or "
            "edited partially. Use an earlier checkpoint, or copy the whole directory again."
        )
    for entry in read_metadata(path).storage_data.values():
        shard = path / entry.relative_path
        needed = entry.offset + entry.length
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < needed:
            found = "is missing" if size is None else f"has {size} bytes where the index needs {needed}"
            raise MisconfigurationException(
                f"Checkpoint {path} is incomplete: its shard {entry.relative_path} {found}. Use an earlier "
                "checkpoint, or copy the whole directory again."
            )


# =============================================================================================
# Reading safely
# =============================================================================================
class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and the few torch and pathlib types inside them; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (
                module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo"):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the index refers to {module}.{name}, which is not part of a checkpoint index")


def read_metadata(path: Path) -> Any:
    """The DCP index of the checkpoint directory ``path``; a ValueError naming it when unreadable."""
    try:
        with open(path / METADATA_FILE, "rb") as file:
            return _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as error:
        if "not part of a checkpoint index" in str(error):
            raise MisconfigurationException(
                f"Refusing to load checkpoint {path}: {error}, which would run code when loaded. "
                "Cadence loads only tensors and plain data.") from error
        raise corrupted(path, error) from error
    except (OSError, EOFError, AttributeError, ValueError, TypeError, IndexError) as error:
        raise corrupted(path, error) from error


def _storage_classes() -> tuple[type, type]:
    """DCP's reader and load planner, made safe: the index and non-tensor values load without
    running code. Built on first use: importing torch.distributed.checkpoint costs time."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                _set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafeLoadPlanner


def read_shards(template: dict[str, Any], path: Path, process_group: Any = None, no_dist: bool = False) -> None:
    """Fill the tensors of ``template`` (nested like the saved state) from the checkpoint ``path``,
    each rank reading the parts of the shards its tensors cover. A collective unless ``no_dist``.

    Raises:
        ValueError: a shard is truncated or corrupted, or the checkpoint lacks a key of ``template``.
    """
    import torch.distributed.checkpoint as dcp

    reader_class, planner_class = _storage_classes()
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=reader_class(path), planner=planner_class(),
                     process_group=process_group, no_dist=no_dist)
    except dcp.api.CheckpointException as error:  # a BaseException that names no path: say which checkpoint
        raise _read_error(path, _first_failure(error)) from None
    except (RuntimeError, ValueError, OSError, EOFError, KeyError, pickle.UnpicklingError) as error:
        raise _read_error(path, error) from error


def _first_failure(error: Any) -> BaseException:
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        return failure[0] if isinstance(failure, tuple) else failure
    return error


def _read_error(path: Path, error: BaseException) -> ValueError:
    if "Missing key in checkpoint" in str(error):
        key = str(error).strip().splitlines()[0].rpartition(":")[2].strip()
        return ValueError(
            f"Checkpoint {path} does not fit this model and its optimizers: it has no {key}. Resume with the "
            "model and configure_optimizers that wrote it."
        )
    return corrupted(path, error)


# =============================================================================================
# Templates: tensors to read into
# =============================================================================================
def saved_entries(metadata: Any) -> dict[tuple, Any]:
    """``{path in the nested state: its DCP metadata}``, e.g. ``("state_dict", "layer.weight")``."""
    mappings = metadata.planner_data or {}
    return {tuple(mappings.get(key, (key,))): entry for key, entry in metadata.state_dict_metadata.items()}


def template_from_metadata(metadata: Any, tensor_for: Callable[[tuple, Any], Any]) -> dict[str, Any]:
    """The nested state the checkpoint holds, with ``tensor_for(path, entry)`` in place of each
    tensor (what to read into) and None in place of each plain value (read as it is)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    template: dict[str, Any] = {}
    for path, entry in saved_entries(metadata).items():
        value = tensor_for(path, entry) if isinstance(entry, TensorStorageMetadata) else None
        _set_nested(template, path, value)
    return template


def _set_nested(root: dict[str, Any], path: tuple, value: Any) -> None:
    node: Any = root
    for key, following in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(following, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(following, int) else {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def read_whole_shards(path: Path) -> dict[str, Any]:
    """The sharded parts of the checkpoint directory ``path`` (:data:`SHARDED_KEYS`), whole, in this
    process, in the one-file layout: full tensors on the CPU, the optimizer states keyed by
    parameter index as ``optimizer.state_dict()`` has them."""
    template = template_from_metadata(read_metadata(path), lambda _, entry: torch.empty(
        entry.size, dtype=entry.properties.dtype))
    read_shards(template, path, no_dist=True)
    return {"state_dict": template.get("state_dict", {}),
            "optimizer_states": [by_index(optimizer) for optimizer in template.get("optimizer_states", [])]}


# =============================================================================================
# Optimizer states: by parameter index (optimizer.state_dict) or by parameter name (shards)
# =============================================================================================
def by_name(optimizer_state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters named, not numbered: ``names[i]`` is the name of
    parameter ``i`` (in param_groups order). Names survive resharding; indices need the same
    parameter order, which the same model and configure_optimizers give."""
    groups = [dict(group, params=[names[index] for index in group["params"]]) for group in optimizer_state["param_groups"]]
    return {"state": {names[index]: value for index, value in optimizer_state["state"].items()}, "param_groups": groups}


def by_index(optimizer_state: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """The inverse of :func:`by_name`: parameter ``names[i]`` becomes ``i`` (default: parameters
    numbered in the order their groups list them, as ``optimizer.state_dict()`` numbers them)."""
    index_of: dict[str, int] = {name: index for index, name in enumerate(names or ())}
    groups = []
    for group in optimizer_state["param_groups"]:
        numbers = [index_of.setdefault(name, len(index_of)) for name in group["params"]]
        groups.append(dict(group, params=numbers))
    state = {index_of[name]: value for name, value in optimizer_state["state"].items() if name in index_of}
    return {"state": state, "param_groups": groups}


def parameter_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in ``module`` of each parameter ``optimizer`` steps, in param_groups order."""
    names = {id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)}
    found = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise MisconfigurationException(
                    f"{type(optimizer).__name__} steps a parameter of shape {tuple(parameter.shape)} that is not in "
                    f"{type(module).__name__}; checkpoints name optimizer states by parameter name. Build the "
                    "optimizer in configure_optimizers from self.parameters()."
                )
            found.append(names[id(parameter)])
    return found


def write_shards(state: dict[str, Any], directory: Path, process_group: Any = None) -> None:
    """Every rank writes its shards of ``state`` (nested; tensors and plain values) into
    ``directory``; rank zero then writes the index. A collective: it returns on every rank once
    the index is written.

    Raises:
        OSError: some rank could not write (a full disk, a directory other machines cannot see).
    """
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), process_group=process_group)
    except dcp.api.CheckpointException as error:  # a BaseException naming no path
        raise _write_error(error) from None


def _write_error(error: Any) -> OSError:
    failure = _first_failure(error)
    return OSError(getattr(failure, "errno", None), f"{type(failure).__name__}: {failure}")


# =============================================================================================
# Writing in the background (ModelCheckpoint(async_save=True) under FSDP)
# =============================================================================================
def write_shards_in_background(state: dict[str, Any], directory: Path, process_group: Any, stager: Any) -> Future:
    """:func:`write_shards` with ``torch.distributed.checkpoint.async_save``: returns once this
    rank's tensors of ``state`` are copied to the host by ``stager`` (training may change them
    then); DCP's thread writes them, and rank zero the index once every rank wrote. A collective
    in that thread, on ``process_group``: give it a group of its own, so that its collectives
    never interleave with those of training. Wait with :func:`finish_in_background`."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(directory), process_group=process_group,
                          async_stager=stager)


def finish_in_background(written: Future, staging: Path, path: Path, plain: dict[str, Any] | None) -> None:
    """What follows :func:`write_shards_in_background` (in a thread: ``BackgroundWriter``'s): wait
    until every rank's shards and the index are written; then rank zero (the one given ``plain``,
    already a host snapshot) writes the state file and swaps ``staging`` into place at ``path``.
    A checkpoint directory is thus seen only complete: a kill before the swap leaves the previous
    one, and the next write removes the staging directory.

    Raises:
        OSError: naming ``path``, when some rank could not write (the staging directory is removed).
    """
    import torch.distributed.checkpoint as dcp

    try:
        try:
            written.result()
        except dcp.api.CheckpointException as error:
            raise _write_error(error) from None
        if plain is not None:
            write_file(plain, staging / STATE_FILE)
            replace_atomic(staging, path)
    except OSError as error:
        if plain is not None:
            remove_checkpoint(staging)
        previous = f"the previous checkpoint {path} is intact" if path.exists() else f"nothing was written at {path}"
        raise OSError(error.errno, f"Could not write the checkpoint {path} ({error.strerror or error}); {previous}.") from error
