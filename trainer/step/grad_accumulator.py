"""Exact loss normalisation over micro-batches, data-parallel ranks and context-parallel shards.

The loss of a step is the mean over every valid label token of the global batch::

    loss = sum of per-token cross-entropies / N,    N = valid labels (!= -100) over all
                                                        micro-batches, DP ranks and CP shards

Averaging per-micro-batch means (the Hugging Face accumulation bug), or letting FSDP average
per-rank means, weighs a token by how few valid tokens share its micro-batch or rank; both are
wrong whenever valid-token counts differ, which is always the case with padding or prompt
masking. So backward runs on *sums*, FSDP reduces by *sum*, N is counted once per step with one
all-reduce launched before the first forward, and after the last backward the gradients are
scaled exactly once by ``clip_coef / N``: the clip coefficient is computed from the true norm
``||sum of grads|| / N``, so normalisation and clipping are one in-place multiply, not two
passes over every gradient.

Tensor-parallel ranks hold the same tokens, so the count runs over the *loss* mesh
(``dp_replicate x dp_shard x cp``), never over TP.

Under pipeline parallelism every stage counts N over its own loss mesh (every stage reads the
same labels); only the last stage holds losses, so the logged loss is summed over the stages
too. Who sums what over which ranks, and over fault-tolerant replica groups, is ``sums.py``'s;
how the gradients are summed is FSDP's (``grad_sync.py``) or, with ``debug.layout_invariant``,
the fixed order of ``layout_invariant.py``; N, the clip coefficient and the one scale are here.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import kernels
from trainer.loss import IGNORE_INDEX
from trainer.step.part import StepPart, StepResult
from trainer.step.sums import LOSS, WORST, StepSums

logger = logging.getLogger("meshtrain")


class GradientReduction(Protocol):
    """How a step's gradients are summed over ranks: FSDP's (``grad_sync.py``) or in a fixed
    order (``layout_invariant.py``)."""

    def reduced(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """After the step's last backward: the summed gradients and their norm, ``(1,)``."""
        ...


class GradAccumulator(StepPart):
    """Counts the step's valid labels as it begins, adds each micro-batch's summed loss after its
    backward, and after the last one normalises and clips the summed gradients in one pass."""

    def __init__(
        self,
        sums: StepSums,
        reduction: GradientReduction,
        *,
        microbatches: int | None,
        max_norm: float,
        holds_loss: bool = True,
    ):
        """``microbatches``: the backwards a step records, or None under PP, whose schedule runs
        as many as it is set to (``--simulate`` shortens it); ``holds_loss``: False on a pipeline
        stage without the loss, which records none."""
        self.sums = sums
        self.reduction = reduction
        self.microbatches = microbatches if holds_loss else 0
        self.max_norm = max_norm
        self.holds_loss = holds_loss
        self._local_count = torch.zeros(1, dtype=torch.int64)
        self._local_loss = torch.zeros(())
        self._recorded = 0

    def begin(self, batch: list) -> None:
        """Count the step's valid labels and start summing the count over ranks: N is needed
        only when the step finishes (or by the MoE balancing before its first backward), so the
        collective overlaps every forward and backward."""
        labels = [mb.labels for mb in batch]
        self._local_count = torch.stack([(lab != IGNORE_INDEX).sum() for lab in labels]).sum().to(torch.int64)
        self._local_count = self._local_count.reshape(1)
        self._local_loss = torch.zeros((), dtype=torch.float32, device=self._local_count.device)
        self._recorded = 0
        self.sums.begin(self._local_count)

    def after_backward(self, microbatch: int, loss: torch.Tensor) -> None:
        """Add a micro-batch's summed loss (a replicated DTensor under loss parallel: every TP
        rank holds the same value) to the step's."""
        if microbatch != self._recorded:
            raise ValueError(f"micro-batch {microbatch} out of order; expected {self._recorded}")
        local = (loss.to_local() if isinstance(loss, DTensor) else loss).detach().float()
        self._local_loss += local
        self.sums.add(LOSS, local)
        self._recorded += 1

    def finish(self, result: StepResult) -> None:
        """Normalise and clip the summed gradients in one pass; decide whether to step.

        A step with no valid token, or with a non-finite gradient norm, must not move the
        weights: it is skipped (the loop counts skips) and its gradients are left for the
        optimizer step to zero.
        """
        if self.microbatches is not None and self._recorded != self.microbatches:
            raise RuntimeError(f"the step finished after {self._recorded} of {self.microbatches} backwards")
        local_count = self._local_count.float()
        rank_mean = torch.where(local_count > 0, self._local_loss / local_count.clamp(min=1), -math.inf)
        if self.holds_loss:
            self.sums.add(WORST, rank_mean)
        grads, raw_norm = self.reduction.reduced()
        totals = self.sums.reduce(also={"raw_norm": raw_norm})
        n = totals.n
        result.n_valid_tokens = n
        result.grad_norm = totals.raw["raw_norm"] / max(n, 1)
        result.loss_avg = totals[LOSS.name]
        result.loss_max = totals[WORST.name] if n else math.nan
        result.values.update(totals.logged())
        if n == 0 or not math.isfinite(result.grad_norm):
            reason = "no valid label token in the global batch" if n == 0 else "non-finite gradient norm"
            logger.warning("skipping the optimizer step: %s", reason)
            result.skip(reason)
            return
        true_norm = result.grad_norm
        clip_coef = min(1.0, self.max_norm / (true_norm + 1e-6)) if self.max_norm > 0 else 1.0
        _foreach_scale_([g.to_local() if isinstance(g, DTensor) else g for g in grads], clip_coef / n)


def _foreach_scale_(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply every tensor in place by one scalar: a single pass over the gradients."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_device_dtype.setdefault((t.device, t.dtype), []).append(t)
    for group in by_device_dtype.values():
        kernels.foreach_mul_(group, scale)
