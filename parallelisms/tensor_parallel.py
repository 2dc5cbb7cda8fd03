"""Tensor parallelism for Llama 3, with sequence parallelism and a vocabulary-parallel loss.

The plan below is the whole design. Between blocks the residual stream is sharded on the
sequence dimension (``Shard(1)``): norms run on a slice of the tokens. Attention and the
feed-forward all-gather the sequence on the way in, split heads / hidden units column-wise, and
reduce-scatter back to sequence shards on the way out (``wo``, ``w2`` row-wise). The output
projection is column-wise too: each rank computes the logits of its slice of the vocabulary,
and the cross-entropy runs on those slices inside ``loss_parallel()``, so the
``batch x seq x vocab`` logits are never gathered.

A Mixture-of-Experts block (``trainer/model/moe.py``) runs its feed-forward *sequence-parallel*,
as torchtitan does: the MoE gets this rank's sequence shard as a plain tensor and every TP rank
routes its own tokens. Nothing in it is split by TP: the router and the shared experts are
replicated and run on the local tokens, the routed experts are expert-parallel over
``dp_shard x cp`` (``parallelisms/expert_parallel.py``) and every TP rank sends its own tokens
to them (without EP they are replicated like the router). Its output is the sequence shard the
residual stream holds, so no collective is added. The gradients of those replicated parameters
differ between TP ranks (each saw other tokens) and are summed over TP by FSDP, which shards
them over a mesh that includes ``tp`` (``Meshes.replicated_fsdp``, ``Meshes.expert_fsdp``).

Applied before FSDP: FSDP then shards the tensor-parallel DTensors over its own mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from parallelisms.model_parts import blocks, is_moe, retie_ends, tied_ends
from parallelisms.torch_private import dtensor, kernels


class EmbeddingParallel(RowwiseParallel):
    """The token embedding, row-wise over the vocabulary, handing out a *copy* of its sequence shard.

    ``RowwiseParallel`` returns a view of the reduce-scattered DTensor's local part. FSDP warns
    about module outputs that are views (an in-place op on one would skip its backward hook),
    and a compiled block traces a view input back to its base, so the gradient would reach the
    base and skip FSDP's hook: the embedding would get no gradient at all. One copy of a
    ``(batch, seq / tp, dim)`` activation per micro-batch avoids both.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = dtensor.rowwise_output(output_layouts, use_local_output, mod, outputs, device_mesh)
        return outputs.clone() if use_local_output else outputs


class OutputParallel(ColwiseParallel):
    """``ColwiseParallel`` for an output projection that may return its summed loss instead of
    logits (given the labels): a scalar passes the output hook as it is, a replicated DTensor."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.ndim == 0:
            return outputs
        return dtensor.colwise_output(output_layouts, use_local_output, mod, outputs, device_mesh)


def llama3_tp_plan(loss_parallel: bool, styles: Mapping[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """Module name pattern -> how its parameters and activations are split over TP ranks; each
    block's feed-forward follows :func:`feed_forward_plan`. ``styles``: the ``colwise``,
    ``rowwise`` and ``prepare`` styles of the blocks' linear layers, when float8 training has
    its own (``parallelisms/float8.py``)."""
    styles = styles or {}
    colwise = styles.get("colwise", ColwiseParallel)
    rowwise = styles.get("rowwise", RowwiseParallel)
    prepare = styles.get("prepare", PrepareModuleInput)
    return {
        "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": prepare(
            input_layouts=(Shard(1), None, None),  # (hidden states, RoPE table, document mask)
            desired_input_layouts=(Replicate(), None, None),
        ),
        "layers.*.attention.wq": colwise(),
        "layers.*.attention.wk": colwise(),
        "layers.*.attention.wv": colwise(),
        "layers.*.attention.wo": rowwise(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "norm": SequenceParallel(),
        "output": OutputParallel(
            input_layouts=Shard(1),
            # Loss parallel keeps the logits a vocabulary-sharded DTensor for the loss.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def feed_forward_plan(moe: bool, styles: Mapping[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """A block's feed-forward: the dense SwiGLU column- then row-wise, a mixture of experts on
    its own sequence shard (see the module docstring); ``styles`` as for :func:`llama3_tp_plan`."""
    styles = styles or {}
    colwise = styles.get("colwise", ColwiseParallel)
    rowwise = styles.get("rowwise", RowwiseParallel)
    if moe:
        return {
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
        }
    return {
        "feed_forward": styles.get("prepare", PrepareModuleInput)(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    async_tp: bool,
    styles: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Split ``model``'s parameters over ``tp_mesh`` in place (before FSDP) and return it.

    Async TP overlaps the all-gathers and reduce-scatters with the matmuls that consume them;
    it is a graph rewrite of ``torch.compile`` on CUDA symmetric memory, so it takes effect in
    the compiled blocks (``parallelize`` requires compiling the model with it).
    """
    # A pipeline stage may lack the embedding or the norm and output (None): skip their entries.
    plan = {
        k: v for k, v in llama3_tp_plan(loss_parallel, styles).items() if getattr(model, k.split(".")[0]) is not None
    }
    tied = tied_ends(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:  # both split over the vocabulary, Shard(0): the embedding's DTensor serves both
        retie_ends(model)
    for block in blocks(model).values():
        parallelize_module(block, tp_mesh, feed_forward_plan(is_moe(block.get_submodule("feed_forward")), styles))
    if async_tp:
        kernels.enable_async_tp(tp_mesh.get_group())
    return model


def loss_context(enabled: bool) -> AbstractContextManager[None]:
    """Where forward and backward of the loss must run: ``loss_parallel()`` with a sharded vocabulary."""
    return loss_parallel() if enabled else contextlib.nullcontext()
