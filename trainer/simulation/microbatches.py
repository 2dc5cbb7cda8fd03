"""How many micro-batches ``--simulate`` traces, and how their cost extends to the job's count.

A step's micro-batches are alike: after the first few, each one repeats the same ops on tensors
of the same shapes, and the memory a rank holds no longer depends on how many more follow.
Gradient accumulation reaches its peak by its second micro-batch (the gradients exist) and its
last (the reduction): 4 are traced, the second being unlike the others (FSDP finishes the first
one's reduction in it). Under 1F1B, pipeline rank ``r`` runs ``pp - r`` forwards
before its first backward, then alternates: its peak (that many micro-batches in flight, with
the first gradients) is reached by micro-batch ``pp - r + 1``, so each rank traces that many
(at least 3) and the ranks near the end of the pipeline trace few. Torch's schedule wants as
many micro-batches as stages, which only matters when ranks exchange them; each simulated rank
runs alone (``Pipeline.shorten``). The other schedules are traced whole:
GPipe runs every forward before any backward, so its peak grows with the count, and the looped
and V-shaped ones keep more per micro-batch than the shortened trace accounts for (and 1F1B is traced
whole on a torch where the shortened trace was not checked: ``pipelining.SHORTENED_UP_TO``). So does a
step whose exact MoE balancing holds every forward on the device before the backwards
(``Workload.holds_forwards``): it too is traced whole. Held in host memory
(``Workload.offloads_forwards``), they leave the device two micro-batches' worth at most, so
the step is traced shortened; each forward then counts as its own micro-batch's cost, as the
counting pre-pass's do (``fake_job._attribute_microbatches``).

The traced micro-batches keep the job's shapes and the peak is measured on them as it is. Their
cost (FLOPs, memory traffic, collectives) is made the job's with :func:`extend`: the traced ones
in the middle (:func:`steady_microbatches`) stand, on average, for each one not traced. Under a
pipeline that is exact for the FLOPs and the pipeline's transfers and close for the rest (FSDP
gathers again in the warm-up forwards, which pair only roughly with the cool-down ones):
``tests/test_simulation_shortened.py`` checks the peaks, FLOPs and transfers against
unshortened simulations, FSDP's bytes to 5% and memory traffic and step time to 1%.
"""

from __future__ import annotations

from dataclasses import replace

from parallelisms.torch_private import pipelining
from trainer.planning.job_plan import JobPlan
from trainer.simulation.cost_model import FSDP_DIMS, Collective, MicrobatchCosts, TracedCost

ACCUMULATION_TRACED = 4
"""Gradient accumulation's first micro-batch, its second (FSDP finishes the first one's
reduction in it), a steady one and the last."""
PIPELINE_TRACED = 3
"""At least the first, a steady one and the last micro-batch of a pipeline rank."""
SHORTENED_SCHEDULES = ("1F1B",)
"""The pipeline schedules traced shortened (see the module docstring)."""


def shortened(plan: JobPlan) -> bool:
    """Whether a pipeline rank of ``plan`` traces fewer micro-batches than its schedule runs: under
    1F1B, on a torch whose shortened trace was checked against the whole one."""
    return plan.parallel.pp_schedule in SHORTENED_SCHEDULES and pipelining.shortened_trace_checked()


def schedule_count(plan: JobPlan) -> int:
    """The micro-batches one step of ``plan`` runs: the pipeline's under PP, else accumulation's."""
    return plan.pipeline_microbatches if plan.dims.pp > 1 else plan.microbatches


def traced_count(plan: JobPlan) -> int:
    """How many micro-batches a step of the simulation holds (see the module docstring); a
    pipeline rank may trace fewer (:func:`rank_count`)."""
    count = schedule_count(plan)
    pp = plan.dims.pp
    if pp == 1:
        on_device = plan.workload.holds_forwards and not plan.workload.offloads_forwards
        return count if on_device else min(count, ACCUMULATION_TRACED)
    if shortened(plan):
        return min(count, max(PIPELINE_TRACED, pp + 1))
    return count


def rank_count(plan: JobPlan, pp_rank: int) -> int:
    """How many micro-batches pipeline rank ``pp_rank`` traces, of ``plan``'s (traced) step."""
    count = schedule_count(plan)
    if plan.dims.pp == 1 or not shortened(plan):
        return count
    return min(count, max(PIPELINE_TRACED, plan.dims.pp - pp_rank + 1))


def shortened_args(plan: JobPlan, traced: int) -> list[str]:
    """Command-line settings that make ``plan``'s job run ``traced`` micro-batches a step, each
    of the same shape."""
    if traced == schedule_count(plan):
        return []
    local = plan.config.training.local_batch_size
    if plan.dims.pp > 1:
        local = traced * plan.parallel.pp_microbatch_size
        global_batch = local * plan.dims.dp
    else:
        global_batch = traced * local * plan.dims.dp
    return ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_batch)]


def extend(costs: MicrobatchCosts, traced: int, real: int, steady: range, reduces_last: bool) -> TracedCost:
    """The step's cost with ``real`` micro-batches, from a trace of ``traced`` (see the module
    docstring): the ``steady`` traced micro-batches stand, on average, for each one not traced,
    their collectives counted that many times where they ran; ``reduces_last``: the step's
    gradient reduction, in the last one, is not repeated."""
    if real == traced:
        return costs.total
    windows = [costs.per_microbatch[m] for m in steady if m in costs.per_microbatch]
    if not windows or len(windows) != len(steady):
        raise ValueError(f"cannot extend {traced} traced micro-batches to {real}: no steady one was traced")
    weight = (real - traced) / len(windows)
    repeated = [
        replace(c, times=c.times * weight)
        for m, window in zip(steady, windows)
        for c in window.collectives
        if not (reduces_last and m == traced - 1 and c.dim in FSDP_DIMS and c.kind in ("reduce_scatter", "all_reduce"))
    ]
    at = costs.first_collective.get(steady.start, len(costs.total.collectives))
    collectives: list[Collective] = list(costs.total.collectives)
    collectives[at:at] = repeated
    extended = TracedCost(collectives=collectives)
    extended.add_scaled(costs.total, 1.0)
    for window in windows:
        extended.add_scaled(window, weight)
    return extended


def steady_microbatches(plan: JobPlan, traced: int) -> range:
    """The traced micro-batches that stand for the ones not traced. Under gradient accumulation,
    the third up to the last, not it: the first gathers what the step gathers once, FSDP finishes
    its reduction in the second, and the last reduces what a deferred reduction (one FSDP rank:
    ``ParallelDims.fsdp_one_rank``) held back all step. Under 1F1B, all but the first: a rank
    traces warm-up micro-batches and as many cool-down ones (the last among them), which average
    to steady ones."""
    if plan.dims.pp > 1:
        return range(1, traced)
    return range(2, traced - 1) if traced > ACCUMULATION_TRACED - 1 else range(2, traced)
