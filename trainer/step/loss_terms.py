"""Terms added to the summed cross-entropy, each declared once with how it is reported.

A term is a sum over the micro-batch's valid tokens, as the cross-entropy is, so the step's one
``1 / N`` (``grad_accumulator.py``) normalises it exactly on every mesh: its value and gradient
are those of ``weight x sum over the global batch / N``. The loss function's backward takes each
weighted term's gradient while its value stays the cross-entropy (the logged loss); each term's
own value is recorded once per training forward (not in a recomputation, nor in a forward without
gradients: a pre-pass, validation); the
:class:`LossTerms` part hands each micro-batch's values to the step's sums, which report them as
their :class:`~trainer.step.sums.Total` declares. docs/architecture.md ("Adding a term to the
loss") says how to add one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from parallelisms.torch_private import kernels
from trainer.config import JobConfig
from trainer.loss import CrossEntropy
from trainer.step.part import StepPart
from trainer.step.sums import StepSums, Total


@dataclass(frozen=True)
class LossTerm:
    """``weight x of(logits, labels)`` added to the loss; ``of`` sums over the valid tokens."""

    total: Total
    """Its name, and how its value (per valid token) is reported."""
    weight: float
    of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_terms(config: JobConfig) -> tuple[LossTerm, ...]:
    """The terms ``config`` turns on (none yet: each new term is one entry here)."""
    return ()


def with_terms(cross_entropy: CrossEntropy, terms: Sequence[LossTerm], values: torch.Tensor) -> CrossEntropy:
    """The summed cross-entropy whose backward also takes every weighted term's gradient; its
    value stays the cross-entropy's (the logged loss), each term's unweighted value is added to
    ``values`` (``(len(terms),)``) in a training forward."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = cross_entropy(logits, labels)
        parts = [term.of(logits, labels) for term in terms]
        if torch.is_grad_enabled():
            kernels.add_unless_in_backward([values], [torch.stack([p.detach().float() for p in parts])])
        weighted = sum((term.weight * part for term, part in zip(terms, parts)), torch.zeros_like(summed))
        return _WithTerms.apply(summed, weighted)

    return loss


class _WithTerms(torch.autograd.Function):
    """``summed``, whose backward gives ``terms`` the same gradient."""

    @staticmethod
    def forward(ctx, summed: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
        return summed.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


class LossTerms(StepPart):
    """After each micro-batch's backward, its terms' values to the step's sums."""

    def __init__(self, terms: Sequence[LossTerm], sums: StepSums, values: torch.Tensor):
        self.terms, self.sums, self.values = tuple(terms), sums, values

    def begin(self, batch: list) -> None:
        self.values.zero_()

    def after_backward(self, microbatch: int, loss: torch.Tensor) -> None:
        for term, value in zip(self.terms, self.values):
            self.sums.add(term.total, value)
        self.values.zero_()
