"""The step's last parts: the optimizer's step, and what must follow a step that moved the weights."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.optimizer import LRSchedule
from trainer.runtime.weights_fence import WeightsFence
from trainer.step.part import StepPart, StepResult


class OptimizerStep(StepPart):
    """Steps the optimizer unless the step was skipped, clears the gradients and advances the
    schedule; a step that did not commit does neither (it is run again). Its ``fence`` holds it
    while a checkpoint still copies the state the step would change."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: LRSchedule):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.fence = WeightsFence()

    def finish(self, result: StepResult) -> None:
        result.lr = float(self.scheduler.get_last_lr()[0])
        if result.committed and not result.skipped:
            self.fence.wait()
            self.optimizer.step()
            result.stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        if result.committed:
            self.scheduler.step()


class AfterOptimizerStep(StepPart):
    """What a step that moved the weights needs next (float8's scales of the gathered weights)."""

    def __init__(self, action: Callable[[], None]):
        self.action = action

    def finish(self, result: StepResult) -> None:
        if result.stepped:
            self.action()
