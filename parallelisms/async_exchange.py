"""An all-to-all that is started in one place and waited for in another, forward and backward.

Expert parallelism overlaps its token exchanges with the experts' matmuls: while one chunk of a
rank's tokens is in flight, the experts compute another (``expert_parallel.py``). An autograd
all-to-all that waits where it is called cannot do that, and torch's functional all-to-all also
waits at once in its backward. Here the exchange is two autograd nodes: :func:`start` sends
(forward) and waits for the gradient's exchange (backward); :func:`wait` waits (forward) and
sends the gradient back without waiting (backward). Between the two, autograd's engine runs
whatever else is ready, in reverse order of creation: in backward, the other chunk's experts.
The received rows are still being written by the collective until ``wait``; only ``wait``
reads them, and nothing else consumes them.

Splits are the rows per rank, as in ``all_to_all_single``; the gradient goes back with them
swapped. Every exchange is a functional collective, so ``--simulate`` sees when it starts and
when it is waited for, and counts what ran in between as hiding it (``cost_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.torch_private import dtensor


@dataclass(frozen=True)
class Route:
    """``sent[i]`` rows go to rank ``i``, ``received[i]`` come from it, over ``group``."""

    sent: list[int]
    received: list[int]
    group: dist.ProcessGroup

    def reversed(self) -> Route:
        return Route(self.received, self.sent, self.group)


class Pending:
    """One exchange between :func:`start` and :func:`wait`, and in backward the gradient's
    exchange, sent by ``wait``'s node and waited for by ``start``'s (which alone has the
    sent rows' shape). Holds no tensor of the forward: a context holding its own node's output
    would be a reference cycle that outlives the step."""

    def __init__(self, route: Route):
        self.route = route
        self.grad_in_flight: torch.Tensor | None = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        route = pending.route
        return dtensor.start_all_to_all(rows, route.received, route.sent, route.group)

    @staticmethod
    def backward(ctx, _received_grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad, ctx.pending.grad_in_flight = ctx.pending.grad_in_flight, None
        return dtensor.wait(grad), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in_flight: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        # The arrived rows as a new tensor on the same memory, not autograd's view of the input
        # (the experts' FSDP unit returns them, and FSDP warns of a returned view) and not the
        # input marked dirty (op-level checkpointing keeps it, and refuses a mutated tensor).
        return dtensor.wait(in_flight).detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        back = ctx.pending.route.reversed()
        ctx.pending.grad_in_flight = dtensor.start_all_to_all(grad, back.received, back.sent, back.group)
        # Passed on unread, so that it lives as long as the exchange reading it.
        return grad, None


def start(rows: torch.Tensor, route: Route) -> tuple[torch.Tensor, Pending]:
    """Send ``rows`` along ``route``; the received rows may be read only after :func:`wait`."""
    pending = Pending(route)
    return _Start.apply(rows, pending), pending


def wait(in_flight: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The rows :func:`start` received, once they have arrived."""
    return _Wait.apply(in_flight, pending)
