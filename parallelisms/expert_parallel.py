"""Expert parallelism: the routed experts split over ``ep`` ranks, tokens exchanged all-to-all.

The ``ep`` ranks are taken from the data-parallel shard and context-parallel ranks
(``dp_shard x cp``), as torchtitan does: each routes its own tokens (its samples, its sequence
shard), then one all-to-all with uneven splits sends every
token to the rank holding its expert and a second one brings the outputs back (autograd routes
the gradients the same way). Routing is dropless, so no token is lost to a capacity and the
result does not depend on ``ep``. A rank holds experts ``first_expert ..`` of the stack, shaped
``(n_experts / ep, ...)``; ``parallelisms/fsdp.py`` shards them again over the ``dp_shard x cp``
ranks outside the EP group and the TP ranks (their own FSDP unit), while the router and the
shared experts stay in the block's unit like any dense layer (under TP a unit of their own that
also spans ``tp``). Under tensor parallelism the experts are expert-parallel, not tensor-parallel:
each TP rank routes its own sequence shard (``parallelisms/tensor_parallel.py``) and exchanges its
tokens with the EP ranks of its own TP index.

Gradients: an expert's gradient sums the contributions of every EP rank's tokens on the rank
holding it, and FSDP sums over its own replicas (the other data-parallel, context-parallel and
tensor-parallel ranks): a pure sum, divided by nothing, like every other
gradient (``GradAccumulator`` divides once by the step's valid tokens). The gradient norm counts
the expert shards of different EP ranks as different values, not copies (``expert_params``).

Planning (``--simulate``) runs this exchange on fake tensors, whose counts have no values: the
simulator states the routing instead (:class:`AssumedRouting`, set on each layer's dispatch), and
the exchange's splits follow it; everything else runs as in training.

Supported: ``ep`` dividing ``dp_shard x cp``, with FSDP, HSDP, TP, CP (every backend), gradient
accumulation, activation checkpointing, pipeline stages (each EP group lies inside one stage) and
compile (the two exchanges run eagerly inside a compiled block, the experts between them compiled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from parallelisms.model_parts import moe_layers
from parallelisms.moe_split import SPLIT
from parallelisms.token_permutation import inverse_permutation, permute_rows
from parallelisms.torch_private import dtensor


@dataclass(frozen=True)
class AssumedRouting:
    """How many routed tokens this rank sends to and receives from each EP rank, where they
    cannot be counted (fake tensors): every rank routes its tokens evenly, except that this
    rank, the one planned for, receives ``imbalance`` times the average (1: balanced), from
    every source alike, its own tokens included."""

    imbalance: float = 1.0

    def splits(self, rows: int, ep: int, rank: int) -> tuple[list[int], list[int]]:
        """``(sent, received)`` rows per EP rank, for ``rows`` routed rows of this rank's tokens."""
        if ep == 1:
            return [rows], [rows]
        received = _even(round(self.imbalance * rows), ep)
        rest = _even(rows - received[rank], ep - 1)
        return rest[:rank] + [received[rank]] + rest[rank:], received


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class ExpertParallelDispatch:
    """The routed tokens, sorted by global expert, through the experts of every EP rank."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local_experts: int):
        self.group, self.ep, self.local_experts = group, ep, local_experts
        self.bytes_sent = 0
        """Bytes this rank sent to other ranks in the token all-to-alls (for the benchmark)."""
        self.assumed: AssumedRouting | None = None
        """The routing ``--simulate`` states, used instead of the counts' values."""
        self._splits: tuple[list[int], list[int]] = ([], [])
        """The running exchange's ``(sent, received)`` rows per EP rank."""

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """The two exchanges run eagerly inside a compiled block (their sizes are the routing's
        counts); the sort by local expert, the experts and the unsort between them compile with
        the block."""
        with SPLIT.part("dispatch"):
            received, recv, perm = self._send(routed, counts)
            inverse = inverse_permutation(perm)
            sorted_tokens = permute_rows(received, perm, inverse)
        out = experts(sorted_tokens, recv.sum(0))
        with SPLIT.part("combine"):
            return self._send_back(permute_rows(out, inverse, perm))

    @torch.compiler.disable
    def _send(self, routed: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every routed row to the rank of its expert: ``(received rows, received counts per
        (source rank, local expert), the order that sorts the rows by local expert)``. The
        splits wait for :meth:`_send_back` here, not in the compiled frame, which would
        specialise on their values."""
        send = counts.view(self.ep, self.local_experts)
        # Functional, not in place: op-level checkpointing keeps its output (activation_checkpoint.py).
        recv = dtensor.all_to_all(send, self.group)
        if self.assumed is None:
            in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        else:
            in_splits, out_splits = self.assumed.splits(routed.shape[0], self.ep, dist.get_rank(self.group))
        received = dtensor.all_to_all_uneven(routed, out_splits, in_splits, self.group)
        # Received in (source rank, expert) order; the experts want (expert, source rank).
        expert = torch.arange(self.local_experts, device=recv.device).view(1, -1)
        source = torch.arange(self.ep, device=recv.device).view(-1, 1)
        order = (expert * self.ep + source).flatten()
        key = order.repeat_interleave(recv.flatten(), output_size=sum(out_splits))
        self._splits = (in_splits, out_splits)
        return received, recv, key.argsort(stable=True)

    @torch.compiler.disable
    def _send_back(self, back: torch.Tensor) -> torch.Tensor:
        """The experts' rows back to the ranks that routed them, in the order they were sent."""
        in_splits, out_splits = self._splits
        rank = dist.get_rank(self.group)
        row = back.element_size() * back.shape[1]
        self.bytes_sent += row * (sum(in_splits) - in_splits[rank] + sum(out_splits) - out_splits[rank])
        return dtensor.all_to_all_uneven(back, in_splits, out_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, checkpoint_mesh: DeviceMesh | None) -> None:
    """Keep this rank's experts of every MoE layer (on the meta device) and exchange tokens with
    the other EP ranks; ``checkpoint_mesh`` places their shards in the whole stack on save."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moe_layers(model):
        experts = moe.experts
        local = experts.n_experts // ep
        for name in ("w1", "w2", "w3"):
            whole = getattr(experts, name)
            setattr(experts, name, nn.Parameter(torch.empty((local, *whole.shape[1:]), device=whole.device)))
        experts.first_expert = rank * local
        experts.checkpoint_mesh = checkpoint_mesh
        moe.dispatch = ExpertParallelDispatch(ep_mesh.get_group(), ep, local)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that differ between EP ranks: every MoE layer's routed experts."""
    return [p for moe in moe_layers(model) for p in moe.experts.parameters()]


def gathered_experts(model: nn.Module) -> list[FSDPModule]:
    """Every MoE layer's routed experts as the FSDP unit ``parallelisms/fsdp.py`` made of them:
    what ``GradAccumulator`` keeps gathered through the step when that unit spans one rank."""
    return [moe.experts for moe in moe_layers(model) if isinstance(moe.experts, FSDPModule)]


def assume_routing(model: nn.Module, routing: AssumedRouting) -> None:
    """Plan ``model``'s MoE layers on fake tensors: every exchange follows ``routing``, and the
    experts split their rows by no counts' values (``GroupedExperts.assumed_split``)."""
    for moe in moe_layers(model):
        moe.experts.assumed_split = True
        if isinstance(moe.dispatch, ExpertParallelDispatch):
            moe.dispatch.assumed = routing
