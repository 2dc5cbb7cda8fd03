"""The head-tail sequence shards every context-parallel backend shares.

The sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``: under a causal mask the work of a query chunk grows with its index, so
pairing an early chunk with a late one gives every rank the same attention work. The
all-gather-K/V backend (``context_parallel``) and Ulysses (``ulysses``) both read their shards
in this layout, gather the document ids the same way and wrap the same attention function, so
those live here, below both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.13 renames the tensor collectives to *_single and deprecates the old names; 2.11 has
# only the old ones. Both take (output, input) positionally.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""All-gather ``input`` into ``output`` along its first dimension, rank by rank."""

AttentionFn = Callable[..., torch.Tensor]
"""The model's attention: ``(q, k, v, attn_mask=None) -> out`` over ``(batch, heads, seq, dim)``,
with grouped-query key/value heads; without a mask it is causal."""


def head_tail_positions(seq_len: int, rank: int, degree: int) -> torch.Tensor:
    """Sequence positions held by CP rank ``rank``: chunks ``rank`` and ``2 * degree - 1 - rank``."""
    chunk = seq_len // (2 * degree)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last = 2 * degree - 1 - rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk)])


def natural_order(gathered: torch.Tensor) -> torch.Tensor:
    """``(degree, batch, heads, 2 * chunk, dim)`` from every rank -> ``(batch, heads, seq, dim)``."""
    degree, batch, heads, local, dim = gathered.shape
    chunk = local // 2
    # Rank r's halves are global chunks r and 2 * degree - 1 - r; index them as r * 2 + half.
    order = [g * 2 if g < degree else (2 * degree - 1 - g) * 2 + 1 for g in range(2 * degree)]
    index = torch.tensor(order, device=gathered.device)
    chunks = gathered.permute(1, 2, 0, 3, 4).reshape(batch, heads, degree * 2, chunk, dim)
    return chunks.index_select(2, index).reshape(batch, heads, degree * local, dim)


def gather_document_ids(document_ids: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """Every CP rank's ``(batch, local)`` document ids -> the whole sequence's ``(batch, seq)``."""
    batch, local = document_ids.shape
    gathered = document_ids.new_empty((degree * batch, local))
    all_gather_into(gathered, document_ids.contiguous(), group=group)
    return natural_order(gathered.view(degree, batch, 1, local, 1)).view(batch, degree * local)
