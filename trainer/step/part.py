"""What takes part in a training step besides the model: one small protocol, and the outcome the
parts fill in.

A step runs its schedule's forwards and backwards (``schedules.py``); every other thing that
takes part in it (the gradient accumulator, FSDP's sync flags or the layout-invariant reduction,
MoE balancing, replica groups, the optimizer step and what follows it) is a :class:`StepPart`,
built once in ``trainer/build.py`` and called at the step's phases in the order it was built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trainer.step.sums import Logged

if TYPE_CHECKING:
    from trainer.step.batches import MicroBatch


@dataclass
class StepResult:
    """What one step measured and decided, filled in by the parts as they finish, in order."""

    loss_avg: float = math.nan
    """Token-weighted mean loss over the global batch."""
    loss_max: float = math.nan
    """Largest per-rank mean loss (a rank's own loss sum / its own valid tokens)."""
    grad_norm: float = math.nan
    """Norm of the true (normalised) gradient, before clipping."""
    n_valid_tokens: int = 0
    skipped: bool = False
    """The optimizer does not step: no valid token, a non-finite norm or routing bias."""
    skip_reason: str = ""
    committed: bool = True
    """False when the replica groups' quorum broke during the step: nothing of it is kept (the
    weights, optimizer, schedule and data position are those before it) and it is run again."""
    stepped: bool = False
    """The optimizer changed the weights."""
    lr: float = math.nan
    """The learning rate the step used."""
    values: dict[str, float] = field(default_factory=dict)
    """The step's other reported values by their TensorBoard tags (``sums.Logged``)."""

    def skip(self, reason: str) -> None:
        self.skipped, self.skip_reason = True, reason


class StepPart:
    """One participant of the step; each phase does nothing unless a part says otherwise.

    Per step, in this order: :meth:`begin` with the step's micro-batches; for each micro-batch
    :meth:`before_forward`; once, :meth:`forwards_done` (after the forwards that precede any
    backward: a counting pre-pass's or every held forward, none when forwards and backwards
    interleave); for each backward :meth:`before_backward` and :meth:`after_backward`; then
    :meth:`finish`, and :meth:`undo` when the step did not commit.
    """

    def begin(self, batch: list[MicroBatch]) -> None:
        return None

    def before_forward(self, microbatch: int) -> None:
        return None

    def forwards_done(self) -> None:
        return None

    def before_backward(self, microbatch: int) -> None:
        return None

    def after_backward(self, microbatch: int, loss: torch.Tensor) -> None:
        return None

    def finish(self, result: StepResult) -> None:
        return None

    def undo(self) -> None:
        return None

    def logged(self) -> tuple[Logged, ...]:
        """The values this part reports in :attr:`StepResult.values`, by their tags."""
        return ()


class Parts:
    """The step's parts in their order: each phase calls every part (:meth:`undo` in reverse)."""

    def __init__(self, parts: Sequence[StepPart]):
        self.parts = tuple(parts)

    def begin(self, batch: list[MicroBatch]) -> None:
        for part in self.parts:
            part.begin(batch)

    def before_forward(self, microbatch: int) -> None:
        for part in self.parts:
            part.before_forward(microbatch)

    def forwards_done(self) -> None:
        for part in self.parts:
            part.forwards_done()

    def backward(self, microbatch: int, loss: torch.Tensor) -> None:
        """Micro-batch ``microbatch``'s backward of its summed loss, between the parts' hooks."""
        for part in self.parts:
            part.before_backward(microbatch)
        loss.backward()
        self.after_backward(microbatch, loss)

    def after_backward(self, microbatch: int, loss: torch.Tensor) -> None:
        for part in self.parts:
            part.after_backward(microbatch, loss)

    def finish(self) -> StepResult:
        result = StepResult()
        for part in self.parts:
            part.finish(result)
        return result

    def undo(self) -> None:
        for part in reversed(self.parts):
            part.undo()

    def logged(self) -> tuple[Logged, ...]:
        return tuple(logged for part in self.parts for logged in part.logged())
