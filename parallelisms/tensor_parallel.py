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

DeepSeek's multi-head latent attention (``trainer/model/mla.py``) splits its heads as Llama's
attention does, but its down-projections to the query and key/value latents (``wq_a``, ``wkv_a``)
and their norms are shared by every head: they are replicated, and every TP rank computes them
on the gathered sequence (they are narrow: ``dim`` -> 1536 and 576 for the 671B). Each rank's
heads then give those latents, and the input, only a *share* of their gradient: the heads'
up-projections (``wq_b``, ``wkv_b``) take the normalised latents as a replicated DTensor whose
gradient comes back as that share (:class:`LatentOutput`), the down-projections take the gathered
input as a plain tensor whose gradient is declared a partial sum (:class:`LatentInput`), and the
backward's reduce-scatter to sequence shards sums the shares of the input with the heads'. The
replicated weights' gradients are shares too, summed over TP by FSDP like the MoE's router. So the
latent attention costs the collectives of Llama's, with no all-reduce of a latent.

Applied before FSDP: FSDP then shards the tensor-parallel DTensors over its own mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
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


class _ShareOfReplica(torch.autograd.Function):
    """A replicated activation as a ``Replicate`` DTensor whose gradient returns as this rank's share."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.mesh = mesh
        return DTensor.from_local(local, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:
        # The heads' column-wise backward gives a partial sum. A replicated gradient (what a
        # compiled block's backward is traced with) is split into equal shares.
        if grad.placements[0].is_partial():
            return grad.to_local(), None
        return grad.to_local() / ctx.mesh.size(), None


class LatentInput(ParallelStyle):
    """A replicated down-projection fed the gathered sequence (a ``Replicate`` DTensor) as a plain
    tensor, whose gradient is this rank's share: a ``Partial`` sum, reduce-scattered with the rest."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def local(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (args[0].to_local(grad_placements=(Partial(),)), *args[1:])

        module.register_forward_pre_hook(local)
        return module


class LatentOutput(ParallelStyle):
    """A replicated latent norm whose output the heads' column-wise up-projection takes as a
    ``Replicate`` DTensor, handing back this rank's share of its gradient (no all-reduce)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shared(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> DTensor:
            return _ShareOfReplica.apply(output, device_mesh)

        module.register_forward_hook(shared)
        return module


def llama3_tp_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Module name -> how the model's ends are split over TP ranks; each block follows
    :func:`block_plan`."""
    return {
        "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": OutputParallel(
            input_layouts=Shard(1),
            # Loss parallel keeps the logits a vocabulary-sharded DTensor for the loss.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def block_plan(block: nn.Module, styles: Mapping[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """A block's modules by name -> their split: the norms sequence-parallel, the attention
    (:func:`attention_plan`) and the feed-forward (:func:`feed_forward_plan`). ``styles``: the
    ``colwise``, ``rowwise`` and ``prepare`` styles of the blocks' linear layers, when float8
    training has its own (``parallelisms/float8.py``)."""
    return {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        **attention_plan(block.get_submodule("attention"), styles),
        **feed_forward_plan(is_moe(block.get_submodule("feed_forward")), styles),
    }


def attention_plan(attention: nn.Module, styles: Mapping[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """Heads split column-wise in and row-wise out, on the sequence all-gathered on the way in and
    reduce-scattered on the way out; a latent attention's shared latents as the module docstring
    says (replicated, their gradients shares)."""
    styles = styles or {}
    colwise = styles.get("colwise", ColwiseParallel)
    rowwise = styles.get("rowwise", RowwiseParallel)
    prepare = styles.get("prepare", PrepareModuleInput)
    gathered = {
        "attention": prepare(
            input_layouts=(Shard(1), None, None),  # (hidden states, RoPE table, document mask)
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wo": rowwise(output_layouts=Shard(1)),
    }
    if not hasattr(attention, "wkv_a"):
        return {**gathered, "attention.wq": colwise(), "attention.wk": colwise(), "attention.wv": colwise()}
    if hasattr(attention, "wq_a"):
        queries = {"attention.wq_a": LatentInput(), "attention.q_norm": LatentOutput(), "attention.wq_b": colwise()}
    else:  # no query latent (q_lora_rank 0): the queries come straight from the gathered input
        queries = {"attention.wq": colwise()}
    return {
        **gathered,
        **queries,
        "attention.wkv_a": LatentInput(),
        "attention.kv_norm": LatentOutput(),
        "attention.wkv_b": colwise(),
    }


def feed_forward_plan(moe: bool, styles: Mapping[str, Any] | None = None) -> dict[str, ParallelStyle]:
    """A block's feed-forward: the dense SwiGLU column- then row-wise, a mixture of experts on
    its own sequence shard (see the module docstring); ``styles`` as for :func:`block_plan`."""
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
    plan = {k: v for k, v in llama3_tp_plan(loss_parallel).items() if getattr(model, k) is not None}
    tied = tied_ends(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:  # both split over the vocabulary, Shard(0): the embedding's DTensor serves both
        retie_ends(model)
    for block in blocks(model).values():
        parallelize_module(block, tp_mesh, block_plan(block, styles))
    if async_tp:
        kernels.enable_async_tp(tp_mesh.get_group())
    return model


def loss_context(enabled: bool) -> AbstractContextManager[None]:
    """Where forward and backward of the loss must run: ``loss_parallel()`` with a sharded vocabulary."""
    return loss_parallel() if enabled else contextlib.nullcontext()
