"""The step's plan: the schedule and the parts ``--dry-run`` says are those the build makes, in order."""

from __future__ import annotations

import pytest
from harness import run_cases, trainer_for

from trainer.config import load_config
from trainer.planning.job_plan import describe, resolve_job
from trainer.step.expert_balance import ExpertBalance
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.grad_sync import GradSync
from trainer.step.layout_invariant import LayoutInvariantReduction
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.schedules import HeldForwards, Interleaved

SMALL = ["--training.steps", "1", "--validation.enable=false", "--metrics.enable_tensorboard=false"]
MOE = ["--config", "debug_moe.toml", *SMALL]
FULL_AC = ["--activation_checkpoint.mode", "full", "--moe.held_forwards", "device"]
CASES = {
    "dense": (SMALL, "interleaved", False, ("accumulator", "reduction", "optimizer step")),
    "layout-invariant": (
        [*SMALL, "--debug.layout_invariant"],
        "interleaved",
        False,
        ("accumulator", "reduction", "optimizer step"),
    ),
    "moe, pre-pass": (MOE, "interleaved", True, ("accumulator", "reduction", "balance", "optimizer step")),
    "moe, held forwards": (
        [*MOE, *FULL_AC],
        "held forwards",
        False,
        ("accumulator", "reduction", "balance", "optimizer step"),
    ),
}
KINDS = {
    GradAccumulator: "accumulator",
    GradSync: "reduction",
    LayoutInvariantReduction: "reduction",
    ExpertBalance: "balance",
    OptimizerStep: "optimizer step",
}
SCHEDULES = {Interleaved: "interleaved", HeldForwards: "held forwards"}


def built(argv: list[str]) -> tuple[str, bool, tuple[str, ...]]:
    _, training = trainer_for(argv)
    schedule = training.step.schedule
    prepass = bool(getattr(schedule, "prepass", False))
    return SCHEDULES[type(schedule)], prepass, tuple(KINDS[type(part)] for part in training.step.parts.parts)


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_says_the_schedule_and_parts_in_order(case):
    argv, schedule, prepass, kinds = CASES[case]
    plan = resolve_job(load_config(argv), world_size=1)
    assert (plan.step.schedule, plan.step.prepass, plan.step.parts) == (schedule, prepass, kinds)
    said = describe(plan, None, "")
    assert said.count("\n  ") >= len(kinds) and "step: " in said
    assert [line.split(". ", 1)[0].strip() for line in plan.step.lines[1:]] == [
        str(i) for i in range(1, len(kinds) + 1)
    ]


@pytest.mark.slow
def test_the_build_makes_the_planned_step():
    made = run_cases(1, {case: (built, argv) for case, (argv, *_) in CASES.items()})
    for case, (_, schedule, prepass, kinds) in CASES.items():
        assert made[case][0] == (schedule, prepass, kinds), case
