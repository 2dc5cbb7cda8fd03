"""What the run says when it starts and when it ends (rank 0): the resolved config, the model,
the mesh, the batch and the data at the start; what was done and where the results are at the end.
A user reading only these lines knows what ran and where to look next."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from parallelisms.moe_split import PARTS, SPLIT
from parallelisms.parallelize import pipeline_split
from parallelisms.torch_private import kernels
from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.location import Location, display
from trainer.config import acting, cautions, changed_settings, to_toml
from trainer.metrics.logger import MetricsLogger, format_duration
from trainer.model.llama3 import num_params, whole_model
from trainer.step.train_step import StepStats

if TYPE_CHECKING:
    from trainer.planning.job_plan import JobPlan

logger = logging.getLogger("meshtrain")


def save_config(plan: JobPlan) -> Path:
    """Write the resolved config to the dump folder and log the settings that differ from the
    code's defaults, both as the run acts on them (a setting kept in the config file for a feature
    the command line turned off is left out); return the file's path."""
    config_file = Path(plan.config.job.dump_folder) / "config.toml"
    config = acting(plan.config)
    config_file.write_text(to_toml(config))
    changed = changed_settings(config)
    summary = textwrap.fill(" ".join(changed), width=110, initial_indent="  ", subsequent_indent="  ")
    logger.info(
        "config: %d settings differ from the code's defaults (all in %s):\n%s", len(changed), config_file, summary
    )
    return config_file


def batch_line(plan: JobPlan) -> str:
    """How a rank's share of the global batch is run: accumulation micro-batches, or under PP
    the schedule's pipeline micro-batches and the stage layout (blocks per stage)."""
    training, settings = plan.config.training, plan.parallel
    if plan.dims.pp == 1:
        return f"{plan.microbatches} micro-batch(es) of {training.local_batch_size} per rank"
    split = pipeline_split(plan.dims, settings, plan.model_args.n_layers)
    stages = ", ".join(f"{len(blocks)}" for blocks in split.stage_blocks)
    return (
        f"{settings.pp_rank_batch // settings.pp_microbatch_size} pipeline micro-batches of "
        f"{settings.pp_microbatch_size} per rank ({settings.pp_schedule}); {split.num_stages} stages of "
        f"[{stages}] blocks, {split.stages_per_rank} per pp rank"
    )


def log_start(plan: JobPlan, device: torch.device, metrics: MetricsLogger, data_lines: str) -> None:
    config, dims, training = plan.config, plan.dims, plan.config.training
    logger.info(
        "%s %s: %s parameters | mesh pp=%d dp_replicate=%d dp_shard=%d cp=%d tp=%d%s on %s, %d CPU thread(s) "
        "per process | global batch %d x %d tokens = %s",
        config.model.name,
        config.model.flavor,
        f"{num_params(whole_model(plan.model_args)):,}",
        dims.pp,
        dims.dp_replicate,
        dims.dp_shard,
        dims.cp,
        dims.tp,
        f" ep={dims.ep}" if dims.ep > 1 else "",
        device.type,
        torch.get_num_threads(),
        plan.global_batch_size,
        training.seq_len,
        batch_line(plan),
    )
    logger.info(data_lines)
    logger.info("\n".join(plan.step.lines))
    for caution in cautions(config):
        logger.warning(caution)
    for sink in metrics.sinks:
        logger.info("%s: %s", sink.name, sink.where())


class MoETimeReport:
    """The start report's MoE line: the time split of the MoE layers (``parallelisms/moe_split.py``)
    measured on the run's steps 2 and 3 (the first warms up), against the step time; rank 0's
    figures, which a single-rank run's are too. Measuring synchronises the device around each
    part, so only those steps pay for it."""

    STEPS = 2

    def __init__(self, first_step: int, device: torch.device, rank: int, compiled: bool = False):
        self.first, self.device, self.rank, self.compiled = first_step + 1, device, rank, compiled
        self.step_seconds = 0.0

    def before_step(self, step: int) -> None:
        if step == self.first:
            SPLIT.start(self.device)

    def after_step(self, step: int, stats: StepStats) -> None:
        if not SPLIT.measuring:
            return
        self.step_seconds += stats.step_time_s
        if step == self.first + self.STEPS - 1:
            line = moe_split_line(SPLIT.stop(), self.step_seconds, self.first, step, self.compiled)
            if self.rank == 0:
                logger.info(line)

    def close(self) -> None:
        """A run that stopped while measuring leaves the layers untimed."""
        SPLIT.stop()


def log_compiled(rank: int) -> None:
    """After the first step of a compiled job, on rank 0: :func:`compile_line`."""
    if rank == 0:
        logger.info(compile_line(*kernels.compiled_graphs()))


def compile_line(graphs: int, breaks: dict[str, int]) -> str:
    """What compile made of the first step: compile fuses only inside a graph, so a graph break
    where none is expected is speed lost."""
    total = sum(breaks.values())
    line = f"compile: {graphs} graph(s) traced in the first step, {total} graph break(s)"
    if not total:
        return line
    reasons = "; ".join(f"{count} x {reason[:100]}" for reason, count in sorted(breaks.items(), key=lambda r: -r[1]))
    return f"{line}: {reasons} (`TORCH_LOGS=graph_breaks` shows where)"


def moe_split_line(
    seconds: dict[str, float], step_seconds: float, first: int, last: int, compiled: bool = False
) -> str:
    steps = last - first + 1
    if compiled:
        return (
            f"MoE time split, steps {first}-{last}: none; the MoE layers are compiled, and compile fuses across "
            "the router, dispatch, experts and combine, so they have no time of their own (run eager to split them)"
        )
    if not any(seconds.values()):
        return f"MoE time split, steps {first}-{last}: none; this rank holds no MoE layer"
    parts = ", ".join(
        f"{name} {1e3 * seconds[name] / steps:.1f} ms ({100 * seconds[name] / step_seconds:.0f}%)" for name in PARTS
    )
    moe = sum(seconds.values())
    return (
        f"MoE time split, steps {first}-{last} (per step, wall clock, every layer's forwards and recomputations): "
        f"{parts}; {1e3 * moe / steps:.1f} ms of the {1e3 * step_seconds / steps:.1f} ms step "
        f"({100 * moe / step_seconds:.0f}%); the trace's moe/* ranges show them per layer"
    )


def log_end(
    plan: JobPlan,
    last_step: int,
    n_skipped_steps: int,
    last: StepStats,
    steps: int,
    seconds: float,
    checkpoint_folder: Location,
    metrics: MetricsLogger,
    trained: int | None = None,
) -> None:
    """What the run did and where its results are, in a few lines. ``trained``: of the ``steps``
    this run went through, those its processes trained (a replica group that healed took the
    others over from a live group); None: all of them."""
    trained = steps if trained is None else trained
    tokens = trained * plan.global_batch_size * plan.config.training.seq_len
    saved = step_folders(checkpoint_folder) if plan.config.checkpoint.enable else []
    healed = f", {steps - trained} taken over from a live group by healing" if trained != steps else ""
    logger.info(
        "done: steps %d-%d of %d (%d skipped in all%s) in %s, %s tokens (%s tokens/s, whole job); final loss %.4f\n"
        "  checkpoint: %s\n  metrics: %s",
        last_step - steps + 1,
        last_step,
        plan.config.training.steps,
        n_skipped_steps,
        healed,
        format_duration(seconds),
        f"{tokens:,}",
        f"{tokens / max(seconds, 1e-9):,.0f}",
        last.result.loss_avg,
        display(saved[-1][1]) if saved else "none (`--checkpoint.enable` saves them)",
        "; ".join(f"{sink.name}: {sink.where()}" for sink in metrics.sinks) or "console only",
    )
