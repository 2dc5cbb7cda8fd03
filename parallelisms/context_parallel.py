"""Context parallelism: the sequence is split over ``cp`` ranks, attention sees all of it.

Layout (head-tail load balancing, ``parallelisms/sequence_shards.py``): the sequence is cut into
``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``. Inputs, labels
and RoPE positions are sharded the same way; RoPE uses the tokens' true positions.

Attention has one interface and three backends:

- ``allgather_kv`` (every device; selectable on CUDA for checking): all-gather K and V over
  the CP group with an autograd-aware collective whose backward is a reduce-scatter, then
  attend each local query chunk to the keys up to its own end, causally aligned at the
  bottom right. This is the scheme Llama 3's long-context training used, and it is what makes
  CP run (and testable) on CPU: PyTorch's own CP has no CPU path.
- ``ring`` (CUDA): PyTorch's context parallelism (ring attention over the flash or memory-
  efficient SDPA kernels), with ``context_parallel_rotate_method`` choosing how K/V shards move.
  Its own head-tail load balancer lays out the sequence exactly as above; a run checks that.
- ``ulysses`` (every device; ``parallelisms/ulysses.py``): an all-to-all turns the sequence
  shards of q, k and v into whole sequences of ``heads / cp`` heads, the model's own attention
  runs on them, and the inverse all-to-all brings the output back to sequence shards. Needs
  ``cp x tp`` to divide the attention heads.

Every CP rank holds different tokens, so the gradient accumulator counts valid labels over
data-parallel ranks *and* CP shards, and the loss needs no CP correction.

Document masking (``training.document_mask``) works with ``allgather_kv`` and ``ulysses``: the
document ids, derived on the whole sequence and sharded like the tokens, are all-gathered once
per forward (``sequence_shards.gather_document_ids``). ``allgather_kv`` gives each local query chunk a mask
that is causal *and* same-document against the gathered keys (``AllGatherKVMask``); ``ulysses``
masks its whole sequences as one process would. The ring backend takes no mask and is refused
with document masking (``auto`` then picks ``allgather_kv``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms import sequence_shards
from parallelisms.model_parts import block_settings, blocks, model_settings
from parallelisms.sequence_shards import AttentionFn, gather_document_ids, head_tail_positions, natural_order
from parallelisms.torch_private import dtensor
from parallelisms.ulysses import UlyssesAttention, UlyssesMask

BACKENDS = ("allgather_kv", "ring", "ulysses")
"""What ``parallelism.context_parallel_backend`` may name, besides ``auto``."""


# torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single and deprecates the old name;
# 2.11 has only the old one. Both take (output, input) positionally.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along a new leading dimension; backward reduce-scatters (sums) the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((degree * x.shape[0], *x.shape[1:]))
        sequence_shards.all_gather_into(out, x.contiguous(), group=group)
        return out.view(degree, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None, None


def attend_local_chunks(
    attention: AttentionFn,
    xq: torch.Tensor,
    xk_full: torch.Tensor,
    xv_full: torch.Tensor,
    rank: int,
    degree: int,
    chunk_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of rank ``rank``'s two query chunks against the whole sequence's K/V.

    ``xq`` is ``(batch, heads, 2 * chunk, head_dim)`` in head-tail layout; ``xk_full`` and
    ``xv_full`` are ``(batch, kv_heads, seq, head_dim)`` in natural order. Query chunk ``j``
    only needs keys ``[0, (j + 1) * chunk)``, and the causal mask is aligned so that its last
    query sees its last key. ``attention`` is the model's own (it handles grouped-query heads),
    given that bottom-right-aligned mask, or ``chunk_masks`` (:func:`local_chunk_masks`) under
    document masking.
    """
    # Imported here: torch.nn.attention.bias imports torch._dynamo, about a second of start-up
    # for every process, and only context parallelism needs it.
    from torch.nn.attention.bias import causal_lower_right

    chunk = xq.shape[2] // 2
    outputs = []
    for half, global_chunk in enumerate((rank, 2 * degree - 1 - rank)):
        end = (global_chunk + 1) * chunk
        outputs.append(
            attention(
                xq[:, :, half * chunk : (half + 1) * chunk],
                xk_full[:, :, :end],
                xv_full[:, :, :end],
                attn_mask=causal_lower_right(chunk, end) if chunk_masks is None else chunk_masks[half],
            )
        )
    return torch.cat(outputs, dim=2)


def local_chunk_masks(
    document_ids: torch.Tensor, rank: int, degree: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks of rank ``rank``'s two query chunks against the keys before their ends.

    ``document_ids`` is ``(batch, seq)`` for the whole sequence in natural order. A query sees a
    key at or before its own position in the same document; each mask is ``(batch, 1, chunk,
    end)``, as :func:`attend_local_chunks` cuts the keys; additive, as the model's own
    document mask is (``trainer.model.llama3.document_causal_mask``).
    """
    chunk = document_ids.shape[1] // (2 * degree)
    masks = []
    for global_chunk in (rank, 2 * degree - 1 - rank):
        start, end = global_chunk * chunk, (global_chunk + 1) * chunk
        query = torch.arange(start, end, device=document_ids.device)
        causal = torch.arange(end, device=document_ids.device)[None, :] <= query[:, None]
        same = document_ids[:, None, start:end, None] == document_ids[:, None, None, :end]
        allowed = causal & same
        masks.append(
            torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        )
    return masks[0], masks[1]


class AllGatherKVMask:
    """The model's ``attention_mask`` under ``allgather_kv``: this rank's document ids are all-
    gathered once per forward (the keys of every rank carry their documents), then cut into
    the masks of the two local query chunks, shared by every block."""

    def __init__(self, group: dist.ProcessGroup, rank: int, degree: int):
        self.group, self.rank, self.degree = group, rank, degree

    def __call__(self, document_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        whole = gather_document_ids(document_ids, self.group, self.degree)
        return local_chunk_masks(whole, self.rank, self.degree, dtype)


class AllGatherKVAttention:
    """The ``allgather_kv`` backend: wraps a block's ``attention_fn`` (the model's attention)."""

    def __init__(self, attention: AttentionFn, group: dist.ProcessGroup, rank: int, degree: int):
        self.attention, self.group, self.rank, self.degree = attention, group, rank, degree

    def __call__(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        xv: torch.Tensor,
        chunk_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        xk_full = natural_order(_AllGatherSequence.apply(xk, self.group, self.degree))
        xv_full = natural_order(_AllGatherSequence.apply(xv, self.group, self.degree))
        return attend_local_chunks(self.attention, xq, xk_full, xv_full, self.rank, self.degree, chunk_masks)


class ContextParallel:
    """Shards sequences for this CP rank and provides the attention that spans the shards."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, backend: str, rotate_method: str):
        self.mesh = cp_mesh
        self.degree = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.seq_len = seq_len
        self.backend = backend
        self.rotate_method = rotate_method
        self.positions = head_tail_positions(seq_len, self.rank, self.degree)

    def apply(self, model: nn.Module) -> None:
        """Give every block's attention the whole sequence (``allgather_kv``: its K/V;
        ``ulysses``: all of it for a share of the heads), and the model the document masks that
        go with it. The ring backend patches SDPA instead (:meth:`attention_context`).

        Expects torchtitan's Llama names: ``model.layers[i].attention.attention_fn``.
        """
        group = self.mesh.get_group()
        if self.backend == "allgather_kv":
            model_settings(model).attention_mask = AllGatherKVMask(group, self.rank, self.degree)
        elif self.backend == "ulysses":
            model_settings(model).attention_mask = UlyssesMask(group, self.degree)
        else:
            return
        for block in blocks(model).values():
            attention = block_settings(block).attention
            inner = attention.attention_fn
            if self.backend == "ulysses":
                attention.attention_fn = UlyssesAttention(inner, group, self.degree)
            else:
                attention.attention_fn = AllGatherKVAttention(inner, group, self.rank, self.degree)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of ``x`` (``batch, seq, ...``), in head-tail layout."""
        return x.index_select(1, self.positions.to(x.device))

    @contextlib.contextmanager
    def attention_context(self) -> Iterator[None]:
        """Where forward and backward run: the ring backend patches SDPA inside it."""
        if self.backend != "ring":
            yield
            return
        from torch.distributed.tensor.experimental import context_parallel

        dtensor.set_ring_rotation(self.rotate_method)
        positions = torch.arange(self.seq_len, device=self.mesh.device_type)
        with context_parallel(self.mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
            if not torch.equal(positions.cpu(), self.positions):
                raise RuntimeError(
                    "PyTorch's context parallelism laid out the sequence differently from the "
                    "head-tail layout the inputs were sharded with; use "
                    '`parallelism.context_parallel_backend = "allgather_kv"`.'
                )
            yield


def resolve_backend(backend: str, device_type: str, document_mask: bool = False) -> str:
    """``auto`` is PyTorch's ring attention on CUDA and the all-gather-K/V attention elsewhere,
    or wherever documents are masked (the ring backend takes no mask)."""
    if backend == "auto":
        return "ring" if device_type == "cuda" and not document_mask else "allgather_kv"
    return backend
