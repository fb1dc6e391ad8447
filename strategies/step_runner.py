"""How DistributedDataParallel sees the training step, in automatic and manual optimization.

DistributedDataParallel readies its gradient all-reduce in its forward, after the module ran: so
the module it wraps is :class:`TrainingStepRunner`, whose forward is the user's ``training_step``.
In manual optimization the backwards run inside that forward (``manual_backward``), before the
all-reduce is ready: :func:`prepare_manual_backward` does DistributedDataParallel's preparation
before each one, and the runner's ``end_manual_step`` (``DDP._end_manual_step``) stops it from
preparing another after the forward, for a backward that never comes (the next step's forward
would fail). Both reach into DistributedDataParallel as its own forward does. When its reducer
finds parameters that no loss reached, :func:`with_cadence_advice` adds the Cadence way to its error.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TrainingStepRunner(nn.Module):
    """Lets DistributedDataParallel see ``training_step`` as its forward, so that it prepares the
    gradient all-reduce for whatever the step computes. Holds the user's module as ``module``.

    Args:
        module: the user's module.
        end_manual_step: called after a manual-optimization step's ``training_step`` returns;
            None in automatic optimization.
    """

    def __init__(self, module: nn.Module, end_manual_step: Callable[[], None] | None) -> None:
        super().__init__()
        self.module = module
        self.end_manual_step = end_manual_step

    def forward(self, batch: Any, batch_idx: int) -> Any:
        outputs = self.module.training_step(batch, batch_idx)
        if self.end_manual_step is not None:
            self.end_manual_step()
        return outputs


def prepare_manual_backward(model: DistributedDataParallel, loss: torch.Tensor) -> None:
    """What DistributedDataParallel's forward does after the module ran, for a backward run
    inside it: ready the all-reduce (rebuilding the buckets first, as its next forward would)."""
    if not (torch.is_grad_enabled() and model.require_backward_grad_sync):  # no_sync(): nothing to reduce
        return
    model.require_forward_param_sync = True
    model.reducer._rebuild_buckets()
    unused_search = model.find_unused_parameters and not model.static_graph
    model.reducer.prepare_for_backward([loss] if unused_search else [])


def with_cadence_advice(error: RuntimeError) -> RuntimeError:
    """DistributedDataParallel's error for parameters no loss reached, with the Cadence way to pass
    ``find_unused_parameters=True``: torch's advice names its own constructor, which Cadence calls."""
    return RuntimeError(
        f"{error}\nIn Cadence, pass Trainer(strategy=\"ddp_find_unused_parameters_true\") or "
        "strategies.DDP(find_unused_parameters=True), or set requires_grad=False on parameters that "
        "never take part in the loss."
    )
