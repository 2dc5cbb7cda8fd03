"""What a config resolves to on a world size, checked before any process group exists.

A mistake in the config, the mesh or the tokenizer must fail in seconds with a message naming
the key, never hang a collective: :func:`resolve_job` resolves the mesh shape, the model's shape, the
number of micro-batches and the parallelism settings, and runs every check that needs the world
size. The parallelisms' own constraints live beside them (``parallelisms/parallelize.py``); here
their errors are rendered with the config keys the user wrote. Resolving writes nothing (the
simulator resolves a second, traced plan of the same job): the dump folder is probed while
preparing, in ``trainer/entry/job.py``.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, replace

import torch

from parallelisms.context_parallel import resolve_backend
from parallelisms.parallel_dims import ParallelDims, ParallelismError, device_type
from parallelisms.parallelize import ModelShape, ParallelSettings, check
from parallelisms.torch_private import UnsupportedTorch
from parallelisms.torch_private import check as check_torch_internals
from trainer.checkpoint.hf_load import check_initial_load
from trainer.checkpoint.location import check_stores
from trainer.checkpoint.writer import check_pinned_staging
from trainer.config import ConfigError, JobConfig, cautions, is_url, resolve_path
from trainer.data.datasets import validates, validation_seq_len
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.hardware import GIB, gib
from trainer.model.families import FAMILIES
from trainer.model.llama3 import ModelArgs, model_args
from trainer.model.moe import MoEArgs
from trainer.planning.expert_checks import check_experts
from trainer.planning.float8_plan import (
    check_float8_backend,
    check_float8_job,
    check_float8_model,
    float8_lines,
    float8_settings,
    job_backend,
)
from trainer.planning.latent_memory import latents_of
from trainer.planning.layout_rules import check_layout_invariant
from trainer.planning.loss_chunking import LossChunking, resolve_loss_chunking
from trainer.planning.memory_fixes import what_would_fit
from trainer.planning.memory_plan import estimate
from trainer.planning.moe_memory import RoutedExperts, routed_experts
from trainer.planning.per_rank_bytes import Estimate
from trainer.planning.step_plan import StepPlan, step_plan
from trainer.planning.workload import Workload

DEGREES = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
}
"""Each ``ParallelDims`` degree and the config key it is read from."""
COPIED = {
    "seq_len": "training.seq_len",
    "async_tp": "parallelism.enable_async_tensor_parallel",
    "cp_backend": "parallelism.context_parallel_backend",
    "cp_rotate_method": "parallelism.context_parallel_rotate_method",
    "document_mask": "training.document_mask",
    "ac_mode": "activation_checkpoint.mode",
    "ac_option": "activation_checkpoint.selective_ac_option",
    "ep_overlap_chunks": "parallelism.expert_parallel_overlap_chunks",
    "compile_backend": "compile.backend",
    "pp_schedule": "parallelism.pipeline_parallel_schedule",
    "pp_microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "pp_layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "pp_first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "pp_last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
}
"""The ``ParallelSettings`` fields copied from one config key each (the others are resolved in
:func:`parallel_settings`)."""
SETTING_KEYS = {name: f"`{key}`" for name, key in (DEGREES | COPIED).items()} | {
    "model_name": "`model.name`",
    "loss_parallel": "loss parallel (`parallelism.disable_loss_parallel`)",
    "compile_model": "`compile.enable` with `model` in `compile.components`",
    "compile_loss": "`compile.components` including `loss`",
    "pp_rank_batch": "a data-parallel rank's share of the batch (`training.global_batch_size` / data-parallel degree)",
}
"""How the parallelisms' setting names read to a user: the config keys that set them."""


@dataclass
class JobPlan:
    """The config resolved for one world size."""

    config: JobConfig
    dims: ParallelDims
    parallel: ParallelSettings
    microbatches: int
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation)."""
    global_batch_size: int
    model_args: ModelArgs
    tokenizer: Tokenizer
    workload: Workload
    """What the per-rank memory estimate is made of."""
    loss_chunking: LossChunking
    """``training.loss_chunk_tokens`` resolved (``auto``: by ``limit``), and why."""

    @property
    def pipeline_microbatches(self) -> int:
        """Under pipeline parallelism, the schedule's micro-batches per step: a data-parallel
        rank's share of the global batch cut into ``pipeline_parallel_microbatch_size`` pieces."""
        return self.global_batch_size // self.dims.dp // self.parallel.pp_microbatch_size

    @property
    def loss_in_model(self) -> bool:
        """The model's output projection computes the loss in chunks (``trainer/loss.py``);
        tensor parallelism without loss parallel gathers whole logits for it instead."""
        return loss_in_model(self.dims, self.parallel)

    @functools.cached_property
    def step(self) -> StepPlan:
        """How the training step runs: its schedule and its parts, in order (decided once: the
        build, ``--dry-run`` and the start report read the same plan)."""
        return step_plan(self.config, self.dims, self.parallel, self.workload, self.model_args)

    @property
    def memory(self) -> Estimate:
        return estimate(self.workload)

    @property
    def validates(self) -> bool:
        return validates(self.config)

    @property
    def validation_seq_len(self) -> int:
        return validation_seq_len(self.config)


def resolve_job(
    config: JobConfig,
    world_size: int,
    device: str | None = None,
    figures: dict[str, float] | None = None,
    limit: int | None = None,
) -> JobPlan:
    """Validate ``config`` against ``world_size``; raise :class:`ConfigError` naming the key.

    ``device``: the device type the job will run on ("cuda", "cpu"), when it is not this
    machine's (``--dry-run --target-gpu``); ``figures``: the target's ``--target.*`` figures
    (``trainer/planning/target_figures.py``), of which the estimate reads the runtime and the
    allocator slack; ``limit``: the bytes a rank may use, when known, by which the ``auto`` loss
    chunking decides (``trainer/planning/loss_chunking.py``).
    """
    device = device or device_type()
    training = config.training
    try:
        dims = ParallelDims(world_size=world_size, **{name: config.value(key) for name, key in DEGREES.items()})
    except ParallelismError as e:
        raise ConfigError(e.render(SETTING_KEYS) + sized_for(config, world_size)) from None
    check_torch(torch_concerns(config, dims))
    check_pinned_staging(config.checkpoint, device)
    per_microbatch = training.local_batch_size * dims.dp
    global_batch = per_microbatch if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"`training.global_batch_size` = {global_batch} is not divisible by "
            f"`training.local_batch_size` x data-parallel degree = {training.local_batch_size} x {dims.dp} = "
            f"{per_microbatch}; gradient accumulation needs a whole number of micro-batches. "
            f"Use a multiple of {per_microbatch}."
        )
    tokenizer = load_tokenizer(resolve_path(config.model.tokenizer_path))
    try:
        flavors = FAMILIES[config.model.name]
        args = model_args(config.model.flavor, tokenizer.vocab_size, training.seq_len, config.model.n_layers, flavors)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    settings = parallel_settings(config, dims, global_batch // dims.dp, device)
    n_experts = args.n_experts if isinstance(args, MoEArgs) else 0
    try:
        shape = ModelShape(args.n_heads, args.kv_heads, args.vocab_size, args.n_layers, n_experts, args.tie_embeddings)
        check(dims, settings, shape, device)
    except ParallelismError as e:
        raise ConfigError(e.render(SETTING_KEYS)) from None
    check_layout_invariant(config, dims, settings)
    check_replica_groups(config, dims)
    check_float8_job(config, settings, n_experts, device)
    check_float8_backend(settings, dims, job_backend(device))
    check_float8_model(settings, dims, args, training.local_batch_size)
    check_experts(config, dims, args, (figures or {}).get("routing_imbalance", 1.0))
    validation = config.validation
    if validation.enable and (dims.cp > 1 or dims.pp > 1) and validation.seq_len not in (-1, training.seq_len):
        which = (
            f"context parallelism (`parallelism.context_parallel_degree` = {dims.cp}) shards"
            if dims.cp > 1
            else f"the pipeline (`parallelism.pipeline_parallel_degree` = {dims.pp}) passes"
        )
        raise ConfigError(
            f"`validation.seq_len` = {validation.seq_len} differs from `training.seq_len` = {training.seq_len}, "
            f"but {which} sequences of the training length only; set `validation.seq_len = -1`."
        )
    if config.profiling.enable_memory_snapshot and device != "cuda":
        raise ConfigError("`profiling.enable_memory_snapshot` records the CUDA allocator: it needs a GPU.")
    check_stores(config.checkpoint, config.job.dump_folder)
    check_initial_load(config.checkpoint, args)
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"`checkpoint.create_seed_checkpoint` runs on one process, not {world_size}: launch it with NGPU=1."
        )
    workload = memory_workload(config, dims, settings, args, device, figures or {})
    chunking = resolve_loss_chunking(training.loss_chunk_tokens, workload, loss_in_model(dims, settings), limit, device)
    workload = replace(workload, loss_chunk_tokens=chunking.tokens)
    settings = replace(settings, experts_stay_gathered=workload.experts_stay_gathered)
    batches = global_batch // per_microbatch
    return JobPlan(config, dims, settings, batches, global_batch, args, tokenizer, workload, chunking)


def check_replica_groups(config: JobConfig, dims: ParallelDims) -> None:
    """A fault-tolerant group replicates over the groups, not inside itself, and needs torchft."""
    if not config.fault_tolerance.enable:
        return
    if dims.dp_replicate > 1:
        raise ConfigError(
            f"`parallelism.data_parallel_replicate_degree` = {dims.dp_replicate} with `fault_tolerance.enable`: the "
            "replica groups are the replicated dimension; set it to 1 and launch `fault_tolerance.group_count` groups."
        )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            '`fault_tolerance.enable` needs torchft: `pip install -e ".[ft]"` (or `pip install torchft`).'
        )


def replica_groups_line(plan: JobPlan) -> list[str]:
    """``--dry-run``'s line for a fault-tolerant job: the mesh above is one group's."""
    ft = plan.config.fault_tolerance
    if not ft.enable:
        return []
    return [
        f"replica groups: this is group {ft.replica_id} of {ft.group_count}, each a job of the mesh above; "
        f"{ft.group_count} x {plan.global_batch_size} sequences per step when every group takes part; a step "
        f"commits with at least {ft.min_replica_size} group(s)"
    ]


def sized_for(config: JobConfig, world_size: int) -> str:
    """The machine the config names, when ``world_size`` is not it: a mesh written for 64 GPUs
    does not divide 4, and the fix is the launch, not the mesh."""
    machine = config.machine
    ranks = machine.nodes * machine.gpus_per_node
    if not ranks or ranks == world_size:
        return ""
    nodes = f" NNODES={machine.nodes}" if machine.nodes > 1 else ""
    return (
        f" This config is sized for {ranks} GPUs (`machine.*`): launch it with NGPU={machine.gpus_per_node}{nodes}, "
        "or plan it from here with `--dry-run` / `--simulate`."
    )


def torch_concerns(config: JobConfig, dims: ParallelDims) -> tuple[str, ...]:
    """The concerns of ``parallelisms/torch_private`` whose private torch names the job reaches."""
    concerns = ["dtensor", "process_group", "kernels", "dataloader"]
    if dims.pp > 1:
        concerns.append("pipelining")
    if config.debug.layout_invariant:
        concerns.append("fsdp")
    if any(is_url(path) for path in (config.checkpoint.folder, config.checkpoint.initial_load_path)):
        concerns.append("checkpoint_storage")
    return tuple(concerns)


def check_torch(concerns: tuple[str, ...]) -> None:
    """Stop with one line when this torch is outside the releases a concern was checked on."""
    try:
        check_torch_internals(concerns)
    except UnsupportedTorch as e:
        raise ConfigError(str(e)) from None


def loss_in_model(dims: ParallelDims, settings: ParallelSettings) -> bool:
    return dims.tp == 1 or settings.loss_parallel


def memory_workload(
    config: JobConfig,
    dims: ParallelDims,
    settings: ParallelSettings,
    args: ModelArgs,
    device: str,
    figures: dict[str, float] | None = None,
) -> Workload:
    """Under pipeline parallelism the model runs the pipeline's micro-batches, whatever
    ``training.local_batch_size`` (which only cuts the loader's batch)."""
    training, pipelined = config.training, dims.pp > 1
    imbalance = figures.get("routing_imbalance", 1.0) if figures else 1.0
    balance = config.moe.balance_loss_scope if config.moe.balance_loss_weight > 0 else ""
    return Workload(
        muon=config.optimizer.name == "Muon",
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        kv_heads=args.kv_heads,
        ffn_dim=args.ffn_hidden_dim,
        vocab_size=args.vocab_size,
        tied_embeddings=args.tie_embeddings,
        local_batch_size=settings.pp_microbatch_size if pipelined else training.local_batch_size,
        seq_len=training.seq_len,
        dp_shard=dims.dp_shard,
        cp=dims.cp,
        tp=dims.tp,
        compute_bytes=settings.param_dtype.itemsize,
        reduce_bytes=settings.reduce_dtype.itemsize,
        float8_all_gather=settings.float8 is not None and settings.float8.fsdp_float8_all_gather,
        ac_mode=settings.ac_mode,
        ac_option=settings.ac_option,
        loss_parallel=settings.loss_parallel,
        # Approximately: the layout-invariant mode holds up to log2(micro-batches) + 1 gradient shards
        # and a unit's exchange buffers, counted as deferral's one unsharded gradient.
        defer_gradient_reduction=training.defer_gradient_reduction or config.debug.layout_invariant,
        accumulation=settings.pp_rank_batch // training.local_batch_size,
        fixed_global_batch=training.global_batch_size != -1,
        reshard_after_forward=settings.reshard_after_forward,
        gathers_one_rank_experts=settings.reshard_after_forward == "default"
        and dims.dp_replicate == 1
        and not config.debug.layout_invariant,
        cp_allgather_kv=resolve_backend(settings.cp_backend, device, settings.document_mask) == "allgather_kv",
        cp_ulysses=resolve_backend(settings.cp_backend, device, settings.document_mask) == "ulysses",
        document_mask=settings.document_mask,
        device=device,
        runtime_bytes=int(figures["runtime_gib"] * GIB) if figures and "runtime_gib" in figures else None,
        cuda_build=torch.backends.cuda.is_built(),
        allocator_slack=figures.get("allocator_slack") if figures else None,
        pp=dims.pp,
        pp_schedule=settings.pp_schedule,
        pp_microbatches=settings.pp_rank_batch // settings.pp_microbatch_size if pipelined else 1,
        pp_layers_per_stage=settings.pp_layers_per_stage,
        pp_first_less=settings.pp_first_stage_less_layers,
        pp_last_less=settings.pp_last_stage_less_layers,
        head_dim=args.head_dim,
        latents=latents_of(args),
        experts=routed_experts(args, dims.ep, imbalance, balance == "sequence", balance == "global_batch"),
        hold_forwards=config.moe.held_forwards != "prepass",
        offload_forwards=config.moe.held_forwards == "host",
        fit_held_forwards=config.moe.held_forwards == "auto",
    )


def describe(plan: JobPlan, limit: int | None, where: str) -> str:
    """What the job will be, in a few lines (``--dry-run``)."""
    config, dims, training, w = plan.config, plan.dims, plan.config.training, plan.workload
    headroom = f"; {1 - plan.memory.total / limit:.0%} headroom" if limit else ""
    fits = f" (limit {gib(limit)}: {where}{headroom})" if limit is not None else ""
    return "\n".join(
        [
            f"model: {config.model.name} {config.model.flavor}, {w.params:,} parameters "
            f"({w.n_layers} layers, dim {w.dim}, vocabulary {w.vocab_size}"
            f"{', the output tied to the embedding' if w.tied_embeddings else ''})",
            f"mesh: pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} "
            + (f"ep={dims.ep} " if w.experts else "")
            + f"({dims.world_size} processes)",
            *([experts_line(w.experts, w.experts_stay_gathered)] if w.experts else []),
            *held_forwards_line(w),
            f"batch: {plan.global_batch_size} x {training.seq_len} tokens per step = {plan.microbatches} "
            f"micro-batch(es) of {training.local_batch_size} per data-parallel rank; {training.steps} steps",
            *replica_groups_line(plan),
            *float8_lines(plan.parallel, plan.model_args),
            *plan.step.lines,
            f"memory: {plan.memory.line()}{fits}",
            f"loss: {plan.loss_chunking.line()}",
            f"output: {config.job.dump_folder}",
            *(f"warning: {caution}" for caution in cautions(config)),
        ]
    )


def experts_line(experts: RoutedExperts, stay_gathered: bool) -> str:
    gathered = "; they stay gathered for the whole step (ep = dp_shard x cp)" if stay_gathered else ""
    return (
        f"experts: {experts.n_experts} routed (top-{experts.top_k}), {experts.n_experts // experts.ep} per rank"
        f"{gathered}; the busiest rank assumed to receive {experts.imbalance:g}x the average routed tokens "
        "(`--target.routing_imbalance`)"
    )


def held_forwards_line(w: Workload) -> list[str]:
    """How exact balancing learns the step's routing counts, where it does (``moe.held_forwards``)."""
    if w.experts is None or not w.experts.exact_balance:
        return []
    if not w.holds_forwards:
        why = ""
        if w.hold_forwards:  # the setting allowed it; the job's layout does not
            why = ": held forwards need full activation checkpointing, no pipeline parallelism and the loss in chunks"
        elif w.fit_held_forwards:
            why = ": held forwards would not fit in 90% of the GPU, on it or in host memory"
        return [f"balancing: `global_batch` counts by a forward-only pre-pass of the step (`moe.held_forwards`){why}"]
    where = "in pinned host memory, two micro-batches on the device" if w.offloads_forwards else "on the device"
    return [f"balancing: `global_batch` counts in the step's own forwards, held {where} (`moe.held_forwards`)"]


def check_memory(plan: JobPlan, limit: int | None, where: str) -> None:
    """Raise :class:`ConfigError` when the per-rank estimate exceeds ``limit`` (bytes; None: unknown).

    ``where`` says what the limit is ("the GPU's memory", ...), for the message.
    """
    needed = plan.memory.total
    if limit is None or needed <= limit or not plan.config.training.check_memory:
        return
    advice = what_would_fit(plan.workload, limit, plan.dims.world_size)
    advice = advice[0].upper() + advice[1:]
    raise ConfigError(
        f"this job needs about {plan.memory.line()}, more than {where} ({gib(limit)}). {advice}. "
        "The estimate is printed by `--dry-run`; `--training.check_memory false` runs anyway."
    )


def compiles_blocks(config: JobConfig) -> bool:
    """``compile.enable`` with the model among its components: each block is compiled."""
    return config.compile.enable and "model" in config.compile.components


def parallel_settings(
    config: JobConfig, dims: ParallelDims, rank_batch: int, device: str | None = None
) -> ParallelSettings:
    """``rank_batch``: sequences one data-parallel rank trains on per step; ``device``: the
    device type to resolve ``auto`` settings for (this machine's by default)."""
    parallelism, compile_config = config.parallelism, config.compile
    reshard = parallelism.fsdp_reshard_after_forward  # over one FSDP rank, freeing only means casting again
    return ParallelSettings(
        **{name: config.value(key) for name, key in COPIED.items()},
        loss_parallel=dims.tp > 1 and not parallelism.disable_loss_parallel,
        compile_model=compiles_blocks(config),
        fused_moe_combine=compiles_blocks(config),
        compile_loss=compile_config.enable and "loss" in compile_config.components,
        param_dtype=param_dtype(config.training.mixed_precision_param, device or device_type()),
        reduce_dtype=getattr(torch, config.training.mixed_precision_reduce),
        reshard_after_forward="never" if dims.fsdp_one_rank and reshard == "default" else reshard,
        pp_rank_batch=rank_batch,
        float8=float8_settings(config, device or device_type()),
    )


def param_dtype(setting: str, device: str) -> torch.dtype:
    """``training.mixed_precision_param``, with ``auto`` resolved: bf16 on GPU, fp32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, setting)
