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

Overlap: each MoE layer cuts its tokens into chunks (``MoE.exchange_chunks``, from
``parallelism.expert_parallel_overlap_chunks``), each sorted by expert on its own; every chunk is
sent before the first is waited for and each goes back as soon as its experts are done, so that
one chunk's exchange runs while the experts compute another, forward and backward
(``async_exchange.py``). The dispatch runs inside the experts' module, whose FSDP hooks then fire
once per layer, not once per chunk.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from parallelisms import async_exchange
from parallelisms.async_exchange import Pending, Route
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
    """The routed tokens, sorted by global expert, through the experts of every EP rank, in
    parts whose exchanges overlap the other parts' experts (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, local_experts: int):
        self.group, self.ep, self.local_experts = group, ep, local_experts
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        """Bytes this rank sent to other ranks in the token all-to-alls (for the benchmark)."""
        self.assumed: AssumedRouting | None = None
        """The routing ``--simulate`` states, used instead of the counts' values."""

    def __call__(
        self, rows: list[torch.Tensor], counts: list[torch.Tensor], experts: Callable[..., torch.Tensor]
    ) -> list[torch.Tensor]:
        """``rows``: chunks of this rank's routed rows, each sorted by global expert, ``counts``
        of them per expert. Every chunk is sent before the first is waited for, and each chunk's
        outputs are sent back as soon as its experts are done, so that the exchanges of one
        chunk run under the experts of another, forward and backward. The sort by local expert,
        the experts and the unsort compile with the block; the exchanges, whose sizes are the
        routing's counts, run eagerly."""
        with SPLIT.part("dispatch"):
            routes, recv = self._routes([r.shape[0] for r in rows], torch.stack(counts))
            in_flight = [self._start(r, route) for r, route in zip(rows, routes, strict=True)]
        back = []
        for c, ((received, pending), route) in enumerate(zip(in_flight, routes, strict=True)):
            with SPLIT.part("dispatch"):
                arrived = self._wait(received, pending)
                perm = self._by_local_expert(recv[:, c], sum(route.received))
                inverse = inverse_permutation(perm)
                sorted_rows = permute_rows(arrived, perm, inverse)
            out = experts(sorted_rows, recv[:, c].sum(0))
            with SPLIT.part("combine"):
                back.append(self._start(permute_rows(out, inverse, perm), route.reversed()))
        with SPLIT.part("combine"):
            return [self._wait(returned, pending) for returned, pending in back]

    @torch.compiler.disable
    def _routes(self, rows: list[int], counts: torch.Tensor) -> tuple[list[Route], torch.Tensor]:
        """Each chunk's route, and the rows received per ``(source rank, chunk, local expert)``,
        from ``counts`` per ``(chunk, expert)``. The splits are read here, once for every chunk,
        not in the compiled frame, which would specialise on their values."""
        send = counts.view(-1, self.ep, self.local_experts).transpose(0, 1).contiguous()
        # Functional, not in place: op-level checkpointing keeps its output (activation_checkpoint.py).
        recv = dtensor.all_to_all(send, self.group)
        if self.assumed is None:
            sent, received = torch.stack([send.sum(2), recv.sum(2)]).transpose(1, 2).tolist()
        else:
            sent, received = zip(*(self.assumed.splits(n, self.ep, self.rank) for n in rows), strict=True)
        return [Route(list(s), list(r), self.group) for s, r in zip(sent, received, strict=True)], recv

    def _by_local_expert(self, recv: torch.Tensor, rows: int) -> torch.Tensor:
        """The order that sorts received rows, which come in (source rank, expert) order, by
        (expert, source rank): what the experts want."""
        expert = torch.arange(self.local_experts, device=recv.device).view(1, -1)
        source = torch.arange(self.ep, device=recv.device).view(-1, 1)
        order = (expert * self.ep + source).flatten()
        return order.repeat_interleave(recv.flatten(), output_size=rows).argsort(stable=True)

    @torch.compiler.disable
    def _start(self, rows: torch.Tensor, route: Route) -> tuple[torch.Tensor, Pending]:
        self.bytes_sent += rows.element_size() * rows.shape[1] * (sum(route.sent) - route.sent[self.rank])
        return async_exchange.start(rows, route)

    @torch.compiler.disable
    def _wait(self, rows: torch.Tensor, pending: Pending) -> torch.Tensor:
        return async_exchange.wait(rows, pending)


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, checkpoint_mesh: DeviceMesh | None, chunks: int = 1
) -> None:
    """Keep this rank's experts of every MoE layer (on the meta device) and exchange tokens with
    the other EP ranks, in ``chunks`` overlapped parts; ``checkpoint_mesh`` places their shards
    in the whole stack on save."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moe_layers(model):
        experts = moe.experts
        local = experts.n_experts // ep
        for name in ("w1", "w2", "w3"):
            whole = getattr(experts, name)
            setattr(experts, name, nn.Parameter(torch.empty((local, *whole.shape[1:]), device=whole.device)))
        experts.first_expert = rank * local
        experts.checkpoint_mesh = checkpoint_mesh
        experts.dispatch = ExpertParallelDispatch(ep_mesh.get_group(), ep, local)
        moe.exchange_chunks = chunks


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
        if isinstance(moe.experts.dispatch, ExpertParallelDispatch):
            moe.experts.dispatch.assumed = routing
