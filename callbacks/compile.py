"""torch.compile for the whole model or per block, in place, with an eager fallback.

Where it runs: in ``configure_model``, after the model moved to its device and before the strategy
wraps it (DDP), as PyTorch's compile docs advise for DDP (``module.compile()`` on the inner module,
then the wrap). Under DDP, dynamo's DDP optimizer still splits the compiled graph at the gradient
buckets, so the all-reduce overlaps backward.

How: each target's ``forward`` becomes ``torch.compile(<its forward function>)`` in place
(``callbacks/forwards.py``), so state_dict keys keep no ``_orig_mod.`` prefix and a checkpoint
loads into the plain model. ``module.compile()`` is not used: in torch 2.13 it traces nothing for a
module whose forward lives in ``torch.nn`` (``nn.Linear``, ``nn.Sequential``, any stock block) and
silently runs eager (pytorch/pytorch#150915); compiling the forward function does trace it.

CUDA graphs (``mode="reduce-overhead"`` or ``"max-autotune"`` on a GPU) replay recorded kernels
into memory they own, which the next replay overwrites, and must not first be recorded under
``torch.inference_mode`` (pytorch/pytorch#135892: the training graphs recorded after it fail).
So in those modes an evaluation forward (validation, its sanity check, test, predict) runs the
compiled code under ``torch.no_grad`` instead, on copies of inputs made under inference mode, and
hands back copies of its outputs, which stay valid when predict keeps them across batches; each
training batch marks a new step for the graphs (``torch.compiler.cudagraph_mark_step_begin``).
Under DDP or FSDP those modes are refused (pytorch/pytorch#140395: max-autotune never finishes
compiling there; #113809: CUDA graph trees fail with DDP's reducer).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from callbacks.base import Callback
from callbacks.forwards import ForwardFunction, restore_forward, wrap_forward
from strategies.selection import describe_children, select_submodules
from strategies.transfer import apply_to_tensors
from callbacks.console import MisconfigurationException, warn

if TYPE_CHECKING:
    from trainer import Trainer, TrainingModule

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The modes that record CUDA graphs (inductor's ``triton.cudagraphs`` option does too).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class Compile(Callback):
    """Compile the model's forward, or each selected block's (regional compilation), with torch.compile.

    Args:
        mode, fullgraph, dynamic, backend, **options: as ``torch.compile``. ``fullgraph=True``
            makes a graph break an error instead of a split into several graphs. ``options`` are
            inductor options (``torch._inductor.list_options()``); give ``mode`` or them, not both.
        modules: None compiles the model's own ``forward`` (what ``self(x)`` runs; ``training_step``
            around it, and the loss, stay eager). A class, tuple of classes, list of names or
            predicate (as ``GradientCheckpointing``) compiles each selected block on its own:
            compile time then grows with one block, not with the depth, since identical blocks
            share the compiled code.

    The first training step's time (mostly compiling the forward and backward) is printed once on
    rank zero; the performance report keeps the compile time apart from the steady state. Where
    compile is unavailable (an unsupported Python or platform) or fails to build (no C++ compiler
    for inductor, a backend error), one warning on rank zero and the model runs eagerly; a run
    never fails halfway for it. The backward is compiled together with the forward,
    so a failure to build it surfaces there too, not in the middle of ``loss.backward()``.

    Example::

        Trainer(callbacks=[Compile()])                                   # the whole forward
        Trainer(callbacks=[Compile(modules=Block, mode="max-autotune")])  # each Block
    """

    def __init__(self, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
                 backend: Any = "inductor", modules: Any = None, **options: Any) -> None:
        if mode not in MODES:
            raise MisconfigurationException(f"Compile(mode={mode!r}): use one of {MODES}.")
        if mode is not None and options:
            raise MisconfigurationException(
                f"Compile(mode={mode!r}, {', '.join(options)}=...): torch.compile takes a mode or "
                "inductor options, not both. Drop one.")
        if not (isinstance(backend, str) or callable(backend)):
            raise MisconfigurationException(
                f"Compile(backend={backend!r}): use a backend name ('inductor', 'eager', "
                "'aot_eager', ...) or a callable backend.")
        if (mode is not None or options) and backend != "inductor":
            raise MisconfigurationException(
                f"Compile(backend={backend!r}) with a mode or options: those are inductor's; "
                "use backend='inductor' or drop them.")
        self.mode, self.fullgraph, self.dynamic, self.backend, self.modules = mode, fullgraph, dynamic, backend, modules
        self.options = options
        # These replay CUDA graphs, which overwrite a step's outputs at the next (trainer/guards.py).
        self.may_replay_graphs = mode in ("reduce-overhead", "max-autotune") or bool(options.get("triton.cudagraphs"))
        self.failed: BaseException | None = None  # the build error after which the model runs eagerly
        self.first_step_seconds: float | None = None
        self._targets: list[tuple[str, nn.Module]] = []
        self._rank_zero = True
        self._device: torch.device | None = None
        self._step_started: float | None = None
        self._saved_lazy_backward: bool | None = None
        self.replays_cuda_graphs = False  # decided at setup: a CUDA-graph mode on a GPU
        self._compile_seconds = (0.0, 0.0, 0.0)  # at setup: dynamo's total; in validation; at validation start

    # --- setup ---------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._rank_zero = trainer.is_global_zero
        self._device = trainer.strategy.device
        self._step_started = None
        self.first_step_seconds = None
        self.replays_cuda_graphs = replays_cuda_graphs(self.mode, self.options, self._device, trainer.world_size)
        self._compile_seconds = (compile_seconds(), 0.0, 0.0)

    def configure_model(self, model: nn.Module) -> nn.Module:
        import torch._dynamo  # here, not at import: importing Cadence stays cheap

        if self.failed is not None:  # it failed to build in an earlier stage: stay eager
            return model
        if not torch._dynamo.is_dynamo_supported():
            self._fall_back(RuntimeError(f"torch.compile does not support Python {sys.version.split()[0]} "
                                         f"on {sys.platform} in torch {torch.__version__}"))
            return model
        if self.modules is None:
            if "forward" not in model.__dict__ and type(model).forward is nn.Module.forward:
                raise MisconfigurationException(
                    f"Compile() compiles {type(model).__name__}.forward, which it does not define (its "
                    "training_step calls submodules directly). Define forward, or compile the submodules: "
                    f"Compile(modules=[...]). {describe_children(model)}"
                )
            self._targets = [("the model", model)]
        else:
            self._targets = select_submodules(model, self.modules, "Compile(modules=...)")
        # Build the backward when the forward compiles (by default AOTAutograd waits for the first
        # backward), so a failure to build it is caught in forward and falls back to eager.
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "force_non_lazy_backward_lowering"):  # not in older torch
            self._saved_lazy_backward = functorch_config.force_non_lazy_backward_lowering
            functorch_config.force_non_lazy_backward_lowering = True
        for name, target in self._targets:
            wrap_forward(target, lambda forward, name=name: self._compiled(forward, name))
        return model

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        for _, target in self._targets:
            restore_forward(target)
        self._targets = []
        if self._saved_lazy_backward is not None:
            import torch._functorch.config as functorch_config

            functorch_config.force_non_lazy_backward_lowering = self._saved_lazy_backward
            self._saved_lazy_backward = None

    # --- the compiled forward --------------------------------------------------------------
    def _compiled(self, forward: ForwardFunction, name: str) -> ForwardFunction:
        from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, Unsupported

        compiled = torch.compile(forward, fullgraph=self.fullgraph, dynamic=self.dynamic, backend=self.backend,
                                 mode=self.mode, options=self.options or None)

        def compiled_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.failed is not None:
                return forward(module, *args, **kwargs)
            try:
                if self.replays_cuda_graphs and not torch.is_grad_enabled():  # evaluation
                    return evaluate_replaying(compiled, module, args, kwargs)
                return compiled(module, *args, **kwargs)
            except (BackendCompilerFailed, InternalTorchDynamoError) as error:
                self._fall_back(error)
                return forward(module, *args, **kwargs)
            except Unsupported as error:  # with fullgraph=True (without it, dynamo splits the graph there)
                if not self.fullgraph:
                    raise
                raise RuntimeError(
                    f"Compile(fullgraph=True): torch.compile cannot trace {name} ({type(module).__name__}) as one "
                    f"graph: {str(error).splitlines()[0]}. Remove the graph break (a print, .item(), data-dependent "
                    "Python control flow), or use Compile(fullgraph=False) to compile around it."
                ) from error

        return compiled_forward

    def _fall_back(self, error: BaseException) -> None:
        warned, self.failed = self.failed is not None, error
        if self._rank_zero and not warned:
            cause = getattr(error, "inner_exception", None) or error  # a backend's own error, inside dynamo's
            first_line = (str(cause).strip().splitlines() or [""])[0]
            warn(f"Compile: torch.compile is unavailable or failed to build ({type(cause).__name__}: "
                 f"{first_line}); the model runs eagerly (uncompiled). Training continues.")

    # --- steps, and the first one's time -----------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        if self.replays_cuda_graphs:  # the last batch's graph outputs are dead: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        if self.first_step_seconds is None and self._step_started is None:
            self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.first_step_seconds is not None or self._step_started is None:
            return
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # once: the step's kernels are part of its time
        self.first_step_seconds = time.perf_counter() - self._step_started
        if self._rank_zero and self.failed is None and self._targets:
            what = "the model's forward" if self.modules is None else f"{len(self._targets)} block(s)"
            print(f"Compile: the first training step took {self.first_step_seconds:.1f} s, compiling {what} "
                  "(forward and backward); later steps reuse the compiled code.", file=sys.stderr)

    # --- compile time, for the performance report ------------------------------------------
    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        total, in_validation, _ = self._compile_seconds
        self._compile_seconds = (total, in_validation, compile_seconds())

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        total, in_validation, started = self._compile_seconds
        self._compile_seconds = (total, in_validation + max(0.0, compile_seconds() - started), started)

    def performance_facts(self) -> dict[str, Any]:
        if self.failed is not None or not self._targets:
            return {}
        at_setup, in_validation, _ = self._compile_seconds
        total = max(0.0, compile_seconds() - at_setup)
        return {"compiled": True, "compile_seconds": {"training": max(0.0, total - in_validation),
                                                      "validation": in_validation}}


def compile_seconds() -> float:
    """Seconds torch.compile has spent building code in this process, as dynamo counts them (0.0
    where this torch keeps no count); ``torch._dynamo.reset()`` starts it again."""
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:
        return 0.0
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def replays_cuda_graphs(mode: str | None, options: dict[str, Any], device: torch.device, world_size: int) -> bool:
    """True when the compiled code will record and replay CUDA graphs: a CUDA-graph mode (or
    inductor's ``triton.cudagraphs`` option) on a GPU. Under several processes that is an error."""
    wanted = mode in CUDA_GRAPH_MODES or bool(options.get("triton.cudagraphs"))
    if not wanted or device.type != "cuda":
        return False
    if world_size > 1:
        what = f"mode={mode!r}" if mode in CUDA_GRAPH_MODES else "options triton.cudagraphs=True"
        raise MisconfigurationException(
            f"Compile({what}) records CUDA graphs, which fail under DDP and FSDP ({world_size} processes here): "
            "max-autotune never finishes compiling there (pytorch/pytorch#140395) and CUDA graph trees break "
            "with DDP's gradient reducer (pytorch/pytorch#113809). Use Compile() or "
            "Compile(mode='max-autotune-no-cudagraphs')."
        )
    return True


def evaluate_replaying(compiled: ForwardFunction, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """An evaluation forward through code that replays CUDA graphs: under ``no_grad`` outside
    ``inference_mode`` (pytorch/pytorch#135892), on normal copies of inputs made under inference
    mode, returning copies of the outputs (the next replay overwrites the graph's own)."""

    def normal(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if tensor.is_inference() else tensor

    with torch.inference_mode(False), torch.no_grad():
        args, kwargs = apply_to_tensors((args, kwargs), normal)
        return apply_to_tensors(compiled(module, *args, **kwargs), torch.Tensor.clone)
