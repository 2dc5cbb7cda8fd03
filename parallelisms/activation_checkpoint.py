"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Modes (``[activation_checkpoint]``):

- ``full``: every transformer block keeps only its input; its whole forward reruns in backward.
- ``selective`` with ``selective_ac_option = "k"`` (an integer): full checkpointing of every
  k-th block only (blocks 0, k, 2k, ...), trading memory for less recomputation.
- ``selective`` with ``selective_ac_option = "op"``: in every block, the outputs of the
  expensive ops (matmuls, attention, tensor-parallel reduce-scatters, the MoE experts' grouped
  matmul and every all-to-all) are kept and everything cheap (norms, activations, RoPE,
  elementwise, routing) is recomputed.

Applied per block, inside the block's FSDP unit: during recomputation FSDP has already
gathered the block's parameters for its backward. Recomputation reruns the same kernels on
the same inputs, so the gradients equal those without checkpointing.

Op level and communication: the recomputation takes the saved outputs of the all-to-alls
(expert parallelism's exchange of counts and its two token exchanges, Ulysses' exchanges) and
reduce-scatters instead of sending again, so it issues none of these collectives: none can hang
or be matched with another rank's different one, and the token splits, read with ``.tolist()``
from the recomputed and the saved counts, equal the forward's. What it still reruns is local:
the router (its matmul saved), the sorting of tokens by expert, the combine. The saved ops are
matched by their order alone (``kernels.saving_checkpoint_contexts``): what runs between them
and differs between forward and recomputation (the routed experts' own FSDP unit prefetching
in backward, the ``record_function`` ranges of FSDP, of a profiler and of the MoE time split,
``parallelisms/moe_split.py``) is simply rerun. A block that ``full`` or every-k-th
checkpointing recomputes sends its tokens again, with the forward's splits: every EP rank
recomputes the same layer in the same backward order, and its router chooses from the same
input what it chose in the forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallelisms.model_parts import block_settings, blocks
from parallelisms.torch_private import kernels

_aten = torch.ops.aten
# Ops whose outputs "op" mode keeps: recomputing them costs real FLOPs or communication.
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        *kernels.ATTENTION_OPS,
        kernels.GROUPED_MM,
        kernels.SCALED_MM,
        kernels.REDUCE_SCATTER,
        kernels.ALL_TO_ALL,
    }
)


def _op_contexts():
    return kernels.saving_checkpoint_contexts(SAVED_OPS)


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_option: str) -> None:
    """Set each block's ``checkpoint_fn`` for ``mode`` (``none``, ``full`` or ``selective``)."""
    if mode == "none":
        return
    full = functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
    settings = [block_settings(block) for block in blocks(model).values()]
    if mode == "full":
        for block in settings:
            block.checkpoint_fn = full
        return
    if selective_option == "op":
        op_level = functools.partial(full, context_fn=_op_contexts)
        for block in settings:
            block.checkpoint_fn = op_level
        return
    every = int(selective_option)
    for block in settings:
        if block.layer_id % every == 0:
            block.checkpoint_fn = full
