"""Ulysses context parallelism (DeepSpeed-Ulysses): attention on whole sequences, a share of the heads.

Outside attention a CP rank holds its sequence shard (the head-tail layout of
``sequence_shards``), like every backend, so the data loader, labels and RoPE positions are one
code path. Around attention, one all-to-all over the CP group turns the shards of q, k and v
into *whole* sequences of ``heads / cp`` heads, and the inverse all-to-all turns the output back
into sequence shards of every head. In between, attention is the model's own, unchanged:
causal, or any mask (document masking), and on GPUs any kernel that takes whole sequences.

The shards arrive in rank order: rank ``i`` holds global chunks ``i`` and ``2 cp - 1 - i``. The
received sequence is put back in natural order (one ``index_select``) before attention and
into rank order after it, so the causal or document mask is the whole sequence's.

Grouped-query attention: query head ``h`` reads key/value head ``h // (heads / kv_heads)``, so
contiguous groups of ``heads / cp`` query heads read contiguous groups of ``kv_heads / cp``
key/value heads, when ``cp`` divides ``kv_heads``. When it does not (``kv_heads < cp`` after
tensor parallelism, as in Llama 3 70B at tp=8), each key/value head is repeated
:func:`kv_replication` times before the all-to-all, the fewest copies that ``cp`` divides and
that keep the grouping; the K and V all-to-alls then move that many times the bytes (see
:func:`all_to_all_bytes`). The repeat's backward sums the copies' gradients.

Communication uses the autograd functional collective ``all_to_all_single`` (its backward is
the inverse all-to-all), on NCCL and on gloo; a DTensor ``Shard(1) -> Shard(2)``
redistribution would fall back to an all-gather on a CPU mesh.

Nothing here scales by the CP degree: every rank's loss covers its own tokens, and the
gradient accumulator counts valid labels over data-parallel ranks and CP shards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallelisms.sequence_shards import AttentionFn, gather_document_ids, head_tail_positions
from parallelisms.torch_private import dtensor


def kv_replication(kv_heads: int, degree: int) -> int:
    """Copies of each key/value head so that ``degree`` divides them: ``degree / gcd(kv_heads, degree)``.

    ``kv_heads x copies = lcm(kv_heads, degree)`` divides the query heads whenever ``degree``
    and ``kv_heads`` do, so each query head still reads a copy of its own key/value head.
    """
    return degree // math.gcd(kv_heads, degree)


def all_to_all_bytes(
    tokens: int, heads: int, kv_heads: int, head_dim: int, degree: int, element_bytes: int
) -> tuple[int, int]:
    """Bytes one rank sends to the others per attention call: ``(forward, backward)``.

    ``tokens`` are the rank's own (its sequence shard times the batch), ``heads`` and
    ``kv_heads`` what the rank holds (after tensor parallelism). Forward: q, k, v and the
    output, each ``(degree - 1) / degree`` of it leaving the rank; backward: their gradients.
    """
    kv = kv_heads * kv_replication(kv_heads, degree)
    per_call = tokens * (2 * heads + 2 * kv) * head_dim * element_bytes * (degree - 1) // degree
    return per_call, per_call


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block ``i`` of ``x``'s first dimension goes to rank ``i``; block ``i`` of the result came from it.

    Waited for at once: attention needs the whole result, and an un-waited collective tensor
    that only a view consumes is still registered as in flight when the process ends.
    """
    return dtensor.all_to_all(x, group)


class UlyssesAttention:
    """A block's ``attention_fn`` under Ulysses: all-to-all to head shards, the model's attention
    on whole sequences, all-to-all back to sequence shards."""

    def __init__(self, attention: AttentionFn, group: dist.ProcessGroup, degree: int):
        self.attention, self.group, self.degree = attention, group, degree
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``xq``, ``xk``, ``xv``: ``(batch, heads, local tokens, head_dim)`` in head-tail layout."""
        copies = kv_replication(xk.shape[1], self.degree)
        if copies > 1:
            xk, xv = xk.repeat_interleave(copies, dim=1), xv.repeat_interleave(copies, dim=1)
        rank_order, natural = self._order(xq.shape[2] * self.degree, xq.device)
        q, k, v = (self._to_heads(t).index_select(2, natural) for t in (xq, xk, xv))
        out = self.attention(q, k, v) if mask is None else self.attention(q, k, v, attn_mask=mask)
        return self._to_sequence(out.index_select(2, rank_order))

    def _order(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``rank_order``: the global position of each token in rank order (rank 0's shard, rank
        1's, ...); ``natural``: its inverse permutation."""
        key = (seq, device)
        if key not in self._orders:
            rank_order = torch.cat([head_tail_positions(seq, r, self.degree) for r in range(self.degree)])
            self._orders[key] = (rank_order.to(device), torch.argsort(rank_order).to(device))
        return self._orders[key]

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, local, dim)`` -> ``(batch, heads / cp, cp x local, dim)`` in rank order."""
        batch, heads, local, dim = x.shape
        send = x.view(batch, self.degree, heads // self.degree, local, dim).transpose(0, 1)
        received = _all_to_all(send, self.group)  # (cp, batch, heads / cp, local, dim): rank i's tokens
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.degree, self.degree * local, dim)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, heads / cp, seq, dim)`` in rank order -> ``(batch, heads, seq / cp, dim)``."""
        batch, group_heads, seq, dim = x.shape
        local = seq // self.degree
        send = x.view(batch, group_heads, self.degree, local, dim).permute(2, 0, 1, 3, 4)
        received = _all_to_all(send, self.group)  # (cp, batch, heads / cp, local, dim): head group i
        return received.transpose(0, 1).reshape(batch, self.degree * group_heads, local, dim)


class UlyssesMask:
    """The model's ``attention_mask`` under Ulysses: this rank's document ids are all-gathered
    once per forward, and the whole sequence's causal same-document mask is built from them,
    additive in the compute dtype like the model's own, shared by every block."""

    def __init__(self, group: dist.ProcessGroup, degree: int):
        self.group, self.degree = group, degree

    def __call__(self, document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        whole = gather_document_ids(document_ids, self.group, self.degree)
        seq = whole.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=whole.device).tril()
        allowed = causal & (whole[:, None, :, None] == whole[:, None, None, :])
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
