"""Float8 training as the job resolves it: the settings ``parallelisms/float8.py`` applies, from the
config's ``model.converters`` and ``[float8]``, and the combinations refused before any process
group exists, each naming its key."""

from __future__ import annotations

from parallelisms.float8 import Float8Settings, check_backend, check_float8
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.parallelize import ParallelSettings
from trainer.config import ConfigError, JobConfig

FLOAT8_KEYS = {
    "float8": '`model.converters` = ["float8"]',
    "float8_recipe": "`float8.recipe_name`",
    "float8_all_gather": "`float8.enable_fsdp_float8_all_gather`",
    "float8_precompute": "`float8.precompute_float8_dynamic_scale_for_fsdp`",
    "float8_experts": "`float8.moe_experts`",
    "model_name": "`model.name`",
    "tp": "`parallelism.tensor_parallel_degree`",
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
    """:func:`~parallelisms.float8.check_backend`, naming the keys; before the process group starts."""
    try:
        check_backend(settings.float8, dims.dp_shard, backend, dims.tp)
    except ParallelismError as e:
        raise ConfigError(e.render(FLOAT8_KEYS)) from None
