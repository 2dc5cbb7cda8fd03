"""Build everything the training loop uses, once, with every parallelism already applied.

The job was prepared before any process group existed (``trainer/entry/job.py``: config, plan,
data). :func:`build_training` joins the process group, builds the sharded model
(``build_model.py``), the optimizer and the data, and the step: its schedule and its parts, in the
order they take part (:func:`step_parts`). :func:`build_run` adds what the loop around the steps
uses: the train state restored from the newest checkpoint, the checkpointer, the metrics and the
validator.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.float8 import precompute_scales
from parallelisms.parallel_dims import Meshes, device_type
from parallelisms.parallelize import Parallelized
from parallelisms.pipeline_parallel import Pipeline, PipelineFeed
from trainer.build_model import build_model
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.states import Checkpointed
from trainer.data.datasets import TokenDataset, data_lines
from trainer.data.loader import MicroBatchLoader, build_dataloader
from trainer.loss import CrossEntropy, ModelLoss, cross_entropy_sum
from trainer.metrics import MetricsLogger, model_flops_per_token, peak_flops, use_color
from trainer.metrics.logger import LogSettings, Throughput, open_sinks
from trainer.metrics.reports import log_start, save_config
from trainer.model.llama3 import Transformer
from trainer.model.moe import MoEArgs
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.planning.job_plan import JobPlan
from trainer.replica_groups import ReplicaGroups
from trainer.replica_healing import HealedParts
from trainer.replica_identity import job_identity
from trainer.runtime.distributed import init_distributed
from trainer.step.batches import StepBatches
from trainer.step.expert_balance import BalanceSettings, ExpertBalance
from trainer.step.forward import Forward
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.grad_sync import GradSync
from trainer.step.group_commit import GroupCommit
from trainer.step.host_offload import HostOffload, host_offload
from trainer.step.layout_invariant import LayoutInvariantReduction
from trainer.step.loss_terms import LossTerm, LossTerms, with_terms
from trainer.step.optimizer_step import AfterOptimizerStep, OptimizerStep
from trainer.step.part import Parts, StepPart
from trainer.step.schedules import HeldForwards, Interleaved, Pipelined, StepSchedule
from trainer.step.sums import LOSS, WORST, Ranks, StepSums
from trainer.step.train_step import Step
from trainer.train_state import TrainState
from trainer.training import Training
from trainer.validation import Validator


class Substitutes(Protocol):
    """What ``--simulate`` builds a rank with instead (``trainer/simulation/fake_job.py``): every
    tensor made after parallelising in its fake mode, its host offload, and its parts that watch
    the step (first in the list, and just before the optimizer step)."""

    @property
    def tensors(self) -> AbstractContextManager[object]: ...

    def watchers(
        self, meshes: Meshes, model: torch.nn.Module, pipeline: Pipeline | None, optimizer: torch.optim.Optimizer
    ) -> tuple[StepPart, StepPart]: ...

    def offload(self, device: torch.device) -> HostOffload: ...


def build_training(plan: JobPlan, dataset: Dataset, substitutes: Substitutes | None = None) -> Training:
    """Join the process group and build the sharded model, the optimizer, the data and the step.

    ``substitutes``: the simulator's (see :class:`Substitutes`); it joins a fake process group
    beforehand and builds the model on the meta device outside its fake mode.
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
    cross_entropy: CrossEntropy = cross_entropy_sum
    if plan.parallel.compile_loss:
        cross_entropy = torch.compile(cross_entropy_sum, backend=plan.parallel.compile_backend)
    added = plan.step.terms
    terms = Terms(added, torch.zeros(len(added), device=device))
    if terms.terms:
        cross_entropy = with_terms(cross_entropy, terms.terms, terms.values)
    fake = substitutes.tensors if substitutes is not None else None
    model, parallelized = build_model(plan, meshes, device, cross_entropy, fake)
    with fake or nullcontext():
        return _assemble(plan, dataset, Built(device, meshes, model, parallelized), cross_entropy, terms, substitutes)


@dataclass(frozen=True)
class Terms:
    """The loss's terms beside the cross-entropy (``trainer/step/loss_terms.py``) and the tensor
    their values are recorded in."""

    terms: tuple[LossTerm, ...]
    values: torch.Tensor


@dataclass(frozen=True)
class Built:
    """The model as ``build_model`` leaves it, on its meshes and device."""

    device: torch.device
    meshes: Meshes
    model: Transformer
    parallelized: Parallelized


def _assemble(
    plan: JobPlan,
    dataset: Dataset,
    built: Built,
    cross_entropy: CrossEntropy,
    terms: Terms,
    substitutes: Substitutes | None,
) -> Training:
    """The optimizer, the data, the replica groups and the step around the built model."""
    config, training, device, model = plan.config, plan.config.training, built.device, built.model
    cp = built.parallelized.context_parallel
    positions = cp.positions.to(device) if cp else None
    optimizer = build_optimizer(model, config.optimizer, device.type, config.debug.layout_invariant)
    optimizer_step = OptimizerStep(optimizer, build_lr_scheduler(optimizer, training.steps, config.lr_scheduler))
    loader = build_loader(plan, dataset, built.meshes, device)
    state = TrainState()
    replicas = build_replicas(plan, model, optimizer_step, loader, state, dataset, device)
    forward = Forward(model, ModelLoss(plan.loss_in_model, cross_entropy), plan.parallel.loss_parallel, cp)
    pipeline = build_pipeline(plan, built, cross_entropy, positions)
    totals = (LOSS, WORST, *(term.total for term in terms.terms))
    sums = StepSums(sum_groups(plan, built.meshes), totals, replicas, ordered=config.debug.layout_invariant)
    accumulator, reduction = gradient_parts(plan, built, pipeline, sums)
    balance = build_balance(plan, model, built.meshes, sums)
    watch, watch_optimizer = (
        substitutes.watchers(built.meshes, model, pipeline, optimizer) if substitutes else (None, None)
    )
    parts: list[StepPart | None] = [watch]
    for kind in plan.step.parts:  # the step's parts, in the order they take part
        match kind:
            case "accumulator":
                parts.append(accumulator)
            case "reduction":
                parts.append(reduction)
            case "loss terms":
                parts.append(LossTerms(terms.terms, sums, terms.values))
            case "balance":
                parts.append(balance)
            case "group commit":
                parts.append(GroupCommit(replicas) if replicas is not None else None)
            case "optimizer step":
                parts += [watch_optimizer, optimizer_step]
            case "float8 scales":
                parts.append(float8_scales(built))
    step = Step(
        StepBatches(loader, device, cp, positions, plan.tokenizer.bos_id if training.document_mask else None),
        build_schedule(plan, forward, pipeline, substitutes, device),
        Parts([part for part in parts if part is not None]),
        sums,
        tokens=plan.microbatches * training.local_batch_size * training.seq_len,
    )
    return Training(device, built.meshes, model, optimizer_step, state, step, forward, pipeline, replicas)


def gradient_parts(
    plan: JobPlan, built: Built, pipeline: Pipeline | None, sums: StepSums
) -> tuple[GradAccumulator, GradSync | LayoutInvariantReduction]:
    """The parts that sum the gradients over ranks (FSDP, or the layout-invariant order) and
    normalise and clip them."""
    model, dims, training = built.model, plan.dims, plan.config.training
    reduction: GradSync | LayoutInvariantReduction
    if plan.config.debug.layout_invariant:
        reduction = LayoutInvariantReduction(model, built.meshes.batch.get_group(), dims.dp_shard)
    else:
        reduction = GradSync(
            model,
            sums,
            microbatches=plan.microbatches,
            hsdp=dims.hsdp,
            defer=training.defer_gradient_reduction,
            keep_gathered=dims.fsdp_one_rank and plan.parallel.reshard_after_forward == "never",
            experts_stay_gathered=plan.parallel.experts_stay_gathered,
            degrees=(dims.pp, dims.ep),
        )
    backwards = plan.microbatches if pipeline is None else None
    holds_loss = pipeline is None or pipeline.holds_last
    accumulator = GradAccumulator(
        sums, reduction, microbatches=backwards, max_norm=training.max_norm, holds_loss=holds_loss
    )
    return accumulator, reduction


def float8_scales(built: Built) -> AfterOptimizerStep:
    """Float8 weights gathered by FSDP: their scales in one all-reduce after each step that moved them."""
    modules = built.parallelized.stage_modules or [built.model]
    return AfterOptimizerStep(lambda: precompute_scales(modules))


def build_schedule(
    plan: JobPlan,
    forward: Forward,
    pipeline: Pipeline | None,
    substitutes: Substitutes | None,
    device: torch.device,
) -> StepSchedule:
    """How the step's forwards and backwards run (``trainer/step/schedules.py``), as planned."""
    step = plan.step
    if step.schedule == "pipelined" and pipeline is not None:
        return Pipelined(pipeline, forward, step.prepass)
    if step.schedule == "held forwards":
        offload = None
        if step.offload:
            offload = substitutes.offload(device) if substitutes is not None else host_offload(device)
        return HeldForwards(forward, offload)
    return Interleaved(forward, step.prepass)


def build_loader(plan: JobPlan, dataset: Dataset, meshes: Meshes, device: torch.device) -> MicroBatchLoader:
    """Replica groups shard the data further: group g reads shard g of every step's N-group batch."""
    config, training = plan.config, plan.config.training
    ft = config.fault_tolerance
    group, groups = (ft.replica_id, ft.group_count) if ft.enable else (0, 1)
    return build_dataloader(
        dataset,
        microbatches=plan.microbatches,
        local_batch_size=training.local_batch_size,
        dp_rank=group * plan.dims.dp + meshes.batch.get_local_rank(),
        dp_degree=groups * plan.dims.dp,
        seed=config.debug.seed,
        num_workers=training.num_workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=training.prefetch_factor if training.num_workers > 0 else None,
        allow_data_change=config.checkpoint.allow_data_change,
        timeout_s=training.data_timeout_seconds,
    )


def build_pipeline(
    plan: JobPlan, built: Built, cross_entropy: CrossEntropy, positions: torch.Tensor | None
) -> Pipeline | None:
    parallelized, device, training = built.parallelized, built.device, plan.config.training
    if parallelized.split is None or parallelized.stage_modules is None:
        return None
    feed = PipelineFeed(
        microbatches=plan.pipeline_microbatches,
        microbatch_size=plan.parallel.pp_microbatch_size,
        positions=positions if positions is not None else torch.arange(training.seq_len, device=device),
        labels_to_model=plan.loss_in_model,
        document_mask=training.document_mask,
    )
    return Pipeline(parallelized.stage_modules, parallelized.split, built.meshes.pp, device, cross_entropy, feed)


def sum_groups(plan: JobPlan, meshes: Meshes) -> dict[Ranks, dist.ProcessGroup | None]:
    """The process group of each set of ranks the step's sums run over (``trainer/step/sums.py``)."""
    pipelined = plan.dims.pp > 1
    loss, routing = meshes.loss.get_group(), meshes.routing.get_group()
    return {
        Ranks.TOKENS: loss,
        Ranks.STAGES: meshes.stats.get_group() if pipelined else loss,
        Ranks.ROUTING: routing,
        Ranks.MODEL: routing_stats_group(plan, meshes) if pipelined else routing,
        Ranks.PIPELINE: meshes.pp.get_group() if pipelined else None,
        Ranks.WORLD: dist.group.WORLD,
    }


def routing_stats_group(plan: JobPlan, meshes: Meshes) -> dist.ProcessGroup:
    """The pipeline ranks times the routing mesh, where the MoE statistics of the whole model are
    summed: the stats mesh, and with tensor parallelism (whose ranks route their own shards) every
    rank, as the mesh's dimensions are pp, dp_replicate, dp_shard, cp and tp."""
    if plan.dims.tp == 1:
        return meshes.stats.get_group()
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)  # the process group is initialised
    return world


def build_balance(plan: JobPlan, model: Transformer, meshes: Meshes, sums: StepSums) -> ExpertBalance | None:
    """The step's expert balancing, for a Mixture-of-Experts model (also on a pipeline rank
    whose stages hold no MoE layer: it joins the sums over the stages)."""
    args = plan.model_args
    if not isinstance(args, MoEArgs):
        return None
    moe, pipelined, seq_len = plan.config.moe, plan.dims.pp > 1, plan.config.training.seq_len
    microbatches = (plan.pipeline_microbatches if pipelined else plan.microbatches) * meshes.routing.size()
    settings = BalanceSettings(
        bias_update_rate=moe.bias_update_rate,
        loss_weight=moe.balance_loss_weight,
        loss_scope=moe.balance_loss_scope,
        loss_layers=moe.balance_loss_layers,
        global_sizes=(plan.global_batch_size * seq_len, plan.global_batch_size, microbatches),
        moe_layer_ids=tuple(range(args.n_dense_layers, args.n_layers)),
        n_experts=args.n_experts,
        counting="forwards" if plan.step.schedule == "held forwards" else "prepass" if plan.step.prepass else "none",
    )
    return ExpertBalance(model, sums, settings)


def build_replicas(
    plan: JobPlan,
    model: Transformer,
    optimizer_step: OptimizerStep,
    loader: MicroBatchLoader,
    state: TrainState,
    dataset: Dataset,
    device: torch.device,
) -> ReplicaGroups | None:
    """Join the replica groups (``fault_tolerance.enable``); the resume tells them its step."""
    config = plan.config
    if not config.fault_tolerance.enable:
        return None
    identity = job_identity(plan, getattr(dataset, "identity", None))
    healed = HealedParts(model, optimizer_step.optimizer, optimizer_step.scheduler, loader, state)
    return ReplicaGroups(config.fault_tolerance, healed, identity, device)


@dataclass
class Run:
    """Everything the loop uses: what it trains with (the train state restored from the newest
    checkpoint, if any), the checkpointer, the metrics and the validator."""

    training: Training
    checkpointer: CheckpointManager
    metrics: MetricsLogger
    validator: Validator | None


def build_run(plan: JobPlan, training: Training, dataset: TokenDataset, validation_dataset: TokenDataset | None) -> Run:
    """Resume from the newest checkpoint, open the metrics and the validator; rank 0 saves the
    resolved config and says what is about to run."""
    checkpointer = resume(plan, dataset, training)
    rank = dist.get_rank()
    metrics = build_metrics(plan, training, rank)
    if rank == 0:
        save_config(plan)
        log_start(
            plan,
            training.device,
            metrics,
            data_lines(plan.config, plan.global_batch_size, dataset, validation_dataset),
        )
    if training.replicas is not None:
        # torchft's step is the resumed one: a group resumed from an older checkpoint heals from the others.
        training.replicas.resume_at(training.state.step)
    return Run(training, checkpointer, metrics, build_validator(plan, training, validation_dataset))


def resume(plan: JobPlan, dataset: TokenDataset, training: Training) -> CheckpointManager:
    """The checkpoint manager, the train state restored from the newest checkpoint if any."""
    config = plan.config
    checkpointer = CheckpointManager(
        config.checkpoint,
        config.job.dump_folder,
        Checkpointed(
            model=training.model,
            optimizer=training.optimizer.optimizer,
            lr_scheduler=training.optimizer.scheduler,
            dataloader=training.step.batches.loader,
            train_state=training.state,
            model_args=plan.model_args,
            total_steps=config.training.steps,
            data_identity=getattr(dataset, "identity", None) or {},
        ),
        timeout_s=config.comm.init_timeout_seconds,
        layout_invariant=config.debug.layout_invariant,
        fence=training.optimizer.fence,
    )
    checkpointer.load()
    return checkpointer


def build_metrics(plan: JobPlan, training: Training, rank: int) -> MetricsLogger:
    config, args, dims = plan.config, plan.model_args, plan.dims
    settings = LogSettings(
        console=rank == 0,
        dump_folder=config.job.dump_folder,
        tb_folder=config.metrics.save_tb_folder,
        tensorboard=config.metrics.enable_tensorboard,
        log_freq=config.metrics.log_freq,
        # The entry point's logging.basicConfig sends the console line to stderr.
        color=use_color(config.metrics.disable_color_printing, sys.stderr),
        total_steps=config.training.steps,
        validation=plan.validates,
        resumed=training.state.step > 0,
        wandb=config.metrics.enable_wandb,
    )
    throughput = Throughput(
        device=training.device,
        flops_per_token=model_flops_per_token(args, config.training.seq_len),
        peak_flops=peak_flops(training.device, override=config.training.peak_flops or None),
        global_tokens_per_step=plan.global_batch_size * config.training.seq_len,
        # A data-parallel replica's tokens are processed by its pp x tp x cp devices (torchtitan's
        # non-data-parallel size): tokens/s and MFU are per device of the whole job.
        devices_per_replica=dims.pp * dims.tp * dims.cp,
    )
    logged = training.step.logged()
    sinks = open_sinks(settings, throughput, logged, rank, dataclasses.asdict(config))
    return MetricsLogger(settings, throughput, logged, sinks)


def build_validator(plan: JobPlan, training: Training, dataset: TokenDataset | None) -> Validator | None:
    if dataset is None:
        return None
    validation = plan.config.validation
    return Validator(
        dataset,
        local_batch_size=validation.local_batch_size,
        dp_rank=training.meshes.batch.get_local_rank(),
        dp_degree=plan.dims.dp,
        steps=validation.steps,
        freq=validation.freq,
        seed=plan.config.debug.seed,
    )
