"""The replica groups' say in a step: it moves the weights only if every collective of it reached
the same quorum (``trainer/replica_groups.py``); who took part is logged at every step."""

from __future__ import annotations

from typing import Protocol

from trainer.step.part import StepPart, StepResult
from trainer.step.sums import Logged


class Committing(Protocol):
    def commit(self) -> bool: ...

    def reported(self) -> tuple[int, int, int]: ...


class GroupCommit(StepPart):
    """After the step's sums and before the optimizer step: whether the step commits, and which
    groups trained it with how many tokens."""

    def __init__(self, groups: Committing):
        self.groups = groups

    def finish(self, result: StepResult) -> None:
        result.committed = self.groups.commit()
        result.values.update(zip((logged.tag for logged in LOGGED), self.groups.reported()))

    def logged(self) -> tuple[Logged, ...]:
        return LOGGED


LOGGED = (
    Logged("fault_tolerance/groups", chart="fault tolerance/replica groups per step", every_step=True),
    Logged("fault_tolerance/tokens", chart="fault tolerance/tokens per step", every_step=True),
    Logged("fault_tolerance/uncommitted_steps", chart="fault tolerance/uncommitted attempts", every_step=True),
)
"""Every step, not only log steps: a group's absence may last one step."""
