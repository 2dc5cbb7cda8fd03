"""The one place where the model is parallelised: what composes with what, and in which order.

Applied once, to the model on the meta device, before the training loop:

0. float8 training (``parallelisms/float8.py``: linear layers swapped for torchao's, whose
   weights every step below then splits, gathers and checkpoints as before);
0b. pipeline parallelism (the rank keeps its stages' modules; each stage is a view of them,
   and every step below is applied to each stage);
1. tensor parallelism (splits the parameters into TP DTensors);
1b. expert parallelism (each rank keeps its routed experts; tokens travel all-to-all; under TP
    the MoE runs on each rank's sequence shard, ``parallelisms/tensor_parallel.py``);
2. context parallelism's attention (each block's attention sees the whole sequence's K/V);
3. activation checkpointing (per block);
4. ``torch.compile`` (per block, in place, so parameter names stay the same);
5. FSDP / HSDP (shards whatever the steps above left, last, so it wraps the final modules;
   under EP the experts over the data-parallel and context-parallel ranks outside the EP group
   and the TP ranks; under TP an MoE's router and shared experts over the TP ranks too).

:func:`check` holds every constraint between the settings, the model's shape and the device,
and is meant to run before any process group exists, so a setting that cannot work fails in
seconds rather than hanging a collective. Its errors name the settings by the field names of
:class:`ParallelSettings` and :class:`~parallelisms.parallel_dims.ParallelDims`; the caller
renders them with its own names (see :class:`~parallelisms.parallel_dims.ParallelismError`).

To add a parallelism: its settings go into :class:`ParallelSettings`, its constraints into
:func:`check`, its application into :func:`parallelize`, in its place in the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.context_parallel import ContextParallel, resolve_backend
from parallelisms.expert_parallel import apply_expert_parallel
from parallelisms.float8 import Float8Conversion, Float8Settings, convert_to_float8, tensor_parallel_styles
from parallelisms.fsdp import apply_fsdp
from parallelisms.model_parts import blocks, moe_layers
from parallelisms.parallel_dims import Meshes, ParallelDims, ParallelismError
from parallelisms.pipeline_split import PipelineSplit, check_pipeline, plan_split, split_model
from parallelisms.tensor_parallel import apply_tp
from parallelisms.torch_private.process_group import scope_compile_cache


@dataclass(frozen=True)
class ParallelSettings:
    """How each parallelism is applied, beyond the mesh shape (:class:`ParallelDims`)."""

    seq_len: int
    loss_parallel: bool = True
    """With tp > 1: keep the logits sharded over the vocabulary for the loss."""
    async_tp: bool = False
    cp_backend: str = "auto"
    cp_rotate_method: str = "allgather"
    document_mask: bool = False
    """Attention is masked at the documents packed into a sample (the CP backend must take a mask)."""
    ac_mode: str = "none"
    ac_option: str = "op"
    compile_model: bool = False
    fused_moe_combine: bool = False
    """MoE layers combine their routed rows as compile fuses them (``MoE.fused_combine``): with
    ``compile_model``, and when ``--simulate`` traces a compiled job eagerly."""
    compile_loss: bool = False
    compile_backend: str = "inductor"
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: str = "default"
    ep_overlap_chunks: int = 1
    """Chunks of each MoE layer's tokens whose exchanges overlap the others' experts (``ep`` > 1)."""
    experts_stay_gathered: bool = False
    """The routed experts' unit, over one rank (``Workload.experts_stay_gathered``), is gathered
    once a step and its gradients reduced once, on the last micro-batch."""
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    pp_layers_per_stage: int = -1
    pp_first_stage_less_layers: int = 1
    pp_last_stage_less_layers: int = 1
    pp_rank_batch: int = 1
    """Samples one data-parallel rank trains on per step: the pipeline's batch."""
    float8: Float8Settings | None = None
    """Float8 training of the linear layers (None: off)."""


@dataclass(frozen=True)
class ModelShape:
    """What the constraints need to know about the model."""

    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_layers: int = 1
    n_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    tied_embeddings: bool = False
    """The output projection is the embedding's matrix."""


def check(dims: ParallelDims, settings: ParallelSettings, shape: ModelShape, device_type: str) -> None:
    """Raise :class:`ParallelismError` for the first combination that cannot work."""
    _check_tensor_parallel(dims, settings, shape, device_type)
    _check_context_parallel(dims, settings, shape, device_type)
    _check_experts(dims, settings, shape)
    if dims.pp > 1 and shape.tied_embeddings:
        raise ParallelismError(
            f"{{pp}} = {dims.pp} puts the embedding on the first stage and the output projection on the "
            "last, but this model ties them into one matrix; train it without pipeline parallelism "
            "(FSDP, HSDP, TP and CP compose with the tie)."
        )
    if dims.pp > 1:
        split = pipeline_split(dims, settings, shape.n_layers)
        check_pipeline(
            dims.pp,
            settings.pp_schedule,
            settings.pp_microbatch_size,
            settings.pp_rank_batch,
            split,
            settings.compile_model,
            per_op_checkpointing=settings.ac_mode == "selective" and settings.ac_option == "op",
        )
    if settings.compile_loss and dims.tp > 1 and settings.loss_parallel:
        raise ParallelismError(
            "{compile_loss}: torch.compile does not trace the loss correctly inside "
            "`loss_parallel()` (the gradients come out wrong); with tensor parallelism compile "
            "the model only, or turn {loss_parallel} off."
        )


def _check_tensor_parallel(dims: ParallelDims, settings: ParallelSettings, shape: ModelShape, device_type: str) -> None:
    """Tensor parallelism splits heads, sequence and vocabulary evenly: each must divide by tp."""
    if settings.async_tp:
        if dims.tp == 1:
            raise ParallelismError("{async_tp} needs {tp} > 1.")
        if not settings.compile_model:
            raise ParallelismError("{async_tp} is a torch.compile rewrite: also turn on {compile_model}.")
        if device_type != "cuda":
            raise ParallelismError(
                "{async_tp} needs CUDA (symmetric memory and torch.compile's micro-pipeline "
                "rewrite); turn it off on this machine."
            )
    if dims.tp == 1:
        return
    splits = {
        "attention heads": shape.n_heads,
        "key/value heads": shape.n_kv_heads,
        "tokens per sequence ({seq_len})": settings.seq_len,
        "vocabulary rows": shape.vocab_size,
    }
    for what, size in splits.items():
        if size % dims.tp:
            raise ParallelismError(f"{{tp}} = {dims.tp} does not divide the {size} {what}; choose a tp that does.")


def _check_context_parallel(
    dims: ParallelDims, settings: ParallelSettings, shape: ModelShape, device_type: str
) -> None:
    """Head-tail sharding needs 2 x cp equal chunks, each split again by sequence-parallel TP;
    Ulysses splits each TP rank's heads over cp."""
    if dims.cp == 1:
        return
    backend = resolve_backend(settings.cp_backend, device_type, settings.document_mask)
    multiple = 2 * dims.cp * dims.tp
    if settings.seq_len % multiple:
        raise ParallelismError(
            f"{{seq_len}} = {settings.seq_len} must be divisible by 2 x {{cp}} x {{tp}} = {multiple} "
            f"(every sequence is cut into 2 x cp load-balanced chunks, each split over tp); use a "
            f"multiple of {multiple}."
        )
    if backend == "ring" and device_type != "cuda":
        raise ParallelismError(
            '{cp_backend} = "ring" needs CUDA (PyTorch\'s context parallelism has no CPU kernels); '
            'use "allgather_kv" or "auto".'
        )
    if backend == "ring" and settings.document_mask:
        raise ParallelismError(
            '{cp_backend} = "ring" (PyTorch\'s ring attention) takes no attention mask, so it '
            'cannot keep packed documents apart under {document_mask}; use "allgather_kv" or '
            '"auto" (which picks it), or turn document masking off.'
        )
    if backend == "ulysses" and shape.n_heads % (dims.cp * dims.tp):
        raise ParallelismError(
            f'{{cp_backend}} = "ulysses" splits each tensor-parallel rank\'s attention heads over the '
            f"context-parallel ranks, but {{cp}} x {{tp}} = {dims.cp} x {dims.tp} does not divide the "
            f"model's {shape.n_heads} heads; choose degrees whose product divides {shape.n_heads}, or "
            f'use {{cp_backend}} = "allgather_kv".'
        )
    if backend != "ring" and settings.cp_rotate_method != "allgather":
        raise ParallelismError(
            f"{{cp_rotate_method}} applies to the ring backend only; the {backend} backend moves keys "
            'and values its own way. Remove the setting or use {cp_backend} = "ring" on CUDA.'
        )


def _check_experts(dims: ParallelDims, settings: ParallelSettings, shape: ModelShape) -> None:
    """Expert parallelism needs experts to split; MoE models compose with FSDP, HSDP, EP, TP, CP,
    PP, accumulation, activation checkpointing and compile."""
    if dims.ep > 1 and not shape.n_experts:
        raise ParallelismError(
            f'{{ep}} = {dims.ep} needs a Mixture-of-Experts model: set {{model_name}} = "moe" or "deepseek_v3".'
        )
    if shape.n_experts % dims.ep:
        raise ParallelismError(
            f"{{ep}} = {dims.ep} does not divide the model's {shape.n_experts} experts; choose an ep that does."
        )


def pipeline_split(dims: ParallelDims, settings: ParallelSettings, n_layers: int) -> PipelineSplit:
    return plan_split(
        n_layers,
        dims.pp,
        settings.pp_schedule,
        settings.pp_layers_per_stage,
        settings.pp_first_stage_less_layers,
        settings.pp_last_stage_less_layers,
    )


@dataclass
class Parallelized:
    """What the loop needs besides the model: the context-parallel sharder (None without CP),
    and under pipeline parallelism this rank's stage modules and the split (else None)."""

    context_parallel: ContextParallel | None
    stage_modules: list[nn.Module] | None = None
    split: PipelineSplit | None = None
    float8: Float8Conversion | None = None
    """Which linear layers of the whole model train in float8 (None: float8 is off)."""


def parallelize(
    model: nn.Module, meshes: Meshes, dims: ParallelDims, settings: ParallelSettings, device_type: str
) -> Parallelized:
    """Apply every parallelism to ``model`` (on the meta device) in order.

    Under pipeline parallelism ``model`` keeps only this rank's stages' modules, and each
    stage view gets the steps below as a whole model would.
    """
    if settings.compile_model or settings.compile_loss:
        scope_compile_cache()
    float8 = convert_to_float8(model, settings.float8) if settings.float8 else None
    split = pipeline_split(dims, settings, len(blocks(model))) if dims.pp > 1 else None
    parts = split_model(model, split, meshes.pp.get_local_rank()) if split else [model]
    context_parallel = None
    if dims.cp > 1:
        context_parallel = ContextParallel(
            meshes.cp,
            settings.seq_len,
            backend=resolve_backend(settings.cp_backend, device_type, settings.document_mask),
            rotate_method=settings.cp_rotate_method,
        )
    for part in parts:
        if dims.tp > 1:
            apply_tp(
                part,
                meshes.tp,
                loss_parallel=settings.loss_parallel,
                async_tp=settings.async_tp,
                styles=tensor_parallel_styles(settings.float8),
            )
        if meshes.ep is not None:
            apply_expert_parallel(part, meshes.ep, meshes.expert_checkpoint, settings.ep_overlap_chunks)
        if context_parallel:
            context_parallel.apply(part)
        apply_activation_checkpointing(part, settings.ac_mode, settings.ac_option)
        for moe in moe_layers(part):
            moe.fused_combine = settings.fused_moe_combine
        if settings.compile_model:
            for block in blocks(part).values():
                block.compile(backend=settings.compile_backend)  # in place, so parameter names stay the same
        apply_fsdp(
            part,
            meshes.fsdp,
            param_dtype=settings.param_dtype,
            reduce_dtype=settings.reduce_dtype,
            reshard_after_forward=settings.reshard_after_forward,
            expert_mesh=meshes.expert_fsdp,
            experts_stay_gathered=settings.experts_stay_gathered,
            replicated_mesh=meshes.replicated_fsdp if dims.tp > 1 else None,
        )
    return Parallelized(context_parallel, parts if split else None, split, float8)
