"""The training loop: build, resume, then step, log, validate, checkpoint until the last step or
a stop request.

Parallelism was applied to the model once, while building (``trainer/build.py``); one step is
``trainer/step/train_step.py``. Exit codes and the preparation that precedes the loop are the worker's
(``trainer/entry/worker.py``).
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from trainer.build import Run, build_run, build_training
from trainer.checkpoint.writer import create_seed_checkpoint
from trainer.data.datasets import TokenDataset
from trainer.data.loader import StoppedWaitingForData
from trainer.metrics.reports import MoETimeReport, log_compiled, log_end
from trainer.model.moe import MoEArgs
from trainer.planning.job_plan import JobPlan
from trainer.profiling import profiling
from trainer.runtime.distributed import CollectiveTimeouts
from trainer.runtime.errors import JobError
from trainer.runtime.stop_requests import StopRequests
from trainer.step.train_step import StepStats, train_step
from trainer.train_state import TrainState

logger = logging.getLogger("meshtrain")


def train(
    job_plan: JobPlan,
    dataset: TokenDataset,
    stop: StopRequests | None = None,
    validation_dataset: TokenDataset | None = None,
) -> None:
    """Build, resume, loop. ``stop`` carries SIGTERM / Ctrl-C requests into the loop;
    ``validation_dataset`` (``[validation]``) is evaluated every ``validation.freq`` steps."""
    config = job_plan.config
    stop = stop or StopRequests()
    timeouts = CollectiveTimeouts(config.comm.init_timeout_seconds, config.comm.train_timeout_seconds)
    with timeouts.explained():
        training = build_training(job_plan, dataset)
        if config.checkpoint.create_seed_checkpoint:
            path = create_seed_checkpoint(
                config.checkpoint, config.job.dump_folder, training.model, job_plan.model_args
            )
            logger.info("seed checkpoint written to %s", path)
            dist.destroy_process_group()
            return
        run = build_run(job_plan, training, dataset, validation_dataset)
        replicas, state = training.replicas, training.state
        first_step, start = state.step + 1, time.monotonic()
        try:
            last = loop(job_plan, run, stop, timeouts)
            if replicas is not None:
                replicas.log_digests()
        finally:
            training.step.batches.loader.close()
            if replicas is not None:
                replicas.shutdown()
        run.checkpointer.close()
        run.metrics.close()
        if dist.get_rank() == 0 and last is not None:
            log_end(
                job_plan,
                state.step,
                state.n_skipped_steps,
                last,
                state.step - first_step + 1,
                time.monotonic() - start,
                run.checkpointer.folder,
                run.metrics,
                trained=replicas.committed_steps if replicas is not None else None,
            )
        dist.barrier()
        dist.destroy_process_group()


def loop(job_plan: JobPlan, run: Run, stop: StopRequests, timeouts: CollectiveTimeouts) -> StepStats | None:
    """Step, log, validate when due, stop if asked, checkpoint; until the last step or a stop
    request. Returns the last step's stats (None if no step ran)."""
    training, steps = run.training, job_plan.config.training.steps
    state, replicas = training.state, training.replicas
    # On GPUs the stop flag travels on a CPU group of its own, so it never syncs the device.
    stop.group = dist.new_group(backend="gloo") if training.device.type == "cuda" else None
    stop.checkpointing = job_plan.config.checkpoint.enable
    first_step, stats, trained = state.step + 1, None, False
    stopping = stop.stop_after_step()  # asked to stop while building: there is no step to save
    moe = None
    if isinstance(job_plan.model_args, MoEArgs):
        moe = MoETimeReport(first_step, training.device, dist.get_rank(), job_plan.parallel.compile_model)
    with profiling(job_plan.config.profiling, job_plan.config.job.dump_folder, dist.get_rank()) as profiler:
        while state.step < steps and not stopping:
            if replicas is not None:
                replicas.begin_step()  # may heal this group: the step and the data position with it
                if state.step >= steps:
                    break
            state.step += 1
            if moe is not None:
                moe.before_step(state.step)
            try:
                stats = train_step(training.step, state, stop.requested)
            except StoppedWaitingForData as waited:
                state.step -= 1
                stop_while_waiting(job_plan, run, state, first_step, str(waited))
                stopping = True
                break
            if not stats.result.committed:
                state.step -= 1
                continue
            if replicas is not None:
                replicas.log_step(state.step, stats.result.loss_avg)
            run.metrics.log(stats)
            if moe is not None:
                moe.after_step(state.step, stats)
            if run.validator is not None and run.validator.due(state.step, steps):
                run.metrics.log_validation(state.step, run.validator.run(training))
            check_skipped_steps(state, stats, job_plan.config.training.max_consecutive_skipped_steps)
            stopping = stop.stop_after_step()
            if run.checkpointer.maybe_save(state.step, stopping=stopping) and not stopping:
                stopping = stop.stop_after_step()  # asked during the save: it was this step's
            profiler.step(state.step)
            if not trained:  # the first step done (a healed group's step number jumped to its peer's)
                trained = True
                timeouts.start_training([*training.meshes.groups(), *filter(None, [stop.group])])
                if job_plan.parallel.compile_model or job_plan.parallel.compile_loss:
                    log_compiled(dist.get_rank())
    if moe is not None:
        moe.close()
    if stopping:
        kept = (
            "rerun the same command to resume from the newest checkpoint"
            if job_plan.config.checkpoint.enable
            else "checkpointing is off (`checkpoint.enable`): there is no checkpoint to resume from"
        )
        logger.warning(
            "stopped by %s after step %d; %s", stop.signal_name or "a signal to another rank", state.step, kept
        )
    return stats


def stop_while_waiting(job_plan: JobPlan, run: Run, state: TrainState, first_step: int, waited: str) -> None:
    """A stop request while the next step waits for its data: save the last finished step.

    The other ranks of a larger job are inside that step's collectives, where no checkpoint can
    be agreed on; the job then ends with an error, and the newest checkpoint stays the one to
    resume from.
    """
    if dist.get_world_size() > 1:
        raise JobError(
            f"stopped on request {waited}, while the other ranks were inside that step: no checkpoint of "
            f"step {state.step} can be written; checkpoints already written are kept. A data-loader worker "
            "may be stalled (`training.data_timeout_seconds` bounds that wait)."
        )
    checkpoint = job_plan.config.checkpoint
    if checkpoint.enable and state.step >= first_step and state.step % checkpoint.interval:
        run.checkpointer.save(state.step)
    logger.warning("the stop request came %s; the data loader had not delivered it", waited)


def check_skipped_steps(state: TrainState, stats: StepStats, limit: int) -> None:
    """End the job after ``limit`` skipped steps in a row: it is not training any more."""
    if limit and state.consecutive_skipped_steps >= limit:
        raise JobError(
            f"the last {state.consecutive_skipped_steps} optimizer steps (up to step {state.step}) were all "
            f"skipped ({stats.result.skip_reason}): the run has diverged, or the data has no label to train "
            "on. No checkpoint is written now and the existing ones are kept (any saved during the "
            "streak holds the weights of its last step that was not skipped). Lower `optimizer.lr`, "
            "check the data, and resume from a checkpoint before the divergence (`checkpoint.load_step`); "
            "`training.max_consecutive_skipped_steps = 0` never stops a run for this."
        )
