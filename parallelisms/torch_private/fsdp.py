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

FEATURE = "FSDP's parameter groups (debug.layout_invariant, --simulate)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = ("_get_fsdp_state", "_fsdp_param_group", "_unsharded_param")
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
    """Whether the running op was called by FSDP's own code (its gathers, casts, gradient
    accumulation and reductions), which a compiled block leaves eager: a frame of torch's
    ``fsdp`` package on the Python stack."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_filename.startswith(FSDP_SOURCE):
            return True
        frame = frame.f_back
    return False
