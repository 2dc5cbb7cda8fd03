"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Modes (``[activation_checkpoint]``):

- ``full``: every transformer block keeps only its input; its whole forward reruns in backward.
- ``selective`` with ``selective_ac_option = "k"`` (an integer): full checkpointing of every
  k-th block only (blocks 0, k, 2k, ...), trading memory for less recomputation.
- ``selective`` with ``selective_ac_option = "op"``: in every block, the outputs of the
  expensive ops (matmuls, attention, tensor-parallel reduce-scatters) are kept and everything
  cheap (norms, activations, RoPE, elementwise) is recomputed.

Applied per block, inside the block's FSDP unit: during recomputation FSDP has already
gathered the block's parameters for its backward. Recomputation reruns the same kernels on
the same inputs, so the gradients equal those without checkpointing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallelisms.model_parts import block_settings, blocks
from parallelisms.torch_private import kernels

_aten = torch.ops.aten
# Ops whose outputs "op" mode keeps: recomputing them costs real FLOPs or communication.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    *kernels.ATTENTION_OPS,
    kernels.REDUCE_SCATTER,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


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
