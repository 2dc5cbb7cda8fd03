"""What a config resolves to on a world size, checked before any process group exists.

A mistake in the config, the mesh or the tokenizer must fail in seconds with a message naming
the key, never hang a collective: :func:`plan` resolves the mesh shape, the model's shape, the
number of micro-batches and the parallelism settings, and runs every check that needs the world
size. The parallelisms' own constraints live beside them (``parallelisms/parallelize.py``); here
their errors are rendered with the config keys the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.parallel_dims import ParallelDims, ParallelismError, device_type
from parallelisms.parallelize import ModelShape, ParallelSettings, check
from trainer.config import ConfigError, JobConfig, resolve_path
from trainer.dump_folder import check_dump_folder
from trainer.model.llama3 import ModelArgs, model_args
from trainer.data.tokenizer import Tokenizer

SETTING_KEYS = {
    "dp_replicate": "`parallelism.data_parallel_replicate_degree`",
    "dp_shard": "`parallelism.data_parallel_shard_degree`",
    "cp": "`parallelism.context_parallel_degree`",
    "tp": "`parallelism.tensor_parallel_degree`",
    "seq_len": "`training.seq_len`",
    "async_tp": "`parallelism.enable_async_tensor_parallel`",
    "loss_parallel": "loss parallel (`parallelism.disable_loss_parallel`)",
    "compile_model": "`compile.enable` with `model` in `compile.components`",
    "compile_loss": "`compile.components` including `loss`",
    "cp_backend": "`parallelism.context_parallel_backend`",
    "cp_rotate_method": "`parallelism.context_parallel_rotate_method`",
}
"""How the parallelisms' setting names read to a user: the config keys that set them."""


@dataclass
class Plan:
    """The config resolved for one world size."""

    config: JobConfig
    dims: ParallelDims
    parallel: ParallelSettings
    microbatches: int
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation)."""
    global_batch_size: int
    model_args: ModelArgs
    tokenizer: Tokenizer


def plan(config: JobConfig, world_size: int) -> Plan:
    """Validate ``config`` against ``world_size``; raise :class:`ConfigError` naming the key."""
    parallelism, training = config.parallelism, config.training
    try:
        dims = ParallelDims(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            world_size=world_size,
        )
    except ParallelismError as e:
        raise ConfigError(e.render(SETTING_KEYS)) from None
    per_microbatch = training.local_batch_size * dims.dp
    global_batch = per_microbatch if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"`training.global_batch_size` = {global_batch} is not divisible by "
            f"`training.local_batch_size` x data-parallel degree = {training.local_batch_size} x {dims.dp} = "
            f"{per_microbatch}; gradient accumulation needs a whole number of micro-batches. "
            f"Use a multiple of {per_microbatch}."
        )
    tokenizer = Tokenizer(resolve_path(config.model.tokenizer_path))
    try:
        args = model_args(config.model.flavor, tokenizer.vocab_size, training.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    settings = parallel_settings(config, dims)
    try:
        check(dims, settings, ModelShape(args.n_heads, args.kv_heads, args.vocab_size), device_type())
    except ParallelismError as e:
        raise ConfigError(e.render(SETTING_KEYS)) from None
    if config.profiling.enable_memory_snapshot and device_type() != "cuda":
        raise ConfigError("`profiling.enable_memory_snapshot` records the CUDA allocator: it needs a GPU.")
    check_dump_folder(config.job.dump_folder)
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"`checkpoint.create_seed_checkpoint` runs on one process, not {world_size}: launch it with NGPU=1."
        )
    return Plan(config, dims, settings, global_batch // per_microbatch, global_batch, args, tokenizer)


def parallel_settings(config: JobConfig, dims: ParallelDims) -> ParallelSettings:
    parallelism, compile_config = config.parallelism, config.compile
    return ParallelSettings(
        seq_len=config.training.seq_len,
        loss_parallel=dims.tp > 1 and not parallelism.disable_loss_parallel,
        async_tp=parallelism.enable_async_tensor_parallel,
        cp_backend=parallelism.context_parallel_backend,
        cp_rotate_method=parallelism.context_parallel_rotate_method,
        ac_mode=config.activation_checkpoint.mode,
        ac_option=config.activation_checkpoint.selective_ac_option,
        compile_model=compile_config.enable and "model" in compile_config.components,
        compile_loss=compile_config.enable and "loss" in compile_config.components,
        param_dtype=param_dtype(config.training.mixed_precision_param, device_type()),
        reduce_dtype=getattr(torch, config.training.mixed_precision_reduce),
        reshard_after_forward=parallelism.fsdp_reshard_after_forward,
    )


def param_dtype(setting: str, device: str) -> torch.dtype:
    """``training.mixed_precision_param``, with ``auto`` resolved: bf16 on GPU, fp32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, setting)
