"""Entry point: ``python -m trainer.train [--config FILE] [--mesh ...] [--section.key VALUE ...]``.

Everything that can be wrong with the config, the mesh, the tokenizer or the data is checked
before the process group exists, so a mistake exits in seconds instead of hanging a collective.
Parallelism is applied to the model once, before the loop; the loop itself is the algorithm:
fetch the step's micro-batches, forward and backward each, finalize the gradient, step, log.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.context_parallel import ContextParallel
from parallelisms.data_parallel import apply_fsdp
from parallelisms.parallel_dims import Meshes, ParallelDims, device_type
from parallelisms.tensor_parallel import apply_tp, loss_context
from trainer.checkpoint import CheckpointManager, TrainState, create_seed_checkpoint
from trainer.config import REPO_ROOT, ConfigError, JobConfig, help_text, load_config, to_toml
from trainer.data.loader import MicroBatchLoader, build_dataloader
from trainer.data.samples import build_dataset
from trainer.data.tokenizer import Tokenizer
from trainer.grad_accumulator import GradAccumulator, StepResult
from trainer.loss import cross_entropy_sum
from trainer.metrics import MetricsLogger, StepStats, flops_per_token, peak_flops
from trainer.model import VOCAB_MULTIPLE, ModelArgs, Transformer, model_args, num_params
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.profiling import profiling

logger = logging.getLogger("meshtrain")


@dataclass
class Plan:
    """What the config resolves to on this world size, computed before any process group."""

    config: JobConfig
    dims: ParallelDims
    microbatches: int
    global_batch_size: int
    model_args: ModelArgs
    dataset: Dataset

    @property
    def loss_parallel(self) -> bool:
        return self.dims.tp > 1 and not self.config.parallelism.disable_loss_parallel


def resolve_path(path: str) -> str:
    """A relative path that does not exist from the working directory is tried from the repo root."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not (REPO_ROOT / p).exists():
        return str(p)
    return str(REPO_ROOT / p)


def plan(config: JobConfig, world_size: int) -> Plan:
    """Validate the config against the world size; raise ``ConfigError`` naming the key."""
    p = config.parallelism
    dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        world_size=world_size,
    )
    t = config.training
    per_microbatch = t.local_batch_size * dims.dp
    global_batch = per_microbatch if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"`training.global_batch_size` = {global_batch} is not divisible by "
            f"`training.local_batch_size` x data-parallel degree = {t.local_batch_size} x {dims.dp} = "
            f"{per_microbatch}; gradient accumulation needs a whole number of micro-batches. "
            f"Use a multiple of {per_microbatch}."
        )
    tokenizer = Tokenizer(resolve_path(config.model.tokenizer_path))
    try:
        args = model_args(config.model.flavor, tokenizer.vocab_size, t.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_tensor_parallel(config, args, dims.tp)
    check_context_parallel(config, dims)
    if compiles(config, "loss") and dims.tp > 1 and not config.parallelism.disable_loss_parallel:
        raise ConfigError(
            "`compile.components` includes `loss`, which torch.compile does not trace correctly "
            "inside `loss_parallel()` (the gradients come out wrong); with tensor parallelism "
            "use `--compile.components model`, or set `parallelism.disable_loss_parallel`."
        )
    if config.profiling.enable_memory_snapshot and device_type() != "cuda":
        raise ConfigError("`profiling.enable_memory_snapshot` records the CUDA allocator: it needs a GPU.")
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"`checkpoint.create_seed_checkpoint` runs on one process, not {world_size}: launch it with NGPU=1."
        )
    dataset_path = resolve_path(t.dataset_path) if t.dataset_path else None
    dataset = build_dataset(t.dataset, dataset_path, tokenizer, t.seq_len)
    return Plan(config, dims, global_batch // per_microbatch, global_batch, args, dataset)


def check_tensor_parallel(config: JobConfig, args: ModelArgs, tp: int) -> None:
    """Tensor parallelism splits heads, sequence and vocabulary evenly: each must divide by tp."""
    if tp == 1:
        return
    key = "parallelism.tensor_parallel_degree"
    splits = {
        f"attention heads (model.flavor {config.model.flavor})": args.n_heads,
        f"key/value heads (model.flavor {config.model.flavor})": args.kv_heads,
        "tokens per sequence (training.seq_len)": config.training.seq_len,
        f"vocabulary rows (the tokenizer's vocabulary padded to a multiple of {VOCAB_MULTIPLE})": args.vocab_size,
    }
    for what, size in splits.items():
        if size % tp:
            raise ConfigError(f"`{key}` = {tp} does not divide the {size} {what}; choose a tp that does.")
    if config.parallelism.enable_async_tensor_parallel and device_type() != "cuda":
        raise ConfigError(
            "`parallelism.enable_async_tensor_parallel` needs CUDA (symmetric memory and "
            "torch.compile's micro-pipeline rewrite); turn it off on this machine."
        )


def context_parallel_backend(config: JobConfig) -> str:
    backend = config.parallelism.context_parallel_backend
    if backend == "auto":
        return "ring" if device_type() == "cuda" else "allgather_kv"
    return backend


def check_context_parallel(config: JobConfig, dims: ParallelDims) -> None:
    """Head-tail sharding needs 2 x cp equal chunks, each split again by sequence-parallel TP."""
    if dims.cp == 1:
        return
    seq_len, multiple = config.training.seq_len, 2 * dims.cp * dims.tp
    if seq_len % multiple:
        raise ConfigError(
            f"`training.seq_len` = {seq_len} must be divisible by 2 x context_parallel_degree x "
            f"tensor_parallel_degree = {multiple} (every sequence is cut into 2 x cp load-balanced "
            f"chunks, each split over tp); use a multiple of {multiple}."
        )
    backend = context_parallel_backend(config)
    if backend == "ring" and device_type() != "cuda":
        raise ConfigError(
            "`parallelism.context_parallel_backend` = \"ring\" needs CUDA (PyTorch's context "
            "parallelism has no CPU kernels); use \"allgather_kv\" or \"auto\"."
        )
    if backend == "allgather_kv" and config.parallelism.context_parallel_rotate_method != "allgather":
        raise ConfigError(
            "`parallelism.context_parallel_rotate_method` applies to the ring backend only; the "
            "allgather_kv backend always all-gathers keys and values. Remove the setting or use "
            "`parallelism.context_parallel_backend = \"ring\"` on CUDA."
        )


def compute_dtype(setting: str, device: torch.device) -> str:
    """``training.mixed_precision_param``, with ``auto`` resolved: bf16 on GPU, fp32 on CPU."""
    if setting != "auto":
        return setting
    return "bfloat16" if device.type == "cuda" else "float32"


def compiles(config: JobConfig, component: str) -> bool:
    return config.compile.enable and component in config.compile.components


def init_distributed(dev_type: str) -> torch.device:
    """Join the job's process group (one of world size 1 when not launched by torchrun), once."""
    backend = "nccl" if dev_type == "cuda" else "gloo"
    if dev_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if dev_type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def build_model(plan: Plan, meshes: Meshes, device: torch.device) -> Transformer:
    """Build on the meta device, shard, then materialise and initialise only the local shards."""
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    p, t = plan.config.parallelism, plan.config.training
    if plan.dims.tp > 1:
        apply_tp(
            model,
            meshes.tp,
            loss_parallel=plan.loss_parallel,
            async_tp=p.enable_async_tensor_parallel,
        )
    ac = plan.config.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_ac_option)
    if compiles(plan.config, "model"):
        for block in model.layers.values():
            block.compile()  # in place, so parameter names stay the same
    param_dtype = compute_dtype(t.mixed_precision_param, device)
    apply_fsdp(
        model,
        meshes.param,
        param_dtype=getattr(torch, param_dtype),
        reduce_dtype=getattr(torch, t.mixed_precision_reduce),
        reshard_after_forward=p.fsdp_reshard_after_forward,
    )
    model.to_empty(device=device)
    model.init_weights(plan.config.debug.seed)
    return model


@dataclass
class Job:
    """Everything the loop uses, built once with every parallelism already applied."""

    device: torch.device
    meshes: Meshes
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: MicroBatchLoader
    accumulator: GradAccumulator
    loss_parallel: bool
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    context_parallel: ContextParallel | None
    positions: torch.Tensor | None
    """Sequence positions of this rank's tokens under context parallelism (else 0..seq-1)."""


def build_job(plan: Plan) -> Job:
    """Join the process group and build the sharded model, optimizer, data and accumulator."""
    config, t = plan.config, plan.config.training
    dev_type = device_type()
    device = init_distributed(dev_type)
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(config.debug.seed)
    meshes = plan.dims.build_mesh(dev_type)
    model = build_model(plan, meshes, device)
    cp = None
    if plan.dims.cp > 1:
        cp = ContextParallel(
            meshes.cp,
            t.seq_len,
            backend=context_parallel_backend(config),
            rotate_method=config.parallelism.context_parallel_rotate_method,
        )
        cp.apply(model)
    optimizer = build_optimizer(model, config.optimizer, dev_type)
    loader = build_dataloader(
        plan.dataset,
        microbatches=plan.microbatches,
        local_batch_size=t.local_batch_size,
        dp_rank=meshes.batch.get_local_rank(),
        dp_degree=plan.dims.dp,
        seed=config.debug.seed,
        num_workers=t.num_workers,
        pin_memory=dev_type == "cuda",
        prefetch_factor=t.prefetch_factor if t.num_workers > 0 else None,
    )
    accumulator = GradAccumulator(
        model,
        loss_group=meshes.loss.get_group(),
        num_microbatches=plan.microbatches,
        max_norm=t.max_norm,
        hsdp=plan.dims.hsdp,
        defer_gradient_reduction=t.defer_gradient_reduction,
    )
    return Job(
        device=device,
        meshes=meshes,
        model=model,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, t.steps, config.lr_scheduler),
        loader=loader,
        accumulator=accumulator,
        loss_parallel=plan.loss_parallel,
        loss_fn=torch.compile(cross_entropy_sum) if compiles(config, "loss") else cross_entropy_sum,
        context_parallel=cp,
        positions=cp.positions.to(device) if cp else None,
    )


def fetch_step(job: Job) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the next step (its sequence shard under CP), on the device."""
    microbatches = []
    for inputs, labels in job.loader.next_step():
        if job.context_parallel:
            inputs, labels = job.context_parallel.shard(inputs), job.context_parallel.shard(labels)
        microbatches.append((inputs.to(job.device, non_blocking=True), labels.to(job.device, non_blocking=True)))
    return microbatches


def forward_backward(job: Job, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
    """Accumulate summed-loss gradients over the micro-batches; finalize normalises and clips."""
    accumulator = job.accumulator
    accumulator.begin_step([labels for _, labels in microbatches])
    attention_context = job.context_parallel.attention_context() if job.context_parallel else nullcontext()
    with loss_context(job.loss_parallel), attention_context:
        for i, (inputs, labels) in enumerate(microbatches):
            accumulator.prepare_backward(i)
            loss = job.loss_fn(job.model(inputs, job.positions), labels)
            loss.backward()
            accumulator.record_loss(loss)
    return accumulator.finalize()


def train(plan: Plan) -> None:
    config, t = plan.config, plan.config.training
    job = build_job(plan)
    rank = dist.get_rank()
    if config.checkpoint.create_seed_checkpoint:
        path = create_seed_checkpoint(config.checkpoint, config.job.dump_folder, job.model, plan.model_args)
        logger.info("seed checkpoint written to %s", path)
        dist.destroy_process_group()
        return
    train_state = TrainState(job.accumulator)
    checkpointer = CheckpointManager(
        config.checkpoint,
        config.job.dump_folder,
        model=job.model,
        optimizer=job.optimizer,
        lr_scheduler=job.scheduler,
        dataloader=job.loader,
        train_state=train_state,
        model_args=plan.model_args,
        total_steps=t.steps,
    )
    start = checkpointer.load()
    if rank == 0:
        dump = Path(config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(to_toml(config))
        logger.info("resolved config (saved to %s):\n%s", dump / "config.toml", to_toml(config))
    args = plan.model_args
    metrics = MetricsLogger(
        rank=rank,
        console=rank == 0,
        dump_folder=config.job.dump_folder,
        tb_folder=config.metrics.save_tb_folder,
        enable_tensorboard=config.metrics.enable_tensorboard,
        log_freq=config.metrics.log_freq,
        color=not config.metrics.disable_color_printing,
        device=job.device,
        total_steps=t.steps,
        flops_per_token=flops_per_token(
            num_params(job.model, exclude_embedding=True), args.n_layers, args.dim, t.seq_len
        ),
        peak_flops=peak_flops(job.device, override=t.peak_flops or None),
        global_tokens_per_step=plan.global_batch_size * t.seq_len,
        devices_per_replica=plan.dims.tp * plan.dims.cp,
    )
    if rank == 0:
        logger.info(
            "%s %s: %s parameters | mesh dp_replicate=%d dp_shard=%d cp=%d tp=%d on %s | "
            "global batch %d x %d tokens = %d micro-batch(es) of %d per rank",
            config.model.name, config.model.flavor, f"{num_params(job.model):,}", plan.dims.dp_replicate,
            plan.dims.dp_shard, plan.dims.cp, plan.dims.tp, job.device.type, plan.global_batch_size,
            t.seq_len, plan.microbatches, t.local_batch_size,
        )
        if metrics.tb_dir:
            logger.info("TensorBoard: tensorboard --logdir %s", metrics.tb_dir)

    local_tokens = plan.microbatches * t.local_batch_size * t.seq_len
    with profiling(config.profiling, config.job.dump_folder, rank, start) as profiler:
        for step in range(start + 1, t.steps + 1):
            train_step(job, step, local_tokens, metrics)
            train_state.step = step
            checkpointer.maybe_save(step)
            profiler.step()
    checkpointer.close()
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


def train_step(job: Job, step: int, local_tokens: int, metrics: MetricsLogger) -> None:
    """Fetch the step's micro-batches, forward and backward each, finalize, step, log."""
    step_start = time.perf_counter()
    microbatches = fetch_step(job)
    data_time = time.perf_counter() - step_start

    result = forward_backward(job, microbatches)
    if not result.skipped:
        job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    lr = job.scheduler.get_last_lr()[0]
    job.scheduler.step()

    metrics.log(
        StepStats(
            step=step,
            loss_avg=result.loss_avg,
            loss_max=result.loss_max,
            grad_norm=result.grad_norm,
            lr=lr,
            n_valid_tokens=result.n_valid_tokens,
            local_tokens=local_tokens,
            n_skipped_steps=job.accumulator.n_skipped_steps,
            data_time_s=data_time,
            step_time_s=time.perf_counter() - step_start,
        )
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="[%(name)s] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        config = load_config(argv)
        job_plan = plan(config, int(os.environ.get("WORLD_SIZE", 1)))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return 2
    train(job_plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
