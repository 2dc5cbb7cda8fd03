"""Float8 training as the job resolves it: the settings ``parallelisms/float8.py`` applies, from the
config's ``model.converters`` and ``[float8]``, and the combinations refused before any process
group exists, each naming its key: what torchao cannot do, what the job's backend cannot move
(gloo on a CPU, NCCL planned for a GPU), a ``float8.filter_fqns`` that keeps nothing, and on a
GPU the shapes ``torch._scaled_mm`` cannot take (``parallelisms/float8_kernels.py``)."""

from __future__ import annotations

import torch
from torch import nn

from parallelisms.float8 import (
    Float8Conversion,
    Float8Settings,
    check_backend,
    check_filters,
    check_float8,
    convertible,
)
from parallelisms.float8_kernels import check_kernel_shapes
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.parallelize import ParallelSettings
from trainer.config import ConfigError, JobConfig
from trainer.model.llama3 import ModelArgs, Transformer

FLOAT8_KEYS = {
    "float8": '`model.converters` = ["float8"]',
    "float8_recipe": "`float8.recipe_name`",
    "float8_all_gather": "`float8.enable_fsdp_float8_all_gather`",
    "float8_precompute": "`float8.precompute_float8_dynamic_scale_for_fsdp`",
    "float8_experts": "`float8.moe_experts`",
    "float8_filter": "`float8.filter_fqns`",
    "model_name": "`model.name`",
    "tp": "`parallelism.tensor_parallel_degree`",
    "cp": "`parallelism.context_parallel_degree`",
    "seq_len": "`training.seq_len`",
    "local_batch": "`training.local_batch_size`",
    "pp_microbatch": "`parallelism.pipeline_parallel_microbatch_size`",
}


def float8_settings(config: JobConfig, device: str) -> Float8Settings | None:
    """What ``[float8]`` asks for when ``model.converters`` holds ``float8``, on ``device``; else None."""
    if "float8" not in config.model.converters:
        return None
    float8 = config.float8
    return Float8Settings(
        recipe=float8.recipe_name,
        fsdp_float8_all_gather=float8.enable_fsdp_float8_all_gather,
        precompute_scales=float8.precompute_float8_dynamic_scale_for_fsdp,
        filter_fqns=tuple(float8.filter_fqns),
        experts=float8.moe_experts,
        emulate=device != "cuda",
    )


def check_float8_job(config: JobConfig, settings: ParallelSettings, n_experts: int, device: str) -> None:
    """Raise :class:`ConfigError` for a float8 setting that cannot work on this job."""
    if settings.float8 is None:
        return
    try:
        check_float8(
            settings.float8,
            n_experts=n_experts,
            device_type=device,
        )
    except ParallelismError as e:
        raise ConfigError(e.render(FLOAT8_KEYS)) from None


def check_float8_backend(settings: ParallelSettings, dims: ParallelDims, backend: str) -> None:
    """:func:`~parallelisms.float8.check_backend`, naming the keys; before the process group starts,
    for the backend the job would run on (``job_backend``)."""
    try:
        check_backend(settings.float8, dims.dp_shard, backend, dims.tp)
    except ParallelismError as e:
        raise ConfigError(e.render(FLOAT8_KEYS)) from None


def job_backend(device: str) -> str:
    """The collectives' backend of a job on ``device``: NCCL on a GPU (planned from anywhere), gloo else."""
    return "nccl" if device == "cuda" else "gloo"


def check_float8_model(settings: ParallelSettings, dims: ParallelDims, args: ModelArgs, local_batch_size: int) -> None:
    """What float8 needs of the model's linear layers, on the whole model built on the meta device:
    each ``float8.filter_fqns`` entry keeping one in high precision, and on a GPU shapes that
    ``torch._scaled_mm`` takes (a micro-batch's tokens on a rank, the tensor-parallel shards)."""
    float8 = settings.float8
    if float8 is None or (float8.emulate and not float8.filter_fqns):
        return
    with torch.device("meta"):
        model = Transformer(args)
    micro = settings.pp_microbatch_size if dims.pp > 1 else local_batch_size
    tokens_are = f"{{seq_len}} = {settings.seq_len} x {'{pp_microbatch}' if dims.pp > 1 else '{local_batch}'} = {micro}"
    tokens_are += f" / {{cp}} = {dims.cp}" if dims.cp > 1 else ""
    try:
        check_filters(model, float8.filter_fqns)
        check_kernel_shapes(model, float8, micro * settings.seq_len // dims.cp, dims.tp, tokens_are)
    except ParallelismError as e:
        raise ConfigError(e.render(FLOAT8_KEYS)) from None


def float8_lines(settings: ParallelSettings, args: ModelArgs) -> list[str]:
    """``--dry-run``'s float8 line: the recipe, how its matmuls run here, and which linear layers
    it converts (on the whole model built on the meta device, as the run converts them)."""
    float8 = settings.float8
    if float8 is None:
        return []
    with torch.device("meta"):
        model = Transformer(args)
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = tuple(fqn for fqn, m in linears if convertible(fqn, m, float8.filter_fqns))
    conversion = Float8Conversion(converted, tuple(fqn for fqn, _ in linears))
    how = "emulated (float32 matmuls of float8-rounded operands)" if float8.emulate else "torch._scaled_mm"
    gather = "; FSDP all-gathers the weights in float8" if float8.fsdp_float8_all_gather else ""
    experts = "; routed experts by torchao's float8 grouped matmul" if float8.experts else ""
    return [f"float8: recipe {float8.recipe}, {how}{gather}{experts}; {conversion.describe()}"]
