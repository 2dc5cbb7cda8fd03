"""The model of a job: built on the meta device, parallelised, then materialised and initialised
shard by shard; rank 0 says which phase it is in and how far the initialisation has got, since a
silent minute looks like a hang."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from parallelisms.parallel_dims import Meshes
from parallelisms.parallelize import Parallelized, parallelize
from trainer.loss import CrossEntropy, cross_entropy_sum
from trainer.model.llama3 import Transformer, num_params
from trainer.planning.job_plan import JobPlan

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
        model.output.gradients_in_forward = plan.step.loss_gradients_in_forward
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
