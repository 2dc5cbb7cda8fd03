"""Compile's fusion in a simulated step's memory traffic: the bytes an op moves inside a compiled
region, where Inductor fuses chains of elementwise ops into one kernel (``cost_model.py`` counts
them beside the eager bytes)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import dtensor
from trainer.simulation.memory_tracker import tensors_in


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value``; a DTensor's are its local shard's."""
    return sum(
        t.numel() * t.element_size()
        for t in (dtensor.local_tensor(t) if isinstance(t, DTensor) else t for t in tensors_in(value))
    )


FUSED_POINTWISE = ("_to_copy", "index_select", "index", "gather")
"""Not tagged pointwise, fused like one: dtype casts, and gathers (an indirect load per element)."""
FUSED_REDUCTIONS = (
    "_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "nll_loss_forward",
    "nll_loss_backward",
)
"""Not tagged reductions, fused like them: the (log-)softmax and the loss over a row."""


class Fusion:
    """The bytes an op would move inside a compiled region, where Inductor fuses chains of
    elementwise ops (and the reductions they feed) into one kernel: an op of a chain reads what
    the chain made before it for free, and that intermediate is never written (the chain's
    ops run back to back in dispatch order; any other op, a matmul or a copy, ends the chain).
    Not modelled: fusion across a matmul's epilogue, or a fused intermediate that a later op outside
    the chain reads again (counted as not written: an underestimate where it happens)."""

    def __init__(self) -> None:
        self._chain: dict[int, int] = {}
        """Storages the running chain made -> the bytes written to them (refunded when read)."""

    def bytes(self, func: Any, args: tuple, out: Any, eager: int, compiled: bool) -> int:
        name = func.__name__.split(".")[0]
        pointwise = torch.Tag.pointwise in func.tags or name in FUSED_POINTWISE
        if not compiled or not (pointwise or torch.Tag.reduction in func.tags or name in FUSED_REDUCTIONS):
            self._chain.clear()
            return eager
        moved = 0
        for t in tensors_in(args):
            key = id(storage(t))
            moved += -self._chain.pop(key) if key in self._chain else nbytes(t)
        if not pointwise:
            self._chain.clear()
        for t in tensors_in(out):
            written = nbytes(t)
            moved += written
            self._chain[id(storage(t))] = written
        return max(moved, 0)


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (dtensor.local_tensor(t) if isinstance(t, DTensor) else t).untyped_storage()
