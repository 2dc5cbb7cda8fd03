"""The validation loss: the same number on every mesh, and invisible to training.

``validation/loss`` is the sum of the per-token losses over every valid label of the validation
batches divided by their count, both summed over the data-parallel ranks and context-parallel
shards (the loss mesh, as for training), so it is the token-weighted mean a single process would
compute with ``no_grad`` on the same weights, whatever the mesh. Perplexity is its exponential.

It runs in the training layout (FSDP shards, TP, CP, pipeline stages as they are; nothing is
re-sharded; under PP the schedule's forward-only ``eval``) under
``torch.no_grad()``, from its own fixed list of samples: the training loader, its position and
every RNG are untouched, so a run with validation logs the same training losses as one without.

The samples of a pass: the first ``validation.steps x validation.local_batch_size`` of the
validation set in a fixed shuffled order (seeded by ``debug.seed``), or (-1) all of them; the
same samples on every mesh, shared among the data-parallel ranks in batches of
``validation.local_batch_size`` (with dp ranks, each runs about ``steps / dp`` batches). Every
rank runs the same number of forwards (FSDP's collectives need that): where the last batch has
no sample left for a rank, it runs a sample whose labels are all ignored, which adds nothing to
the sum or the count.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.data.loader import GlobalOrder
from trainer.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from trainer.data.datasets import TokenDataset
    from trainer.training import Training


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    n_valid_tokens: int
    batches: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


class Validator:
    """One rank's share of the validation set, and the pass that evaluates it."""

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        steps: int,
        freq: int,
        seed: int,
    ) -> None:
        self.dataset = dataset
        self.freq = freq
        # The evaluated samples depend on the settings only, never on the mesh: ``steps`` batches
        # of ``local_batch_size`` in all, shared among the data-parallel ranks.
        count = len(dataset) if steps == -1 else min(len(dataset), steps * local_batch_size)
        chosen = GlobalOrder(len(dataset), local_batch_size, seed).stream(0, count)
        global_batch = local_batch_size * dp_degree
        self.batches = math.ceil(count / global_batch)
        mine = []
        for batch in range(self.batches):
            share = chosen[batch * global_batch + dp_rank * local_batch_size :][:local_batch_size]
            # -1: a filler sample, so this rank runs as many forwards as the others.
            mine.append(share + [-1] * (local_batch_size - len(share)))
        self._indices = mine

    def due(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index >= 0:
            return self.dataset[index]
        inputs, labels = self.dataset[0]
        return inputs, torch.full_like(labels, IGNORE_INDEX)

    @torch.no_grad()
    def run(self, training: Training) -> ValidationResult:
        """Evaluate every batch of this rank's share; all-reduce the sum and the count."""
        start = time.perf_counter()
        forward, place, pipeline = training.forward, training.step.batches.place, training.pipeline
        totals = torch.zeros(2, dtype=torch.float64, device=training.device)
        with forward.context():
            for indices in self._indices:
                samples = [self._sample(i) for i in indices]
                batch = place(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))
                if pipeline is not None:  # the summed loss, known on every pipeline rank
                    loss = pipeline.evaluate(batch.inputs, batch.labels, batch.positions, batch.document_ids)
                else:
                    loss = forward(batch)
                if isinstance(loss, DTensor):  # loss parallel: replicated over TP, counted once
                    loss = loss.to_local()
                totals[0] += loss.double()
                totals[1] += (batch.labels != IGNORE_INDEX).sum()
        dist.all_reduce(totals, group=training.meshes.loss.get_group())
        loss_sum, count = totals.tolist()
        return ValidationResult(
            loss=loss_sum / count if count else math.nan,
            n_valid_tokens=int(count),
            batches=self.batches,
            seconds=time.perf_counter() - start,
        )
