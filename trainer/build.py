"""Build everything the training loop uses, once, with every parallelism already applied.

The dataset is read and tokenized before any process group exists (a bad file fails in seconds);
then the process group, the mesh, the sharded model, the optimizer, the loader and the gradient
accumulator are built. Building a large model takes a while, so rank 0 says which phase it is in
and how far the initialisation has got: a silent minute looks like a hang.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from parallelisms.context_parallel import ContextParallel
from parallelisms.parallel_dims import Meshes, device_type
from parallelisms.parallelize import Parallelized, parallelize
from parallelisms.pipeline_parallel import Pipeline
from trainer.config import resolve_path
from trainer.data.documents import split_documents
from trainer.data.loader import MicroBatchLoader, build_dataloader
from trainer.data.mixture import MixtureDataset
from trainer.data.samples import open_dataset
from trainer.grad_accumulator import GradAccumulator
from trainer.loss import cross_entropy_sum
from trainer.model.llama3 import Transformer, num_params
from trainer.optimizer import build_lr_scheduler, build_optimizer
from trainer.plan import Plan
from trainer.runtime.distributed import init_distributed

logger = logging.getLogger("meshtrain")

PROGRESS_MIN_PARAMS = 100_000_000
"""Models at least this big report how far their initialisation has got; smaller ones (the
debug model) initialise in about a second and only log the phases."""
PROGRESS_EVERY_PERCENT = 10
PROGRESS_EVERY_S = 10.0


class MicroBatch(NamedTuple):
    """What one forward takes: this rank's tokens, labels and their RoPE positions (None:
    ``0..seq-1``), and the tokens' document ids under document masking (else None)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None
    document_ids: torch.Tensor | None


@dataclass
class Trainer:
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
    document_bos_id: int | None = None
    """With ``training.document_mask``: the BOS that opens each packed document (else None)."""

    def place(self, inputs: torch.Tensor, labels: torch.Tensor) -> MicroBatch:
        """Whole samples -> this rank's micro-batch (its sequence shard under CP), on the device.

        Documents are split on the whole sequences, before CP takes its shard: a shard alone
        cannot tell where the document of its first token began.
        """
        positions, document_ids = self.positions, None
        if self.document_bos_id is not None:
            labels, positions, document_ids = split_documents(inputs, labels, self.document_bos_id)
        cp = self.context_parallel
        if cp:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
            if document_ids is not None:
                positions, document_ids = cp.shard(positions), cp.shard(document_ids)
        tensors = (inputs, labels, positions, document_ids)
        return MicroBatch(*(t if t is None else t.to(self.device, non_blocking=True) for t in tensors))

    pipeline: Pipeline | None = None
    """This rank's pipeline stages and their schedule (None without pipeline parallelism);
    ``model`` then holds only these stages' modules."""


def load_dataset(plan: Plan) -> Dataset:
    """The samples of ``training.dataset``: from the bundled plays, one path, or the mixture of
    several (``training.dataset_path``, ``training.dataset_weights``)."""
    training = plan.config.training
    paths = [resolve_path(path) for path in training.dataset_path]
    if len(paths) <= 1:
        return open_dataset(training.dataset, paths[0] if paths else None, plan.tokenizer, training.seq_len)
    members = [open_dataset(training.dataset, path, plan.tokenizer, training.seq_len) for path in paths]
    names = [Path(path).name for path in paths]
    if len(set(names)) < len(names):
        names = list(training.dataset_path)
    return MixtureDataset(members, names, training.dataset_weights or [1.0] * len(paths))


def load_validation_dataset(plan: Plan) -> Dataset | None:
    """The validation samples (``[validation]``), or None when the run does not validate."""
    validation, training = plan.config.validation, plan.config.training
    if not plan.validates:
        return None
    return open_dataset(
        validation.dataset or training.dataset,
        resolve_path(validation.dataset_path) if validation.dataset_path else None,
        plan.tokenizer,
        plan.validation_seq_len,
        split="validation",
    )


def describe_data(plan: Plan, dataset: Dataset, validation: bool = False) -> str:
    """What the run trains (or validates) on, in a line or two (logged at start, printed by
    ``--dry-run``)."""
    training = plan.config.training
    kind = (plan.config.validation.dataset or training.dataset) if validation else training.dataset
    seq_len = plan.validation_seq_len if validation else training.seq_len
    text = f"{len(dataset):,} samples of {seq_len} tokens ({kind})"
    if isinstance(dataset, MixtureDataset):
        text += "; mixture over the run: " + dataset.describe_shares(
            training.steps, plan.global_batch_size, plan.config.debug.seed
        )
        stats = [m.chat_stats for m in dataset.members if getattr(m, "chat_stats", None)]
    else:
        stats = [dataset.chat_stats] if getattr(dataset, "chat_stats", None) else []
    return "; ".join([text] + [s.describe(seq_len) for s in stats])


def data_lines(plan: Plan, dataset: Dataset, validation_dataset: Dataset | None) -> str:
    """What the run trains and validates on (logged at start, printed by ``--dry-run``)."""
    lines = [f"data: {describe_data(plan, dataset)}"]
    if validation_dataset is not None:
        lines.append(
            f"validation every {plan.config.validation.freq} steps and at the end: "
            f"{describe_data(plan, validation_dataset, validation=True)}"
        )
    elif plan.config.validation.enable:
        lines.append(
            "no validation: `validation.enable` is set but `validation.dataset_path` is empty, and the "
            "bundled held-out plays are no validation set for `training.dataset_path`; point "
            "`validation.dataset_path` at held-out data of yours to validate."
        )
    return "\n".join(lines)


def build_model(plan: Plan, meshes: Meshes, device: torch.device) -> tuple[Transformer, Parallelized]:
    """Build on the meta device, parallelise, then materialise and initialise only the local shards
    (under pipeline parallelism: of this rank's stages)."""
    start = time.monotonic()
    rank0 = dist.get_rank() == 0
    with torch.device("meta"):
        model = Transformer(plan.model_args)
    total = num_params(model)
    if rank0:
        logger.info("parallelising the model (%s parameters) on the meta device", f"{total:,}")
    parallelized = parallelize(model, meshes, plan.dims, plan.parallel, device.type)
    parts = parallelized.stage_modules or [model]
    local = num_params(model)
    if rank0:
        logger.info("allocating this rank's shards on %s", device.type)
    for part in parts:
        part.to_empty(device=device)
    seed = plan.config.debug.seed
    if rank0:
        logger.info("initialising the weights (seed %d)", seed)
    progress = InitProgress(local) if rank0 and local >= PROGRESS_MIN_PARAMS else None
    for part in parts:
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


def build_trainer(plan: Plan, dataset: Dataset) -> Trainer:
    """Join the process group and build the sharded model, optimizer, data and accumulator."""
    config, training = plan.config, plan.config.training
    dev_type = device_type()
    device = init_distributed(dev_type, config.comm.init_timeout_seconds)
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(config.debug.seed)
    meshes = plan.dims.build_mesh(dev_type)
    model, parallelized = build_model(plan, meshes, device)
    context_parallel = parallelized.context_parallel
    loss_fn = torch.compile(cross_entropy_sum) if plan.parallel.compile_loss else cross_entropy_sum
    positions = context_parallel.positions.to(device) if context_parallel else None
    optimizer = build_optimizer(model, config.optimizer, dev_type)
    loader = build_dataloader(
        dataset,
        microbatches=plan.microbatches,
        local_batch_size=training.local_batch_size,
        dp_rank=meshes.batch.get_local_rank(),
        dp_degree=plan.dims.dp,
        seed=config.debug.seed,
        num_workers=training.num_workers,
        pin_memory=dev_type == "cuda",
        prefetch_factor=training.prefetch_factor if training.num_workers > 0 else None,
        allow_data_change=config.checkpoint.allow_data_change,
    )
    accumulator = GradAccumulator(
        model,
        loss_group=meshes.loss.get_group(),
        num_microbatches=plan.microbatches,
        max_norm=training.max_norm,
        hsdp=plan.dims.hsdp,
        defer_gradient_reduction=training.defer_gradient_reduction,
        stats_group=meshes.stats.get_group() if plan.dims.pp > 1 else None,
        pp_degree=plan.dims.pp,
    )
    pipeline = None
    if parallelized.split is not None:
        pipeline = Pipeline(
            parallelized.stage_modules,
            parallelized.split,
            meshes.pp,
            device,
            loss_fn,
            microbatches=plan.pipeline_microbatches,
            microbatch_size=plan.parallel.pp_microbatch_size,
            positions=positions if positions is not None else torch.arange(training.seq_len, device=device),
            document_mask=training.document_mask,
        )
    return Trainer(
        device=device,
        meshes=meshes,
        model=model,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, training.steps, config.lr_scheduler),
        loader=loader,
        accumulator=accumulator,
        loss_parallel=plan.parallel.loss_parallel,
        loss_fn=loss_fn,
        context_parallel=context_parallel,
        positions=positions,
        document_bos_id=plan.tokenizer.bos_id if training.document_mask else None,
        pipeline=pipeline,
    )
