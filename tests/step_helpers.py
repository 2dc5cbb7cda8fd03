"""The trainer's step as the tests drive it: built as training builds it, up to its optimizer
step (so that the normalised, clipped gradients can be compared), and its parts to reach into."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

from trainer.build import build_training
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.planning.job_plan import resolve_job
from trainer.step.batches import MicroBatch
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.optimizer_step import AfterOptimizerStep, OptimizerStep
from trainer.step.part import Parts, StepPart, StepResult
from trainer.step.sums import StepSums
from trainer.step.train_step import run_step
from trainer.training import Training


def trainer_for(argv: list[str]) -> tuple[Any, Training]:
    """``(plan, training)`` for ``argv`` on this process's world size, built as training builds it."""
    job_plan = resolve_job(load_config(argv), int(os.environ.get("WORLD_SIZE", 1)))
    return job_plan, build_training(
        job_plan, load_dataset(job_plan.config, job_plan.tokenizer, job_plan.global_batch_size)
    )


PartT = TypeVar("PartT", bound=StepPart)


def part_of(training: Training, kind: type[PartT]) -> PartT:
    """The step's part of ``kind`` (the tests reach into one to count or break it)."""
    (found,) = [p for p in training.step.parts.parts if isinstance(p, kind)]
    return found


def sums_of(training: Training) -> StepSums:
    """The step's one owner of its sums over ranks."""
    return part_of(training, GradAccumulator).sums


def fetch_step(training: Training) -> list[MicroBatch]:
    return training.step.batches.fetch()


def forward_backward(training: Training, microbatches: list[MicroBatch]) -> StepResult:
    """The trainer's step on ``microbatches`` up to its optimizer step: it leaves the normalised,
    clipped gradients for the tests to compare (:func:`optimizer_step` steps on them)."""
    parts = [p for p in training.step.parts.parts if not isinstance(p, (OptimizerStep, AfterOptimizerStep))]
    return run_step(dataclasses.replace(training.step, parts=Parts(parts)), microbatches)


def optimizer_step(training: Training, result: StepResult) -> None:
    """The step's optimizer step and what follows it, after :func:`forward_backward`."""
    for part in training.step.parts.parts:
        if isinstance(part, (OptimizerStep, AfterOptimizerStep)):
            part.finish(result)
