"""FSDP2 and HSDP: shard the parameters over the data-parallel ranks.

Units, inner to outer: the token embedding, each transformer block, the final norm with the
output projection, then the root (which owns whatever is left: both ends, when the output is
tied to the embedding). The model is expected to have
torchtitan's Llama module names: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``,
``output``. On a 2-D ``(dp_replicate, dp_shard_cp)`` mesh ``fully_shard`` is HSDP:
reduce-scatter inside a replica, all-reduce across replicas.

Gradient reduction is a pure **sum** on every unit: the number of tokens a gradient should be
divided by is only known after counting valid labels over all ranks, and ``GradAccumulator``
owns that division. FSDP's default would divide by the data-parallel size, which is exact only
when every rank holds the same number of valid tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from parallelisms.model_parts import blocks, end, moe_layers, tied_ends


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    expert_mesh: DeviceMesh | None = None,
    experts_stay_gathered: bool = False,
    replicated_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP, 2-D: HSDP) and return it.

    ``expert_mesh``: under expert parallelism each MoE layer's routed experts are a unit of their
    own, sharded over the data-parallel ranks outside the EP group
    (``parallelisms/expert_parallel.py``). ``experts_stay_gathered``: that unit spans one rank,
    so it is not resharded after forward (``GradAccumulator`` keeps it gathered through the step).

    ``replicated_mesh``: under tensor parallelism each MoE layer's router and shared experts
    (and its routed experts without EP), replicated over TP ranks that feed them different
    tokens, are a unit over ``mesh`` with ``tp`` folded in, so that their gradients are summed
    over TP as well (``parallelisms/tensor_parallel.py``). So are the parts of each attention that
    TP replicates (:func:`replicated_over_tp`).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(module: nn.Module | list[nn.Module], reshard: bool, over: DeviceMesh = mesh) -> None:
        sharded = fully_shard(module, mesh=over, mp_policy=mp_policy, reshard_after_forward=reshard)
        # Over one rank FSDP's reduction is a copy, already a sum; a divide factor, even 1,
        # would add a division of every gradient by it, each micro-batch.
        if over.size() > 1:
            make_reduction_a_sum(sharded if isinstance(sharded, FSDPModule) else sharded[0])

    never = reshard_after_forward == "never"
    tok_embeddings, norm, output = end(model, "tok_embeddings"), end(model, "norm"), end(model, "output")
    # A tied matrix must be one unit's: the root's, gathered from the embedding to the output.
    tied = tied_ends(model)
    if tok_embeddings is not None and not tied:  # a pipeline stage may hold neither end of the model
        shard(tok_embeddings, not never)
    units = list(blocks(model).values())
    if expert_mesh is not None:
        for moe in moe_layers(model):
            reshard = not (never or experts_stay_gathered)
            shard(moe.experts, reshard, expert_mesh)
    if replicated_mesh is not None:
        for moe in moe_layers(model):
            # Without expert parallelism the routed experts are replicated over TP as well.
            experts = None if expert_mesh is not None else moe.experts
            replicated = [m for m in (moe.router, moe.shared_experts, experts) if m is not None]
            shard(replicated, not never, replicated_mesh)
        for block in units:
            if replicated := replicated_over_tp(block.get_submodule("attention")):
                shard(replicated, not never, replicated_mesh)
    for i, block in enumerate(units):
        # The last block's backward starts right after forward, so freeing it is wasted work.
        last = i == len(units) - 1
        shard(block, reshard_after_forward == "always" or (not never and not last))
    # norm and output run last in forward and first in backward: resharding them buys nothing.
    if output is not None and not tied:
        assert norm is not None  # a stage holds norm and output together
        shard([norm, output], reshard_after_forward == "always")
    shard(model, reshard_after_forward == "always")
    return model


def replicated_over_tp(attention: nn.Module) -> list[nn.Module]:
    """The attention's modules that tensor parallelism left whole (no DTensor parameter): each TP
    rank's gradient of them is a share, from its own heads. Qwen3's per-head QK-norms; the latent
    attention's down-projections and latent norms."""
    return [
        module
        for module in attention.children()
        if any(True for _ in module.parameters()) and not any(isinstance(p, DTensor) for p in module.parameters())
    ]


def make_reduction_a_sum(module: FSDPModule) -> None:
    """Reduce gradients with SUM, dividing by nothing.

    ``set_gradient_divide_factor`` applies to one unit only (it is not recursive), and without
    forced sum reduction FSDP would use ``PREMUL_SUM``, which gloo does not have.
    """
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
