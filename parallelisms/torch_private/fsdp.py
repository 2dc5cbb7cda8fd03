"""FSDP2's per-module parameter groups and their unsharded parameters and gradients.

``fully_shard`` keeps, per unit, an ``FSDPParamGroup`` of ``FSDPParam`` objects; each holds the
sharded DTensor the optimizer sees, and, between all-gather and reshard, the unsharded parameter
autograd writes into. The layout-invariant reduction takes its gradients from there, and the
simulator's memory tracker labels them, and tells FSDP's own ops (which run eagerly around a
compiled block) from the block's. None of it is public API.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.fsdp
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import dtensor

FEATURE = "FSDP's parameter groups (debug.layout_invariant, --simulate)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = ("_get_fsdp_state", "_fsdp_param_group", "_unsharded_param", "_C", "_current_autograd_node")
"""The private names reached here; ``fsdp_params``, ``sharded_param``, ``all_gather_outputs`` and
``unsharded_accumulated_grad`` are public attributes of those private classes."""


def param_group(module: nn.Module) -> Any:
    """FSDP's parameter group of ``module``: None when it is not a unit of its own."""
    return module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None


def group_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of ``module``'s own unit (empty when it has none)."""
    group = param_group(module)
    return list(group.fsdp_params) if group is not None else []


def unsharded_param(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded parameter autograd accumulates into (None before the first all-gather)."""
    return getattr(fsdp_param, "_unsharded_param", None)


def take_unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient FSDP holds for ``fsdp_param``, removed from FSDP's keeping."""
    grad = fsdp_param.unsharded_accumulated_grad
    unsharded = fsdp_param._unsharded_param
    if grad is None:
        grad = unsharded.grad
    fsdp_param.unsharded_accumulated_grad = None
    unsharded.grad = None
    return grad


def unsharded_buffers(fsdp_param: Any) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """What ``fsdp_param`` holds unsharded: ``(parameters and all-gather outputs, gradients)``."""
    unsharded = unsharded_param(fsdp_param)
    params = [unsharded, *getattr(fsdp_param, "all_gather_outputs", [])]
    grads = [getattr(fsdp_param, "unsharded_accumulated_grad", None), unsharded.grad if unsharded is not None else None]
    return params, grads


FSDP_SOURCE = os.path.join(Path(torch.distributed.fsdp.__file__).parent, "")
"""torch's ``fsdp`` package folder, with its trailing separator."""


def called_from_fsdp() -> bool:
    """Whether the running op was called by FSDP's own code (its gathers, casts, reductions and,
    on torch 2.13, its fp32 gradient accumulation), which a compiled block leaves eager: a
    frame of torch's ``fsdp`` package on the Python stack."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename.startswith(FSDP_SOURCE):
            return True
        frame = frame.f_back
    return False


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def autograd_engine_op(func: Any, out: Any) -> bool:
    """Whether autograd's engine runs this op itself, on a gradient a node made: its
    ``AccumulateGrad`` adding it into a leaf's ``.grad``, or its cast of it to the leaf's
    ``grad_dtype`` first (without grad mode, unlike a checkpointed forward recomputed there). No
    compiled graph holds either. torch 2.15's FSDP has autograd run its fp32 accumulation so
    (``grad_dtype``), in C++: no FSDP frame is on the stack."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() == ACCUMULATE_GRAD:
        return node is not None
    cast = func.__name__.split(".")[0] == "_to_copy" and isinstance(out, torch.Tensor)
    if not cast or torch.is_grad_enabled():
        return False
    next_nodes: list[Any] = [n for n, _ in node.next_functions]
    leaves = [n.variable for n in next_nodes if n is not None and n.name() == ACCUMULATE_GRAD]
    return any(
        leaf.grad_dtype == out.dtype != leaf.dtype
        and (dtensor.local_tensor(leaf) if isinstance(leaf, DTensor) else leaf).shape == out.shape
        for leaf in leaves
    )
