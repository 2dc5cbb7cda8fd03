"""One training step: what it is made of and what it does.

A step fetches this rank's micro-batches (:meth:`StepParts.place` puts each on the device, its
sequence shard under context parallelism), runs forward and backward on each, lets the gradient
accumulator normalise and clip, and steps the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from parallelisms.context_parallel import ContextParallel
from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline_parallel import Pipeline
from trainer.data.documents import split_documents
from trainer.data.loader import MicroBatchLoader
from trainer.grad_accumulator import GradAccumulator
from trainer.loss import ModelLoss
from trainer.model.llama3 import Transformer


class MicroBatch(NamedTuple):
    """What one forward takes: this rank's tokens, labels and their RoPE positions (None:
    ``0..seq-1``), and the tokens' document ids under document masking (else None)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None
    document_ids: torch.Tensor | None


@dataclass
class StepParts:
    """What a training step uses, built once with every parallelism already applied."""

    device: torch.device
    meshes: Meshes
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: MicroBatchLoader
    accumulator: GradAccumulator
    loss_parallel: bool
    model_loss: ModelLoss
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
        cp = self.context_parallel
        if self.document_bos_id is not None:
            labels, positions, document_ids = split_documents(inputs, labels, self.document_bos_id)
            if cp:
                positions, document_ids = cp.shard(positions), cp.shard(document_ids)
        if cp:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
        device = self.device
        return MicroBatch(
            inputs.to(device, non_blocking=True),
            labels.to(device, non_blocking=True),
            None if positions is None else positions.to(device, non_blocking=True),
            None if document_ids is None else document_ids.to(device, non_blocking=True),
        )

    pipeline: Pipeline | None = None
    """This rank's pipeline stages and their schedule (None without pipeline parallelism);
    ``model`` then holds only these stages' modules."""
