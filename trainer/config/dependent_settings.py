"""Settings that act only when another setting turns their feature on, or only on some layouts:
one table, checked as the config loads. A setting that would change nothing is refused in one
line naming it, why and the fix, so that a run never prints as set what it does not do; except a
config file's setting for a feature the command line turns off, which the file keeps for when the
feature is on again (``--validation.enable=false`` on a file whose ``[validation]`` is set)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from trainer.config.choices import MOE_FAMILIES
from trainer.config.fields import FloatList, StrList
from trainer.config.schema import FIELDS, JobConfig
from trainer.runtime.errors import ConfigError

Unused = tuple[str, str] | None
"""Why a setting changes nothing in this config and what would make it act (empty: nothing but
other settings); None where it acts."""


@dataclass(frozen=True)
class Dependent:
    """Settings that change nothing where ``unused`` says why."""

    keys: tuple[str, ...]
    unused: Callable[[JobConfig], Unused]


def _section(name: str) -> tuple[str, ...]:
    return tuple(key for key in FIELDS if key.startswith(name + "."))


def _float8(c: JobConfig) -> Unused:
    if "float8" in c.model.converters:
        return None
    return "`model.converters` does not hold `float8`", "Add it (`--model.converters float8`)"


def _dense(c: JobConfig) -> Unused:
    if c.model.name in MOE_FAMILIES:
        return None
    return (
        f"`model.name` = {c.model.name!r} is dense, with no experts to balance",
        'Set `model.name` = "moe" or "deepseek_v3"',
    )


def _balance_loss(c: JobConfig) -> Unused:
    if c.moe.balance_loss_weight > 0:
        return None
    return "the balancing loss is off (`moe.balance_loss_weight` = 0)", "Set `moe.balance_loss_weight` above 0"


def _held_forwards(c: JobConfig) -> Unused:
    """Only exact balancing holds forwards or pre-passes; holding them needs full checkpointing,
    no pipeline and the loss in chunks (``Workload.holds_forwards``)."""
    moe, parallelism = c.moe, c.parallelism
    if moe.balance_loss_scope != "global_batch" or moe.balance_loss_weight <= 0:
        return (
            "only the `global_batch` balancing loss (`moe.balance_loss_scope` = 'global_batch', "
            "`moe.balance_loss_weight` above 0) counts the step's routing before its backwards",
            "",
        )
    if moe.held_forwards == "prepass":
        return None
    if c.activation_checkpoint.mode != "full":
        return (
            f"held forwards need full activation checkpointing, and `activation_checkpoint.mode` = "
            f"{c.activation_checkpoint.mode!r} would keep every micro-batch's activations",
            'Set `activation_checkpoint.mode` = "full"',
        )
    if parallelism.pipeline_parallel_degree > 1:
        return (
            f"the pipeline's schedules (`parallelism.pipeline_parallel_degree` = "
            f"{parallelism.pipeline_parallel_degree}) interleave forwards and backwards, so the step counts by a "
            "pre-pass",
            "",
        )
    if c.training.loss_chunk_tokens == 0:
        return (
            "held forwards need the loss in chunks, and `training.loss_chunk_tokens` = 0 would hold every "
            "micro-batch's whole logits",
            "Set `training.loss_chunk_tokens` above 0 (or -1)",
        )
    if _gathers_logits(c):
        return (
            "held forwards need the loss in chunks, and the gathered logits of `parallelism.disable_loss_parallel` "
            "are whole",
            "Turn off `parallelism.disable_loss_parallel`",
        )
    return None


def _gathers_logits(c: JobConfig) -> bool:
    """Tensor parallelism without loss parallel computes the loss outside the model, unchunked."""
    return c.parallelism.tensor_parallel_degree > 1 and c.parallelism.disable_loss_parallel


def _loss_chunks(c: JobConfig) -> Unused:
    if not _gathers_logits(c):
        return None
    return (
        "with `parallelism.disable_loss_parallel` under tensor parallelism the loss takes the whole gathered logits",
        "Turn off `parallelism.disable_loss_parallel`",
    )


def _degree(key: str, what: str, mesh: str) -> Callable[[JobConfig], Unused]:
    def unused(c: JobConfig) -> Unused:
        degree = getattr(c.parallelism, key)
        if degree > 1:
            return None
        return f"there is no {what} (`parallelism.{key}` = {degree})", f"Set it above 1 (`--mesh ...,{mesh}=N`)"

    return unused


def _switch(key: str, on: Callable[[JobConfig], bool], fix: str = "") -> Callable[[JobConfig], Unused]:
    """Unused while the boolean ``key`` (or what ``on`` tests) is off."""

    def unused(c: JobConfig) -> Unused:
        return None if on(c) else (f"`{key}` is off", fix or f"Turn on `{key}`")

    return unused


MUON_KEYS = ("optimizer.momentum", "optimizer.nesterov", "optimizer.ns_steps", "optimizer.ns_coefficients")


def _muon(c: JobConfig) -> Unused:
    if c.optimizer.name == "Muon":
        return None
    return f"`optimizer.name` = {c.optimizer.name!r}", 'Set `optimizer.name` = "Muon"'


DEPENDENT = (
    Dependent(_section("float8"), _float8),
    Dependent((*MUON_KEYS, "optimizer.adjust_lr_fn"), _muon),
    Dependent(_section("moe"), _dense),
    Dependent(("moe.balance_loss_scope", "moe.balance_loss_layers"), _balance_loss),
    Dependent(("moe.held_forwards",), _held_forwards),
    Dependent(("compile.backend", "compile.components"), _switch("compile.enable", lambda c: c.compile.enable)),
    Dependent(
        ("activation_checkpoint.selective_ac_option",),
        lambda c: (
            None
            if c.activation_checkpoint.mode == "selective"
            else (
                f'it applies to `activation_checkpoint.mode` = "selective", not {c.activation_checkpoint.mode!r}',
                'Set `activation_checkpoint.mode` = "selective"',
            )
        ),
    ),
    Dependent(
        ("parallelism.expert_parallel_overlap_chunks",),
        _degree("expert_parallel_degree", "expert-parallel exchange", "ep"),
    ),
    Dependent(
        (
            "parallelism.pipeline_parallel_schedule",
            "parallelism.pipeline_parallel_microbatch_size",
            "parallelism.pipeline_parallel_layers_per_stage",
            "parallelism.pipeline_parallel_first_stage_less_layers",
            "parallelism.pipeline_parallel_last_stage_less_layers",
        ),
        _degree("pipeline_parallel_degree", "pipeline", "pp"),
    ),
    Dependent(
        ("parallelism.context_parallel_backend", "parallelism.context_parallel_rotate_method"),
        _degree("context_parallel_degree", "context parallelism", "cp"),
    ),
    Dependent(("parallelism.disable_loss_parallel",), _degree("tensor_parallel_degree", "tensor parallelism", "tp")),
    Dependent(("training.loss_chunk_tokens",), _loss_chunks),
    Dependent(
        ("training.prefetch_factor",),
        lambda c: (
            None
            if c.training.num_workers > 0
            else (
                "the data loads in the training process (`training.num_workers` = 0)",
                "Set `training.num_workers` above 0",
            )
        ),
    ),
    Dependent(
        ("lr_scheduler.decay_type", "lr_scheduler.min_lr_factor"),
        lambda c: (
            None
            if c.lr_scheduler.decay_ratio != 0
            else ("the schedule does not decay (`lr_scheduler.decay_ratio` = 0)", "Set `lr_scheduler.decay_ratio`")
        ),
    ),
    Dependent(
        (
            "checkpoint.interval",
            "checkpoint.keep_latest_k",
            "checkpoint.load_step",
            "checkpoint.exclude_from_loading",
            "checkpoint.last_save_model_only",
            "checkpoint.async_mode",
        ),
        _switch("checkpoint.enable", lambda c: c.checkpoint.enable),
    ),
    Dependent(
        ("checkpoint.folder",),
        _switch(
            "checkpoint.enable",
            lambda c: c.checkpoint.enable or c.checkpoint.create_seed_checkpoint,
            "Turn on `checkpoint.enable` (or `checkpoint.create_seed_checkpoint`)",
        ),
    ),
    Dependent(
        ("checkpoint.export_dtype",),
        _switch("checkpoint.last_save_model_only", lambda c: c.checkpoint.last_save_model_only),
    ),
    Dependent(
        ("checkpoint.allow_data_change",),
        lambda c: (
            None
            if c.checkpoint.enable or (c.checkpoint.initial_load_path and not c.checkpoint.initial_load_model_only)
            else (
                "no data position is loaded: `checkpoint.enable` is off and no full state is loaded from "
                "`checkpoint.initial_load_path`",
                "Turn on `checkpoint.enable`",
            )
        ),
    ),
    Dependent(
        ("checkpoint.initial_load_model_only",),
        lambda c: None if c.checkpoint.initial_load_path else ("`checkpoint.initial_load_path` is empty", "Set it"),
    ),
    Dependent(
        (
            "validation.dataset",
            "validation.dataset_path",
            "validation.freq",
            "validation.steps",
            "validation.local_batch_size",
            "validation.seq_len",
        ),
        _switch("validation.enable", lambda c: c.validation.enable),
    ),
    Dependent(
        ("metrics.save_tb_folder",), _switch("metrics.enable_tensorboard", lambda c: c.metrics.enable_tensorboard)
    ),
    Dependent(
        ("profiling.profile_freq",),
        _switch(
            "profiling.enable_profiling",
            lambda c: c.profiling.enable_profiling or c.profiling.enable_memory_snapshot,
            "Turn on `profiling.enable_profiling` or `profiling.enable_memory_snapshot`",
        ),
    ),
    Dependent(
        ("profiling.save_traces_folder",), _switch("profiling.enable_profiling", lambda c: c.profiling.enable_profiling)
    ),
    Dependent(
        ("profiling.save_memory_snapshot_folder",),
        _switch("profiling.enable_memory_snapshot", lambda c: c.profiling.enable_memory_snapshot),
    ),
)
"""Every setting that acts only under another one, in the order they are checked: a section's
own switch before the keys inside it."""


def check_dependent_settings(config: JobConfig, from_file: JobConfig, command_line: set[str]) -> None:
    """Raise :class:`ConfigError` for the first setting of :data:`DEPENDENT` that differs from its
    default and would change nothing in ``config``, unless the config file set it (it is not in
    ``command_line``) for a feature that was on in the file (``from_file``, the config before the
    command line) and the command line turned off."""
    for rule in DEPENDENT:
        unused = rule.unused(config)
        if unused is None:
            continue
        kept_for_later = rule.unused(from_file) is None
        for key in rule.keys:
            value = config.value(key)
            if value == FIELDS[key][1].default or (kept_for_later and key not in command_line):
                continue
            why, fix = unused
            fix = f"{fix}, or drop `{key}`" if fix else f"Drop `{key}`"
            raise ConfigError(f"`{key}` = {_shown(value)} would change nothing: {why}. {fix}.")


def acting(config: JobConfig) -> JobConfig:
    """``config`` with every setting of :data:`DEPENDENT` that changes nothing at its default: what
    the run does, loadable again (the file's settings kept for a feature turned off would not be,
    from one file)."""
    acts = copy.deepcopy(config)
    for rule in DEPENDENT:
        if rule.unused(config) is not None:
            for key in rule.keys:
                section, name = key.split(".")
                setattr(getattr(acts, section), name, FIELDS[key][1].default)
    return acts


def _shown(value: object) -> str:
    if isinstance(value, (StrList, FloatList)):
        return repr(",".join(map(str, value)))
    return repr(value)
