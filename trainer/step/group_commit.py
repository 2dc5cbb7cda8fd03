"""The replica groups' say in a step: it moves the weights only if every collective of it reached
the same quorum (``trainer/replica_groups.py``); who took part is logged at every step."""

from __future__ import annotations

from typing import Protocol

from trainer.step.part import StepPart, StepResult


class Committing(Protocol):
    group_count: int

    def commit(self) -> bool: ...

    def logged(self) -> dict[str, float]: ...


class GroupCommit(StepPart):
    """After the step's sums and before the optimizer step: whether the step commits, and which
    groups trained it with how many tokens."""

    def __init__(self, groups: Committing):
        self.groups = groups

    def finish(self, result: StepResult) -> None:
        result.committed = self.groups.commit()
        result.values.update(self.groups.logged())

    def describe(self) -> str:
        return f"the replica groups' commit ({self.groups.group_count} groups; a broken quorum runs the step again)"
