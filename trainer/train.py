"""Entry point: ``python -m trainer.train [--config FILE] [--mesh ...] [--section.key VALUE ...]``.

The whole run is plan -> build -> loop. Everything that can be wrong with the config, the mesh,
the tokenizer, the data or the dump folder is checked by the plan and the dataset before the
process group exists, so a mistake exits in seconds instead of hanging a collective; rank 0 then
locks the dump folder. Parallelism is applied to the model once, while building; the loop
itself is the algorithm: fetch the step's micro-batches, forward and backward each, finalize
the gradient, step, log.

Exit codes: 0 when the run finished or stopped on request (SIGTERM, Ctrl-C: after the current
step, with a checkpoint), 2 for a configuration error or a busy dump folder (before any process
group), 1 for a failure while running (divergence, a stalled rank, a full disk; the message says
what was kept and what to do), 130 when aborted by a second Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.tensor_parallel import loss_context
from trainer.build import MicroBatch, Trainer, build_trainer, data_lines, load_dataset, load_validation_dataset
from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.manager import CheckpointManager, create_seed_checkpoint
from trainer.config import ConfigError, changed_settings, help_text, load_config, to_toml
from trainer.grad_accumulator import StepResult
from trainer.metrics import MetricsLogger, StepStats, flops_per_token, format_duration, peak_flops, use_color
from trainer.model.llama3 import ModelArgs, Transformer, num_params
from trainer.plan import Plan, check_memory, describe, memory_limit, plan
from trainer.runtime.distributed import CollectiveTimeouts
from trainer.runtime.dump_folder import DumpFolderLock
from trainer.runtime.errors import JobError
from trainer.runtime.profiling import profiling
from trainer.runtime.stop_requests import StopRequests
from trainer.train_state import TrainState
from trainer.validation import Validator

logger = logging.getLogger("meshtrain")


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="[%(name)s] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    if "--help" in argv or "-h" in argv:
        print(help_text(argv))
        return 0
    if "--dry-run" in argv:
        return dry_run([a for a in argv if a != "--dry-run"], int(os.environ.get("WORLD_SIZE", 1)))
    stop = StopRequests()
    with stop.installed():
        return _main(argv, stop)


def _main(argv: list[str], stop: StopRequests) -> int:
    try:
        config = load_config(argv)
        job_plan = plan(config, int(os.environ.get("WORLD_SIZE", 1)))
        limit, where = memory_limit(
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)), started=True
        )
        if int(os.environ.get("RANK", 0)) == 0:
            logger.info("memory estimate: %s", job_plan.memory.line())
        check_memory(job_plan, limit, where)
        dataset = load_dataset(job_plan)
        validation_dataset = load_validation_dataset(job_plan)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return 2
    lock = DumpFolderLock(config.job.dump_folder) if int(os.environ.get("RANK", 0)) == 0 else None
    try:
        if lock is not None:
            lock.acquire()
    except JobError as e:
        print(f"meshtrain: {e}", file=sys.stderr)
        return 2
    try:
        train(job_plan, dataset, stop, validation_dataset)
    except JobError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshtrain: aborted (no checkpoint of the current step)", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.release()
    return 0


def dry_run(argv: list[str], world_size: int) -> int:
    """Check everything and print what the job would be, without training (``--dry-run``)."""
    try:
        job_plan = plan(load_config(argv), world_size)
        dataset = load_dataset(job_plan)
        validation_dataset = load_validation_dataset(job_plan)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return 2
    limit, where = memory_limit(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), None, started=False)
    print(describe(job_plan, limit, where))
    print(data_lines(job_plan, dataset, validation_dataset))
    try:
        check_memory(job_plan, limit, where)
    except ConfigError as e:
        print(f"meshtrain: config error: {e}", file=sys.stderr)
        return 2
    return 0


def train(
    plan: Plan, dataset: Dataset, stop: StopRequests | None = None, validation_dataset: Dataset | None = None
) -> None:
    """Build, resume, loop. ``stop`` carries SIGTERM / Ctrl-C requests into the loop;
    ``validation_dataset`` (``[validation]``) is evaluated every ``validation.freq`` steps."""
    config = plan.config
    stop = stop or StopRequests()
    timeouts = CollectiveTimeouts(config.comm.init_timeout_seconds, config.comm.train_timeout_seconds)
    with timeouts.explained():
        trainer = build_trainer(plan, dataset)
        if config.checkpoint.create_seed_checkpoint:
            path = create_seed_checkpoint(config.checkpoint, config.job.dump_folder, trainer.model, plan.model_args)
            logger.info("seed checkpoint written to %s", path)
            dist.destroy_process_group()
            return
        state, checkpointer = resume(plan, dataset, trainer)
        metrics = start_metrics(plan, trainer, dataset, validation_dataset)
        validator = build_validator(plan, trainer, validation_dataset)
        first_step, start = state.step + 1, time.monotonic()
        last = loop(plan, trainer, state, checkpointer, metrics, stop, timeouts, validator)
        checkpointer.close()
        metrics.close()
        if dist.get_rank() == 0 and last is not None:
            log_end(plan, state, last, state.step - first_step + 1, time.monotonic() - start, checkpointer, metrics)
        dist.barrier()
        dist.destroy_process_group()


def loop(
    plan: Plan,
    trainer: Trainer,
    state: TrainState,
    checkpointer: CheckpointManager,
    metrics: MetricsLogger,
    stop: StopRequests,
    timeouts: CollectiveTimeouts,
    validator: Validator | None = None,
) -> StepStats | None:
    """Step, log, validate when due, stop if asked, checkpoint; until the last step or a stop
    request. Returns the last step's stats (None if no step ran)."""
    training = plan.config.training
    # On GPUs the stop flag travels on a CPU group of its own, so it never syncs the device.
    stop.group = dist.new_group(backend="gloo") if trainer.device.type == "cuda" else None
    first_step, stats = state.step + 1, None
    stopping = stop.stop_after_step()  # asked to stop while building: there is no step to save
    with profiling(plan.config.profiling, plan.config.job.dump_folder, dist.get_rank()) as profiler:
        while state.step < training.steps and not stopping:
            state.step += 1
            stats = train_step(trainer, state, local_tokens_per_step(plan))
            metrics.log(stats)
            if validator is not None and validator.due(state.step, training.steps):
                metrics.log_validation(state.step, validator.run(trainer))
            check_skipped_steps(state, stats, training.max_consecutive_skipped_steps)
            stopping = stop.stop_after_step()
            checkpointer.maybe_save(state.step, stopping=stopping)
            profiler.step(state.step)
            if state.step == first_step:
                timeouts.start_training([*trainer.meshes.groups(), *filter(None, [stop.group])])
    if stopping:
        logger.warning("stopped by %s after step %d", stop.signal_name or "a signal to another rank", state.step)
    return stats


def resume(plan: Plan, dataset: Dataset, trainer: Trainer) -> tuple[TrainState, CheckpointManager]:
    """The train state and the checkpoint manager, restored from the newest checkpoint if any."""
    config = plan.config
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
        total_steps=config.training.steps,
        data_identity=getattr(dataset, "identity", None),
        timeout_s=config.comm.init_timeout_seconds,
    )
    try:
        checkpointer.load()
    except (ValueError, FileNotFoundError) as e:  # a checkpoint that does not fit this run
        raise JobError(str(e)) from e
    return state, checkpointer


def check_skipped_steps(state: TrainState, stats: StepStats, limit: int) -> None:
    """End the job after ``limit`` skipped steps in a row: it is not training any more."""
    if limit and state.consecutive_skipped_steps >= limit:
        raise JobError(
            f"the last {state.consecutive_skipped_steps} optimizer steps (up to step {state.step}) were all "
            f"skipped ({stats.skip_reason}): the run has diverged, or the data has no label to train "
            "on. No checkpoint is written now and the existing ones are kept (any saved during the "
            "streak holds the weights of its last step that was not skipped). Lower `optimizer.lr`, "
            "check the data, and resume from a checkpoint before the divergence (`checkpoint.load_step`); "
            "`training.max_consecutive_skipped_steps = 0` never stops a run for this."
        )


def train_step(trainer: Trainer, state: TrainState, local_tokens: int) -> StepStats:
    """Fetch the step's micro-batches, forward and backward each, finalize, step."""
    step_start = time.perf_counter()
    microbatches = fetch_step(trainer)
    data_time = time.perf_counter() - step_start
    result = forward_backward(trainer, microbatches)
    lr = optimizer_step(trainer, result)
    state.record_step(result.skipped)
    return StepStats(
        step=state.step,
        loss_avg=result.loss_avg,
        loss_max=result.loss_max,
        grad_norm=result.grad_norm,
        lr=lr,
        n_valid_tokens=result.n_valid_tokens,
        local_tokens=local_tokens,
        n_skipped_steps=state.n_skipped_steps,
        skip_reason=result.skip_reason,
        data_time_s=data_time,
        step_time_s=time.perf_counter() - step_start,
    )


def fetch_step(trainer: Trainer) -> list[MicroBatch]:
    """This rank's micro-batches of the next step, on the device."""
    return [trainer.place(inputs, labels) for inputs, labels in trainer.loader.next_step()]


def forward_backward(trainer: Trainer, microbatches: list[MicroBatch]) -> StepResult:
    """Accumulate summed-loss gradients over the micro-batches; finalize normalises and clips."""
    if trainer.pipeline is not None:
        return pipeline_forward_backward(trainer, microbatches)
    accumulator = trainer.accumulator
    accumulator.begin_step([mb.labels for mb in microbatches])
    cp = trainer.context_parallel
    with loss_context(trainer.loss_parallel), cp.attention_context() if cp else nullcontext():
        for i, (inputs, labels, positions, document_ids) in enumerate(microbatches):
            accumulator.prepare_backward(i)
            loss = trainer.loss_fn(trainer.model(inputs, positions, document_ids), labels)
            loss.backward()
            accumulator.record_loss(loss)
    return accumulator.finalize()


def pipeline_forward_backward(trainer: Trainer, microbatches: list[MicroBatch]) -> StepResult:
    """The rank's micro-batches are one batch for the pipeline schedule, which cuts it into
    pipeline micro-batches and runs every forward and backward on summed losses; finalize
    normalises and clips as without PP."""
    accumulator = trainer.accumulator
    accumulator.begin_step([mb.labels for mb in microbatches])
    inputs, labels = torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.labels for mb in microbatches])
    # Under document masking, each sample's positions and document ids go through the schedule.
    positions, document_ids = (
        (torch.cat([mb.positions for mb in microbatches]), torch.cat([mb.document_ids for mb in microbatches]))
        if microbatches[0].document_ids is not None
        else (None, None)
    )
    cp = trainer.context_parallel
    with loss_context(trainer.loss_parallel), cp.attention_context() if cp else nullcontext():
        losses = trainer.pipeline.step(inputs, labels, positions, document_ids)
    accumulator.record_pipeline_losses(losses)
    return accumulator.finalize()


def optimizer_step(trainer: Trainer, result: StepResult) -> float:
    """Step (unless the step was skipped), clear the gradients, advance the schedule; return the LR used."""
    if not result.skipped:
        trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    lr = trainer.scheduler.get_last_lr()[0]
    trainer.scheduler.step()
    return lr


def build_validator(plan: Plan, trainer: Trainer, dataset: Dataset | None) -> Validator | None:
    if dataset is None:
        return None
    validation = plan.config.validation
    return Validator(
        dataset,
        local_batch_size=validation.local_batch_size,
        dp_rank=trainer.meshes.batch.get_local_rank(),
        dp_degree=plan.dims.dp,
        steps=validation.steps,
        freq=validation.freq,
        seed=plan.config.debug.seed,
    )


def local_tokens_per_step(plan: Plan) -> int:
    """Input tokens one rank's data-parallel replica processes per step (before CP sharding)."""
    return plan.microbatches * plan.config.training.local_batch_size * plan.config.training.seq_len


def start_metrics(plan: Plan, trainer: Trainer, dataset: Dataset, validation_dataset: Dataset | None) -> MetricsLogger:
    """Save the resolved config, open the metrics, and say what is about to run (rank 0)."""
    rank = dist.get_rank()
    metrics = build_metrics(plan, trainer, rank)
    if rank == 0:
        config_file = Path(plan.config.job.dump_folder) / "config.toml"
        config_file.write_text(to_toml(plan.config))
        changed = changed_settings(plan.config)
        summary = textwrap.fill(" ".join(changed), width=110, initial_indent="  ", subsequent_indent="  ")
        logger.info(
            "config: %d settings differ from the code's defaults (all in %s):\n%s", len(changed), config_file, summary
        )
        log_start(plan, trainer, metrics, dataset, validation_dataset)
    return metrics


def build_metrics(plan: Plan, trainer: Trainer, rank: int) -> MetricsLogger:
    config, training, args = plan.config, plan.config.training, plan.model_args
    return MetricsLogger(
        rank=rank,
        console=rank == 0,
        dump_folder=config.job.dump_folder,
        tb_folder=config.metrics.save_tb_folder,
        enable_tensorboard=config.metrics.enable_tensorboard,
        log_freq=config.metrics.log_freq,
        # main()'s logging.basicConfig sends the console line to stderr.
        color=use_color(config.metrics.disable_color_printing, sys.stderr),
        device=trainer.device,
        total_steps=training.steps,
        flops_per_token=flops_per_token(
            num_params(whole_model(args), exclude_embedding=True), args.n_layers, args.dim, training.seq_len
        ),
        peak_flops=peak_flops(trainer.device, override=training.peak_flops or None),
        global_tokens_per_step=plan.global_batch_size * training.seq_len,
        # A data-parallel replica's tokens are processed by its pp x tp x cp devices (torchtitan's
        # non-data-parallel size): tokens/s and MFU are per device of the whole job.
        devices_per_replica=plan.dims.pp * plan.dims.tp * plan.dims.cp,
        validation=plan.validates,
    )


def whole_model(args: ModelArgs) -> torch.nn.Module:
    """The unsplit model on the meta device (no memory): what FLOPs and parameter counts describe
    even when this rank holds only some pipeline stages."""
    with torch.device("meta"):
        return Transformer(args)


def log_start(
    plan: Plan, trainer: Trainer, metrics: MetricsLogger, dataset: Dataset, validation_dataset: Dataset | None
) -> None:
    config, dims, training = plan.config, plan.dims, plan.config.training
    logger.info(
        "%s %s: %s parameters | mesh pp=%d dp_replicate=%d dp_shard=%d cp=%d tp=%d on %s | "
        "global batch %d x %d tokens = %d micro-batch(es) of %d per rank",
        config.model.name,
        config.model.flavor,
        f"{num_params(whole_model(plan.model_args)):,}",
        dims.pp,
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        dims.tp,
        trainer.device.type,
        plan.global_batch_size,
        training.seq_len,
        plan.microbatches,
        training.local_batch_size,
    )
    logger.info(data_lines(plan, dataset, validation_dataset))
    if metrics.tb_dir:
        logger.info("TensorBoard: tensorboard --logdir %s", metrics.tb_dir)


def log_end(
    plan: Plan,
    state: TrainState,
    last: StepStats,
    steps: int,
    seconds: float,
    checkpointer: CheckpointManager,
    metrics: MetricsLogger,
) -> None:
    """What the run did and where its results are, in a few lines (rank 0)."""
    tokens = steps * plan.global_batch_size * plan.config.training.seq_len
    saved = step_folders(checkpointer.folder) if plan.config.checkpoint.enable else []
    logger.info(
        "done: steps %d-%d of %d (%d skipped in all) in %s, %s tokens (%s tokens/s); final loss %.4f\n"
        "  checkpoint: %s\n  TensorBoard: %s",
        state.step - steps + 1,
        state.step,
        plan.config.training.steps,
        state.n_skipped_steps,
        format_duration(seconds),
        f"{tokens:,}",
        f"{tokens / max(seconds, 1e-9):,.0f}",
        last.loss_avg,
        saved[-1][1] if saved else "none (`--checkpoint.enable` saves them)",
        f"tensorboard --logdir {metrics.tb_dir}" if metrics.tb_dir else "off",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
