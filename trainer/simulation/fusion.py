"""Compile's fusion in a simulated step's memory traffic: the bytes an op moves inside a compiled
region, where Inductor fuses chains of elementwise ops into one kernel (``cost_model.py`` counts
them beside the eager bytes)."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import dtensor
from trainer.simulation.memory_tracker import tensors_in

Label = TypeVar("Label")


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


@dataclass
class _Written(Generic[Label]):
    nbytes: int
    by: Label
    read: bool = False


@dataclass
class Fused(Generic[Label]):
    """An op's bytes, and what it showed of earlier ops' writes: ``(the op that wrote, bytes)``,
    negative for a write its chain never stored, positive for one a later kernel reads after all."""

    nbytes: int
    corrections: list[tuple[Label, int]] = field(default_factory=list)


class Fusion(Generic[Label]):
    """The bytes ops would move inside a compiled region, where Inductor fuses a chain of
    elementwise ops, and the reductions along some dimensions among them, into one kernel
    (run back to back in dispatch order; a matmul, a copy or a reduction to one value ends the
    chain). The kernel loads each tensor from outside once and writes an intermediate only if a
    later kernel reads it: the op of the chain that reads it takes its write back from the op
    that made it, and an op after the chain that reads it after all gives it back (``Fused``), so
    every op's row stays what it moved. An eager op run ``after`` the region's kernels on what
    they wrote (autograd's accumulation of a compiled backward's gradients) has them stored and
    leaves the chain running. Not modelled: fusion into a matmul's epilogue; Inductor's
    common-subexpression elimination (a scale computed twice in a step is charged twice)."""

    def __init__(self) -> None:
        self._chain: dict[int, _Written[Label]] = {}
        """Storages the running chain made -> their writes."""
        self._loaded: set[int] = set()
        """Storages from outside the running chain that it has read (read again for free)."""
        self._unwritten: dict[int, tuple[weakref.ref, _Written[Label]]] = {}
        """Storages a chain made and did not write, while they live: a later kernel's read writes them."""

    def bytes(
        self, func: Any, args: tuple, out: Any, eager: int, compiled: bool, label: Label, after: bool = False
    ) -> Fused[Label]:
        name = func.__name__.split(".")[0]
        pointwise = torch.Tag.pointwise in func.tags or name in FUSED_POINTWISE
        reduction = torch.Tag.reduction in func.tags or name in FUSED_REDUCTIONS
        fused = Fused[Label](0)
        if after:
            for t in tensors_in(args):
                if (made := self._chain.get(id(storage(t)))) is not None:
                    made.read = True  # stored for this op: the chain reads it again for free
        if after or not compiled or not (pointwise or reduction):
            if not after:
                self._end()
            fused.corrections = [c for t in tensors_in(args) if (c := self._written_after_all(t))]
            fused.nbytes = eager
            return fused
        for t in tensors_in(args):
            key = id(storage(t))
            made = self._chain.get(key)
            if made is not None and not made.read:
                made.read = True
                fused.corrections.append((made.by, -made.nbytes))
                self._unwritten[key] = (weakref.ref(storage(t), functools.partial(self._forget, key)), made)
            elif made is None and key not in self._loaded:
                self._loaded.add(key)
                fused.nbytes += nbytes(t)
                if c := self._written_after_all(t):
                    fused.corrections.append(c)
        if not pointwise and sum(t.numel() for t in tensors_in(out)) <= 1:
            self._end()
        for t in tensors_in(out):
            written = nbytes(t)
            fused.nbytes += written
            self._chain[id(storage(t))] = _Written(written, label)
        return fused

    def _forget(self, key: int, _: weakref.ref) -> None:
        self._unwritten.pop(key, None)

    def _written_after_all(self, t: torch.Tensor) -> tuple[Label, int] | None:
        """The write of ``t`` given back to the op that made it, if its chain had taken it back."""
        st = storage(t)
        ref, made = self._unwritten.pop(id(st), (None, None))
        return (made.by, made.nbytes) if ref is not None and made is not None and ref() is st else None

    def _end(self) -> None:
        self._chain.clear()
        self._loaded.clear()


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (dtensor.local_tensor(t) if isinstance(t, DTensor) else t).untyped_storage()
