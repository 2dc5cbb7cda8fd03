"""The routed rows' permutations as gathers both ways: no zero-filled buffer, no scatter.

An MoE layer sorts its ``tokens x k`` routed rows by expert, and after the experts puts them back
in token order; expert parallelism sorts the rows it receives again, by local expert. Autograd
sees such a permutation as an index: its backward (and a scatter-style unsort,
``zeros_like(rows).index_copy(order, rows)``) writes a zero-filled buffer of every row, then
scatters into it. A permutation's transpose is its inverse, so both directions here are gathers,
forward and backward: each moves every row once, and compile fuses the gather into what reads it
(the combine's weighted sum over the k rows of a token). The inverse is computed once, with the
sort, and serves both directions.
"""

from __future__ import annotations

import torch


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] = i``: a scatter of integers, not a second sort."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[order]``, whose gradient is ``grad[inverse]`` (``inverse``: ``order``'s)."""
    return _Permute.apply(rows, order, inverse)


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return tokens.index_select(0, order.div(k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        rows = grad.index_select(0, inverse)
        return rows.view(-1, ctx.k, rows.shape[-1]).sum(1), None, None, None


def expand_tokens(tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """The routed rows in ``order``: row ``i`` is token ``order[i] // k`` (each token's k
    choices are rows ``token x k ..``). Its gradient sums each token's k rows' gradients, taken
    back to token order by ``inverse``: a gather and a sum, where autograd would accumulate
    them into a zero-filled buffer."""
    return _Expand.apply(tokens, order, inverse, k)
