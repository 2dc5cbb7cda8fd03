"""Build everything the training loop uses, once, with every parallelism already applied.

The job was prepared before any process group existed (``trainer/entry/job.py``: config, plan,
data). :func:`build_step_parts` joins the process group and builds what a training step uses: the
mesh, the sharded model, the optimizer, the loader, the gradient accumulator, the pipeline.
:func:`build_run` adds what the loop around the steps uses: the train state restored from the
newest checkpoint, the checkpointer, the metrics and the validator. Building a large model takes a
while, so rank 0 says which phase it is in and how far the initialisation has got: a silent minute
looks like a hang.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.expert_parallel import expert_params, gathered_experts
from parallelisms.float8 import precompute_scales
from parallelisms.parallel_dims import Meshes, device_type
from parallelisms.parallelize import Parallelized, parallelize
from parallelisms.pipeline_parallel import Pipeline
from trainer.checkpoint.manager import CheckpointManager
from trainer.data.datasets import TokenDataset, data_lines
from trainer.data.loader import build_dataloader
from trainer.expert_balance import ExpertBalance
from trainer.grad_accumulator import GradAccumulator
from trainer.host_offload import host_offload
from trainer.layout_invariant import LayoutInvariantReduction
from trainer.loss import CrossEntropy, ModelLoss, cross_entropy_sum
from trainer.metrics import MetricsLogger, model_flops_per_token, peak_flops, use_color
from trainer.metrics.reports import log_start, save_config
from trainer.model.llama3 import Transformer, num_params
from trainer.model.moe import MoEArgs
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.planning.job_plan import JobPlan
from trainer.replica_groups import HealedParts, ReplicaGroups, job_identity
from trainer.runtime.distributed import init_distributed
from trainer.step import StepParts
from trainer.train_state import TrainState
from trainer.validation import Validator

logger = logging.getLogger("meshtrain")

PROGRESS_MIN_PARAMS = 100_000_000
"""Models at least this big report how far their initialisation has got; smaller ones (the
debug model) initialise in about a second and only log the phases."""
PROGRESS_EVERY_PERCENT = 10
PROGRESS_EVERY_S = 10.0


def build_model(
    plan: JobPlan,
    meshes: Meshes,
    device: torch.device,
    cross_entropy: CrossEntropy = cross_entropy_sum,
    fake_tensors: AbstractContextManager[object] | None = None,
) -> tuple[Transformer, Parallelized]:
    """Build on the meta device, parallelise, then materialise and initialise only the local shards
    (under pipeline parallelism: of this rank's stages).

    ``fake_tensors`` (the simulator's, ``trainer/simulation``): materialise inside that context,
    after parallelising outside it, and draw no initial values (fake tensors hold none).
    """
    start = time.monotonic()
    rank0 = dist.get_rank() == 0
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    if model.output is not None:  # the whole model: no pipeline split yet
        model.output.chunk_tokens = plan.loss_chunking.tokens
        model.output.gradients_in_forward = plan.workload.holds_loss_gradients
        model.output.cross_entropy = cross_entropy
    total = num_params(model)
    if rank0:
        logger.info("parallelising the model (%s parameters) on the meta device", f"{total:,}")
    parallelized = parallelize(model, meshes, plan.dims, plan.parallel, device.type)
    parts = parallelized.stage_modules or [model]
    float8 = parallelized.float8
    if rank0 and float8 is not None:
        for notice in float8.notices:
            logger.info("%s", notice)
        recipe = plan.parallel.float8.recipe if plan.parallel.float8 else ""
        logger.info("float8 (%s): %s", recipe, float8.describe(model if parallelized.split else None))
    local = num_params(model)
    if rank0:
        logger.info("allocating this rank's shards on %s", device.type)
    with fake_tensors or nullcontext():
        for part in parts:
            part.to_empty(device=device)
    if fake_tensors is None:
        seed = plan.config.debug.seed
        if rank0:
            logger.info("initialising the weights (seed %d)", seed)
        progress = InitProgress(local) if rank0 and local >= PROGRESS_MIN_PARAMS else None
        for part in parts:
            assert isinstance(part, Transformer)  # a stage view is an instance of the model's class
            part.init_weights(seed, progress=progress)
    if rank0:
        logger.info("model built and initialised in %.1f s", time.monotonic() - start)
    return model, parallelized


class InitProgress:
    """Told each parameter's size as it is initialised, logs a line when another
    ``PROGRESS_EVERY_PERCENT`` of the parameters is done or ``PROGRESS_EVERY_S`` have passed
    since the last line, whichever comes first, with the time since initialisation began."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.clock = total, 0, clock
        self.start = self.last = clock()
        self.next_percent = PROGRESS_EVERY_PERCENT

    def __call__(self, numel: int) -> None:
        self.done += numel
        now = self.clock()
        percent = 100 * self.done // self.total
        if percent < self.next_percent and now - self.last < PROGRESS_EVERY_S:
            return
        logger.info(
            "initialised %d%% of the parameters (%s of %s) in %.1f s",
            percent,
            f"{self.done:,}",
            f"{self.total:,}",
            now - self.start,
        )
        self.last = now
        self.next_percent = (percent // PROGRESS_EVERY_PERCENT + 1) * PROGRESS_EVERY_PERCENT


def build_step_parts(
    plan: JobPlan, dataset: Dataset, fake_tensors: AbstractContextManager[object] | None = None
) -> StepParts:
    """Join the process group and build the sharded model, optimizer, data and accumulator.

    ``fake_tensors``: the simulator's context for every tensor made after parallelising (see
    :func:`build_model`); it joins a fake process group beforehand.
    """
    config = plan.config
    dev_type = device_type()
    device = init_distributed(dev_type, config.comm.init_timeout_seconds)
    layout_invariant = config.debug.layout_invariant
    if config.debug.deterministic or (layout_invariant and dev_type == "cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if layout_invariant and dev_type == "cpu":
        torch.set_num_threads(1)  # CPU kernels may split a reduction by thread: one thread everywhere
    torch.manual_seed(config.debug.seed)
    meshes = plan.dims.build_mesh(dev_type)
    cross_entropy = cross_entropy_sum
    if plan.parallel.compile_loss:
        cross_entropy = torch.compile(cross_entropy_sum, backend=plan.parallel.compile_backend)
    model, parallelized = build_model(plan, meshes, device, cross_entropy, fake_tensors)
    with fake_tensors or nullcontext():
        return _assemble(plan, dataset, device, meshes, model, parallelized, cross_entropy)


def _assemble(
    plan: JobPlan,
    dataset: Dataset,
    device: torch.device,
    meshes: Meshes,
    model: Transformer,
    parallelized: Parallelized,
    cross_entropy: CrossEntropy,
) -> StepParts:
    """The optimizer, loader, accumulator and pipeline around the built model."""
    config, training, dev_type = plan.config, plan.config.training, device.type
    layout_invariant = config.debug.layout_invariant
    context_parallel = parallelized.context_parallel
    model_loss = ModelLoss(plan.loss_in_model, cross_entropy)
    positions = context_parallel.positions.to(device) if context_parallel else None
    optimizer = build_optimizer(model, config.optimizer, dev_type, layout_invariant)
    # Replica groups shard the data further: group g reads shard g of every step's N-group batch.
    ft = config.fault_tolerance
    group, groups = (ft.replica_id, ft.group_count) if ft.enable else (0, 1)
    loader = build_dataloader(
        dataset,
        microbatches=plan.microbatches,
        local_batch_size=training.local_batch_size,
        dp_rank=group * plan.dims.dp + meshes.batch.get_local_rank(),
        dp_degree=groups * plan.dims.dp,
        seed=config.debug.seed,
        num_workers=training.num_workers,
        pin_memory=dev_type == "cuda",
        prefetch_factor=training.prefetch_factor if training.num_workers > 0 else None,
        allow_data_change=config.checkpoint.allow_data_change,
        timeout_s=training.data_timeout_seconds,
    )
    accumulator = GradAccumulator(
        model,
        loss_group=meshes.loss.get_group(),
        num_microbatches=plan.microbatches,
        max_norm=training.max_norm,
        hsdp=plan.dims.hsdp,
        defer_gradient_reduction=training.defer_gradient_reduction,
        keep_gathered=plan.dims.fsdp_one_rank and plan.parallel.reshard_after_forward == "never",
        gathered_experts=gathered_experts(model) if plan.parallel.experts_stay_gathered else None,
        stats_group=meshes.stats.get_group() if plan.dims.pp > 1 else None,
        pp_degree=plan.dims.pp,
        layout_invariant=(
            LayoutInvariantReduction(model, meshes.batch.get_group(), plan.dims.dp_shard) if layout_invariant else None
        ),
        expert_params=expert_params(model),
        ep_degree=plan.dims.ep,
    )
    pipeline = None
    if parallelized.split is not None:
        assert parallelized.stage_modules is not None  # parallelize sets both under pipeline parallelism
        pipeline = Pipeline(
            parallelized.stage_modules,
            parallelized.split,
            meshes.pp,
            device,
            cross_entropy,
            labels_to_model=plan.loss_in_model,
            microbatches=plan.pipeline_microbatches,
            microbatch_size=plan.parallel.pp_microbatch_size,
            positions=positions if positions is not None else torch.arange(training.seq_len, device=device),
            document_mask=training.document_mask,
        )
    return StepParts(
        device=device,
        meshes=meshes,
        model=model,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, training.steps, config.lr_scheduler),
        loader=loader,
        accumulator=accumulator,
        loss_parallel=plan.parallel.loss_parallel,
        model_loss=model_loss,
        context_parallel=context_parallel,
        positions=positions,
        document_bos_id=plan.tokenizer.bos_id if training.document_mask else None,
        pipeline=pipeline,
        balance=build_balance(plan, model, meshes),
        offload=host_offload(device) if plan.workload.offloads_forwards else None,
        after_optimizer_step=float8_after_step(plan, parallelized, model),
    )


def float8_after_step(plan: JobPlan, parallelized: Parallelized, model: Transformer) -> Callable[[], None] | None:
    """With float8 weights gathered by FSDP: their scales in one all-reduce after each optimizer step."""
    float8 = plan.parallel.float8
    if float8 is None or not float8.precompute_scales:
        return None
    modules = parallelized.stage_modules or [model]
    return lambda: precompute_scales(modules)


def build_balance(plan: JobPlan, model: Transformer, meshes: Meshes) -> ExpertBalance | None:
    """The step's expert balancing, for a Mixture-of-Experts model (also on a pipeline rank
    whose stages hold no MoE layer: it joins the sums over the stages)."""
    args = plan.model_args
    if not isinstance(args, MoEArgs):
        return None
    moe, pipelined = plan.config.moe, plan.dims.pp > 1
    return ExpertBalance(
        model,
        meshes.routing.get_group(),
        bias_update_rate=moe.bias_update_rate,
        loss_weight=moe.balance_loss_weight,
        loss_scope=moe.balance_loss_scope,
        loss_layers=moe.balance_loss_layers,
        global_batch=plan.global_batch_size,
        seq_len=plan.config.training.seq_len,
        global_microbatches=(plan.pipeline_microbatches if pipelined else plan.microbatches) * meshes.routing.size(),
        moe_layer_ids=range(args.n_dense_layers, args.n_layers),
        n_experts=args.n_experts,
        stats_group=routing_stats_group(plan, meshes) if pipelined else None,
        pp_group=meshes.pp.get_group() if pipelined else None,
        hold_forwards=plan.workload.holds_forwards,
    )


def routing_stats_group(plan: JobPlan, meshes: Meshes) -> dist.ProcessGroup:
    """The pipeline ranks times the routing mesh, where the MoE statistics of the whole model are
    summed: the stats mesh, and with tensor parallelism (whose ranks route their own shards) every
    rank, as the mesh's dimensions are pp, dp_replicate, dp_shard, cp and tp."""
    if plan.dims.tp == 1:
        return meshes.stats.get_group()
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)  # the process group is initialised
    return world


@dataclass
class Run:
    """Everything the loop uses: the step's parts, the train state (restored from the newest
    checkpoint, if any), the checkpointer, the metrics and the validator."""

    parts: StepParts
    state: TrainState
    checkpointer: CheckpointManager
    metrics: MetricsLogger
    validator: Validator | None
    replicas: ReplicaGroups | None = None
    """This job's fault-tolerant replica groups (``fault_tolerance.enable``), else None."""


def build_run(plan: JobPlan, parts: StepParts, dataset: TokenDataset, validation_dataset: TokenDataset | None) -> Run:
    """Resume from the newest checkpoint, open the metrics and the validator; rank 0 saves the
    resolved config and says what is about to run."""
    state, checkpointer = resume(plan, dataset, parts)
    rank = dist.get_rank()
    metrics = build_metrics(plan, parts.device, rank, resumed=state.step > 0)
    if rank == 0:
        save_config(plan)
        log_start(
            plan, parts.device, metrics, data_lines(plan.config, plan.global_batch_size, dataset, validation_dataset)
        )
    replicas = build_replicas(plan, parts, dataset, state)
    return Run(parts, state, checkpointer, metrics, build_validator(plan, parts, validation_dataset), replicas)


def build_replicas(plan: JobPlan, parts: StepParts, dataset: TokenDataset, state: TrainState) -> ReplicaGroups | None:
    """Join the replica groups, after the resume: torchft's step starts at the resumed one, so a
    group resumed from an older checkpoint heals from the others."""
    config = plan.config
    if not config.fault_tolerance.enable:
        return None
    dims = plan.dims
    identity = job_identity(
        model=plan.model_args,
        mesh=f"pp={dims.pp} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} ep={dims.ep}",
        group_count=config.fault_tolerance.group_count,
        batch=f"{plan.global_batch_size} x {config.training.seq_len}, {plan.microbatches} micro-batches",
        data=getattr(dataset, "identity", None),
        seed=config.debug.seed,
        optimizer=config.optimizer,
        balancing=config.moe if isinstance(plan.model_args, MoEArgs) else None,
        lr_scheduler=config.lr_scheduler,
        steps=config.training.steps,
        torch=torch.__version__,
    )
    healed = HealedParts(parts.model, parts.optimizer, parts.scheduler, parts.loader, state)
    replicas = ReplicaGroups(config.fault_tolerance, healed, identity, parts.device)
    replicas.resume_at(state.step)
    parts.accumulator.replicas = replicas
    if parts.balance is not None:
        parts.balance.groups = replicas
    return replicas


def resume(plan: JobPlan, dataset: TokenDataset, parts: StepParts) -> tuple[TrainState, CheckpointManager]:
    """The train state and the checkpoint manager, restored from the newest checkpoint if any."""
    config = plan.config
    state = TrainState()
    checkpointer = CheckpointManager(
        config.checkpoint,
        config.job.dump_folder,
        model=parts.model,
        optimizer=parts.optimizer,
        lr_scheduler=parts.scheduler,
        dataloader=parts.loader,
        train_state=state,
        model_args=plan.model_args,
        total_steps=config.training.steps,
        data_identity=getattr(dataset, "identity", None),
        timeout_s=config.comm.init_timeout_seconds,
        layout_invariant=config.debug.layout_invariant,
    )
    checkpointer.load()
    return state, checkpointer


def build_metrics(plan: JobPlan, device: torch.device, rank: int, resumed: bool = False) -> MetricsLogger:
    config, training, args = plan.config, plan.config.training, plan.model_args
    return MetricsLogger(
        rank=rank,
        console=rank == 0,
        dump_folder=config.job.dump_folder,
        tb_folder=config.metrics.save_tb_folder,
        enable_tensorboard=config.metrics.enable_tensorboard,
        log_freq=config.metrics.log_freq,
        # The entry point's logging.basicConfig sends the console line to stderr.
        color=use_color(config.metrics.disable_color_printing, sys.stderr),
        device=device,
        total_steps=training.steps,
        flops_per_token=model_flops_per_token(args, training.seq_len),
        peak_flops=peak_flops(device, override=training.peak_flops or None),
        global_tokens_per_step=plan.global_batch_size * training.seq_len,
        # A data-parallel replica's tokens are processed by its pp x tp x cp devices (torchtitan's
        # non-data-parallel size): tokens/s and MFU are per device of the whole job.
        devices_per_replica=plan.dims.pp * plan.dims.tp * plan.dims.cp,
        validation=plan.validates,
        resumed=resumed,
        moe_layers=tuple(range(args.n_dense_layers, args.n_layers)) if isinstance(args, MoEArgs) else (),
        balance_loss=isinstance(args, MoEArgs) and config.moe.balance_loss_weight > 0,
        replica_groups=config.fault_tolerance.enable,
    )


def build_validator(plan: JobPlan, parts: StepParts, dataset: TokenDataset | None) -> Validator | None:
    if dataset is None:
        return None
    validation = plan.config.validation
    return Validator(
        dataset,
        local_batch_size=validation.local_batch_size,
        dp_rank=parts.meshes.batch.get_local_rank(),
        dp_degree=plan.dims.dp,
        steps=validation.steps,
        freq=validation.freq,
        seed=plan.config.debug.seed,
    )
