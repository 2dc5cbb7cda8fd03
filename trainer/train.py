"""Entry point: ``python -m trainer.train [--config FILE] [--mesh ...] [--section.key VALUE ...]``.

The whole run is plan -> build -> loop. Everything that can be wrong with the config, the mesh,
the tokenizer or the data is checked by the plan and the dataset before the process group
exists, so a mistake exits in seconds instead of hanging a collective. Parallelism is applied to
the model once, while building; the loop itself is the algorithm: fetch the step's micro-batches,
forward and backward each, finalize the gradient, step, log.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.tensor_parallel import loss_context
from trainer.build import Trainer, build_trainer, load_dataset
from trainer.checkpoint.manager import CheckpointManager, create_seed_checkpoint
from trainer.config import ConfigError, help_text, load_config, to_toml
from trainer.grad_accumulator import StepResult
from trainer.metrics import MetricsLogger, StepStats, flops_per_token, peak_flops
from trainer.model.llama3 import num_params
from trainer.plan import Plan, plan
from trainer.profiling import profiling
from trainer.train_state import TrainState

logger = logging.getLogger("meshtrain")


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
        dataset = load_dataset(job_plan)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return 2
    train(job_plan, dataset)
    return 0


def train(plan: Plan, dataset: Dataset) -> None:
    config, training = plan.config, plan.config.training
    trainer = build_trainer(plan, dataset)
    rank = dist.get_rank()
    if config.checkpoint.create_seed_checkpoint:
        path = create_seed_checkpoint(config.checkpoint, config.job.dump_folder, trainer.model, plan.model_args)
        logger.info("seed checkpoint written to %s", path)
        dist.destroy_process_group()
        return
    state = TrainState()
    checkpointer = CheckpointManager(
        config.checkpoint,
        config.job.dump_folder,
        model=trainer.model,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.scheduler,
        dataloader=trainer.loader,
        train_state=state,
        model_args=plan.model_args,
        total_steps=training.steps,
    )
    checkpointer.load()
    if rank == 0:
        dump = Path(config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(to_toml(config))
        logger.info("resolved config (saved to %s):\n%s", dump / "config.toml", to_toml(config))
    metrics = build_metrics(plan, trainer, rank)
    if rank == 0:
        log_start(plan, trainer, metrics)

    with profiling(config.profiling, config.job.dump_folder, rank) as profiler:
        while state.step < training.steps:
            state.step += 1
            metrics.log(train_step(trainer, state, local_tokens_per_step(plan)))
            checkpointer.maybe_save(state.step)
            profiler.step(state.step)
    checkpointer.close()
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


def train_step(trainer: Trainer, state: TrainState, local_tokens: int) -> StepStats:
    """Fetch the step's micro-batches, forward and backward each, finalize, step."""
    step_start = time.perf_counter()
    microbatches = fetch_step(trainer)
    data_time = time.perf_counter() - step_start
    result = forward_backward(trainer, microbatches)
    lr = optimizer_step(trainer, result)
    if result.skipped:
        state.n_skipped_steps += 1
    return StepStats(
        step=state.step,
        loss_avg=result.loss_avg,
        loss_max=result.loss_max,
        grad_norm=result.grad_norm,
        lr=lr,
        n_valid_tokens=result.n_valid_tokens,
        local_tokens=local_tokens,
        n_skipped_steps=state.n_skipped_steps,
        data_time_s=data_time,
        step_time_s=time.perf_counter() - step_start,
    )


def fetch_step(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the next step (its sequence shard under CP), on the device."""
    microbatches = []
    for inputs, labels in trainer.loader.next_step():
        if trainer.context_parallel:
            inputs, labels = trainer.context_parallel.shard(inputs), trainer.context_parallel.shard(labels)
        microbatches.append(
            (inputs.to(trainer.device, non_blocking=True), labels.to(trainer.device, non_blocking=True))
        )
    return microbatches


def forward_backward(trainer: Trainer, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
    """Accumulate summed-loss gradients over the micro-batches; finalize normalises and clips."""
    accumulator = trainer.accumulator
    accumulator.begin_step([labels for _, labels in microbatches])
    cp = trainer.context_parallel
    with loss_context(trainer.loss_parallel), cp.attention_context() if cp else nullcontext():
        for i, (inputs, labels) in enumerate(microbatches):
            accumulator.prepare_backward(i)
            loss = trainer.loss_fn(trainer.model(inputs, trainer.positions), labels)
            loss.backward()
            accumulator.record_loss(loss)
    return accumulator.finalize()


def optimizer_step(trainer: Trainer, result: StepResult) -> float:
    """Step (unless the step was skipped), clear the gradients, advance the schedule; return the LR used."""
    if not result.skipped:
        trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    lr = trainer.scheduler.get_last_lr()[0]
    trainer.scheduler.step()
    return lr


def local_tokens_per_step(plan: Plan) -> int:
    """Input tokens one rank's data-parallel replica processes per step (before CP sharding)."""
    return plan.microbatches * plan.config.training.local_batch_size * plan.config.training.seq_len


def build_metrics(plan: Plan, trainer: Trainer, rank: int) -> MetricsLogger:
    config, training, args = plan.config, plan.config.training, plan.model_args
    return MetricsLogger(
        rank=rank,
        console=rank == 0,
        dump_folder=config.job.dump_folder,
        tb_folder=config.metrics.save_tb_folder,
        enable_tensorboard=config.metrics.enable_tensorboard,
        log_freq=config.metrics.log_freq,
        color=not config.metrics.disable_color_printing,
        device=trainer.device,
        total_steps=training.steps,
        flops_per_token=flops_per_token(
            num_params(trainer.model, exclude_embedding=True), args.n_layers, args.dim, training.seq_len
        ),
        peak_flops=peak_flops(trainer.device, override=training.peak_flops or None),
        global_tokens_per_step=plan.global_batch_size * training.seq_len,
        devices_per_replica=plan.dims.tp * plan.dims.cp,
    )


def log_start(plan: Plan, trainer: Trainer, metrics: MetricsLogger) -> None:
    config, dims, training = plan.config, plan.dims, plan.config.training
    logger.info(
        "%s %s: %s parameters | mesh dp_replicate=%d dp_shard=%d cp=%d tp=%d on %s | "
        "global batch %d x %d tokens = %d micro-batch(es) of %d per rank",
        config.model.name, config.model.flavor, f"{num_params(trainer.model):,}", dims.dp_replicate,
        dims.dp_shard, dims.cp, dims.tp, trainer.device.type, plan.global_batch_size,
        training.seq_len, plan.microbatches, training.local_batch_size,
    )
    if metrics.tb_dir:
        logger.info("TensorBoard: tensorboard --logdir %s", metrics.tb_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
