"""One training step, whole: fetch the micro-batches, run the schedule's forwards and backwards,
let the parts finish (normalise and clip, balance, commit, step the optimizer), report.

What a step is made of is built once in ``trainer/build.py``: a :class:`Step` holds the
micro-batches' source, the schedule (``schedules.py``) and the parts in their order
(``part.py``); ``--dry-run`` lists them. The loop around the steps is ``trainer/train.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer.step.batches import MicroBatch, StepBatches
from trainer.step.part import Parts, StepResult
from trainer.step.schedules import StepSchedule
from trainer.step.sums import Logged, StepSums
from trainer.train_state import TrainState


@dataclass(frozen=True)
class Step:
    """Everything one training step runs: where its micro-batches come from, how its forwards and
    backwards run, and the parts that take part in it, in the order they do."""

    batches: StepBatches
    schedule: StepSchedule
    parts: Parts
    sums: StepSums
    """The one owner of the step's sums over ranks, which the parts share."""
    tokens: int
    """Input tokens of this rank's data-parallel replica per step (before CP shards them)."""

    def logged(self) -> tuple[Logged, ...]:
        """Every value the step reports besides its loss, norm and tokens, as it is declared."""
        return tuple(t.logged for t in self.sums.totals if t.logged is not None) + self.parts.logged()


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step measured: the parts' result (reduced across ranks, the same on every rank)
    and what only the loop knows; ``local_tokens`` stays per process, because throughput is
    reported per device."""

    step: int
    result: StepResult
    local_tokens: int
    n_skipped_steps: int
    """Steps skipped so far in the run (counted by the train state, restored on resume)."""
    data_time_s: float
    step_time_s: float


def train_step(step: Step, state: TrainState, stop_requested: Callable[[], bool] = lambda: False) -> StepStats:
    """Fetch the step's micro-batches and run it (:func:`run_step`); count it when it commits.
    ``stop_requested`` is asked while the data is late."""
    start = time.perf_counter()
    batch = step.batches.fetch(stop_requested)
    data_time = time.perf_counter() - start
    result = run_step(step, batch)
    if result.committed:
        state.record_step(result.skipped)
    return StepStats(
        step=state.step,
        result=result,
        local_tokens=step.tokens,
        n_skipped_steps=state.n_skipped_steps,
        data_time_s=data_time,
        step_time_s=time.perf_counter() - start,
    )


def run_step(step: Step, batch: list[MicroBatch]) -> StepResult:
    """The parts begin, the schedule runs the forwards and backwards, the parts finish (normalise
    and clip, balance, commit, step the optimizer); a step that did not commit is undone, to be
    fetched and run again."""
    step.parts.begin(batch)
    step.schedule.run(step.parts, batch)
    result = step.parts.finish()
    if not result.committed:
        step.batches.rewind()
        step.parts.undo()
    return result
