"""One micro-batch's summed loss through the model, as training and validation both compute it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from parallelisms.context_parallel import ContextParallel
from parallelisms.tensor_parallel import loss_context
from trainer.loss import ModelLoss
from trainer.step.batches import MicroBatch


class Forward:
    """The model and its loss, and the context every forward and backward runs in: loss
    parallel's sharded logits and, under the ring backend of CP, PyTorch's patched attention."""

    def __init__(
        self,
        model: nn.Module,
        model_loss: ModelLoss,
        loss_parallel: bool = False,
        context_parallel: ContextParallel | None = None,
    ):
        self.model = model
        self.model_loss = model_loss
        self.loss_parallel = loss_parallel
        self.context_parallel = context_parallel

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's summed loss (a replicated DTensor under loss parallel)."""
        return self.model_loss(self.model, mb.inputs, mb.positions, mb.document_ids, mb.labels)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        cp = self.context_parallel
        with loss_context(self.loss_parallel), cp.attention_context() if cp else contextlib.nullcontext():
            yield
