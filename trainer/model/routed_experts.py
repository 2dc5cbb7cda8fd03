"""The routed experts of an MoE layer: SwiGLU weights stacked per expert, computed as grouped
matmuls over rows sorted by expert (or one expert at a time where the grouped kernel is missing),
and the dispatch that brings the rows to them (here, on this rank; ``parallelisms/expert_parallel.py``
swaps in the exchange with the other ranks' experts)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.moe_split import SPLIT
from parallelisms.torch_private import kernels

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The routed experts' computation: rows sorted by expert and the rows per expert -> outputs."""
Dispatch = Callable[[list[torch.Tensor], list[torch.Tensor], Experts], list[torch.Tensor]]
"""Chunks of routed rows, each sorted by expert, and their rows per expert -> each chunk's outputs."""


def local_dispatch(rows: list[torch.Tensor], counts: list[torch.Tensor], experts: Experts) -> list[torch.Tensor]:
    """Every expert on this rank: the tokens, sorted by expert, go straight through."""
    return [experts(r, c) for r, c in zip(rows, counts, strict=True)]


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    grouped_mm: Callable[..., torch.Tensor] = kernels.grouped_mm,
):
    """The experts as three grouped matmuls over the expert-sorted tokens."""
    offsets = counts.cumsum(0).to(torch.int32)
    h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offsets)) * grouped_mm(x, w3.transpose(-2, -1), offsets)
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


@torch.compiler.disable
def looped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    splits: list[int] | None = None,
):
    """The same, one expert at a time: exact wherever the grouped kernel is missing. ``splits``:
    the rows per expert where ``counts`` has no values (fake tensors). Eager inside a compiled
    block: its split sizes are the routing's counts, which would make torch.compile trace it
    again for every new routing."""
    rows = counts.tolist() if splits is None else splits
    outs = [(F.silu(chunk @ w1[e].T) * (chunk @ w3[e].T)) @ w2[e].T for e, chunk in enumerate(x.split(rows))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def has_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: ``w1``, ``w3`` ``(experts, hidden, dim)``,
    ``w2`` ``(experts, dim, hidden)``. Under expert parallelism a rank holds experts
    ``first_expert ..`` of the ``n_experts``."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts, self.first_expert = n_experts, 0
        self.assumed_split = False
        """Set by ``--simulate``, whose fake CPU tensors hold no counts: bfloat16 rows run the
        grouped kernel, as on an sm90 GPU, other dtypes the loop over rows split evenly."""
        self.checkpoint_mesh: DeviceMesh | None = None
        """Under expert parallelism, where a checkpoint places this rank's experts in the stack."""
        self.grouped_mm: Callable[..., torch.Tensor] = kernels.grouped_mm
        """The grouped kernel; float8 training swaps in torchao's (``parallelisms/float8.py``)."""
        self.dispatch: Dispatch = local_dispatch
        """How the rows reach the experts; expert parallelism swaps in the all-to-all exchange
        with the other ranks' experts. It runs inside this module's forward, so that a module
        hook (FSDP's gather and cast of the weights) fires once however often it computes."""
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, rows: list[torch.Tensor], counts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``rows``: chunks of routed rows, each sorted by expert, ``counts`` of them per expert."""
        return self.dispatch(rows, counts, self.swiglu)

    def swiglu(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: tokens sorted by local expert, ``counts[e]`` of them for expert ``e``."""
        if self.assumed_split and x.dtype != torch.bfloat16:
            n, experts = x.shape[0], self.w1.shape[0]
            splits = [n // experts + (e < n % experts) for e in range(experts)]
            with SPLIT.part("experts"):
                return looped_swiglu(x, counts, self.w1, self.w2, self.w3, splits)
        with SPLIT.part("experts"):
            if has_grouped_mm(x) or self.assumed_split:
                return grouped_swiglu(x, counts, self.w1, self.w2, self.w3, self.grouped_mm)
            return looped_swiglu(x, counts, self.w1, self.w2, self.w3)
