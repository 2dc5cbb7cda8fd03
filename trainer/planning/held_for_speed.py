"""What the ``default`` settings hold for speed, where the memory estimate leaves room for it:
exact MoE balancing's held forwards (which spare the counting pre-pass) and their loss's
gradients, and routed experts over one FSDP rank kept gathered through the step. The job, the
dry run and ``--simulate`` all take the decision made here for the target's memory."""

from __future__ import annotations

from dataclasses import replace

from trainer.planning.memory_plan import estimate
from trainer.planning.workload import Workload

HELD_FORWARDS_SHARE = 0.9
"""The share of a rank's memory the estimate may reach with what ``default`` settings hold for
speed (the presets' headroom)."""
GATHERED_EXPERTS_SHARE = 0.85
"""The same with routed experts kept gathered, which buy a few percent of the step for GiB: only
well inside the headroom, as the estimate can fall a little short of the simulation (Qwen3-30B-A3B
on 8 H100s with them: 71.0 GiB estimated, 71.4 simulated, over the 90% line's 71.3)."""


def fitted(w: Workload, limit: int | None) -> Workload:
    """``w`` for a rank of ``limit`` bytes (None: unknown, everything held), giving up what the
    ``default`` settings hold for speed, least worth first, until the estimate is within
    ``HELD_FORWARDS_SHARE`` of ``limit``. Exact balancing's held forwards spare the counting
    pre-pass (a forward); their loss's gradients, held, a third more of the output projection's
    work; routed experts over one rank kept gathered (within ``GATHERED_EXPERTS_SHARE``), a cast
    and a copy of them per micro-batch. So the experts go first, then the loss's gradients (the
    experts tried again without them), then the held forwards go to host memory on a GPU
    (``moe.held_forwards = auto``: copies on a stream of their own, where the pre-pass would be
    a forward of compute), and last to the pre-pass."""
    if limit is None:
        return w
    places = [(w.hold_forwards, w.offload_forwards)]
    if w.fit_held_forwards:
        places = [(True, False), *([(True, True)] if w.device != "cpu" else []), (False, False)]
    candidates = [
        replace(
            w,
            hold_forwards=w.hold_forwards and forwards,
            offload_forwards=offload,
            hold_loss_gradients=w.hold_loss_gradients and gradients,
            gathers_one_rank_experts=w.gathers_one_rank_experts and experts,
        )
        for forwards, offload in places
        for gradients in ((True, False) if forwards else (False,))
        for experts in (True, False)
    ]

    def fits(c: Workload) -> bool:
        return estimate(c).total <= (GATHERED_EXPERTS_SHARE if c.experts_stay_gathered else HELD_FORWARDS_SHARE) * limit

    return next((c for c in candidates if fits(c)), candidates[-1])
