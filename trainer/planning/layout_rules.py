"""What ``debug.layout_invariant`` cannot be combined with, checked before any process group exists
(``trainer/planning/job_plan.py`` resolves the job; ``trainer/step/layout_invariant.py`` is the mode itself)."""

from __future__ import annotations

import torch

from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import ParallelSettings
from trainer.config import ConfigError, JobConfig


def check_layout_invariant(config: JobConfig, dims: ParallelDims, settings: ParallelSettings) -> None:
    """``debug.layout_invariant`` promises the same bits on every data-parallel layout: refuse what
    splits a micro-batch's arithmetic over ranks, or adds or updates in an order of its own."""
    if not config.debug.layout_invariant:
        return
    refused = [
        (
            dims.tp > 1,
            f"`parallelism.tensor_parallel_degree` = {dims.tp}",
            "tensor parallelism splits each matmul's sum over ranks",
        ),
        (
            dims.cp > 1,
            f"`parallelism.context_parallel_degree` = {dims.cp}",
            "context parallelism splits attention and its gradients over ranks",
        ),
        (
            dims.ep > 1,
            f"`parallelism.expert_parallel_degree` = {dims.ep}",
            "each expert's matmul takes the tokens routed to it from several ranks at once, in a shape and order "
            "the layout decides",
        ),
        (
            dims.pp > 1,
            f"`parallelism.pipeline_parallel_degree` = {dims.pp}",
            "the pipeline schedule cuts micro-batches of its own and accumulates their gradients itself",
        ),
        (
            settings.compile_model or settings.compile_loss,
            "`compile.enable`",
            "compiled kernels are not checked to give the same bits on every layout",
        ),
        (
            settings.reduce_dtype != torch.float32,
            f"`training.mixed_precision_reduce` = {config.training.mixed_precision_reduce}",
            "the layout-invariant sums are float32",
        ),
        (
            config.training.defer_gradient_reduction,
            "`training.defer_gradient_reduction`",
            "the layout-invariant mode sends each micro-batch's gradient to its owners itself",
        ),
        (
            settings.float8 is not None and settings.float8.fsdp_float8_all_gather,
            "`float8.enable_fsdp_float8_all_gather`",
            "the mode takes each gradient from FSDP's unsharded parameters, which the float8 all-gather makes "
            "float8 tensors of; that path has run on no machine (gloo cannot move float8)",
        ),
        (
            config.optimizer.implementation == "fused",
            '`optimizer.implementation` = "fused"',
            'the fused AdamW\'s update of an element depends on where it lies in its shard (use "foreach" or "auto")',
        ),
    ]
    for on, key, why in refused:
        if on:
            raise ConfigError(f"`debug.layout_invariant` cannot be combined with {key}: {why}; turn one of them off.")
