"""A step's micro-batches: this rank's samples from the loader, on the device as the model takes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from parallelisms.context_parallel import ContextParallel
from trainer.data.documents import split_documents
from trainer.data.loader import MicroBatchLoader


class MicroBatch(NamedTuple):
    """What one forward takes: this rank's tokens, labels and their RoPE positions (None:
    ``0..seq-1``), and the tokens' document ids under document masking (else None)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None
    document_ids: torch.Tensor | None


class StepBatches:
    """Fetches each step's micro-batches and places them: the sequence shard of context
    parallelism, each packed document's positions under document masking, the device. A step
    that did not commit is fetched again (:meth:`rewind`)."""

    def __init__(
        self,
        loader: MicroBatchLoader,
        device: torch.device,
        context_parallel: ContextParallel | None = None,
        positions: torch.Tensor | None = None,
        document_bos_id: int | None = None,
    ):
        """``positions``: of this rank's tokens under context parallelism (else None: 0..seq-1);
        ``document_bos_id``: with ``training.document_mask``, the BOS that opens each document."""
        self.loader = loader
        self.device = device
        self.context_parallel = context_parallel
        self.positions = positions
        self.document_bos_id = document_bos_id
        self._position: dict[str, Any] | None = None

    def fetch(self, stop_requested: Callable[[], bool] = lambda: False) -> list[MicroBatch]:
        """The next step's micro-batches of this rank (``stop_requested`` is asked while the data
        is late: :meth:`MicroBatchLoader.next_step`)."""
        self._position = self.loader.state_dict()
        return [self.place(inputs, labels) for inputs, labels in self.loader.next_step(stop_requested)]

    def rewind(self) -> None:
        """Back to before the last fetch: the step is run again on the same samples."""
        if self._position is not None:
            self.loader.load_state_dict(self._position)

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
