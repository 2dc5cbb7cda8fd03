"""How close MoE under tensor parallelism stays to one process, as docs/parallelisms.md states it:
on dp_shard=2 x ep=2 x tp=2 over six steps every layer's global routing counts equal the
1-process run's at every step, and the loss and grad norm stay within the documented bound
(TP's partial matmul sums round differently, so the bound is round-off, not identity). Router
and shared-expert gradients left unsummed over TP, injected, break it, as do the QK-norms'
gradients left unsummed over TP."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import launch_moe

STEPS = 6
# The bound docs/parallelisms.md states, relative, per step: measured at worst 1.1e-7 (loss) and
# 9.8e-8 (grad norm); QK-norm gradients left unsummed over TP reach 5.9e-7 and 1.4e-5, the
# injected router bug 1.2e-4 and 5.3e-3.
LOSS_BOUND = 1e-6
NORM_BOUND = 1e-6
MESH = (4, 2, ["--mesh", "dp_shard=2,tp=2,ep=2"])
BUG = "router and shared experts not summed over tp"


def per_step(result: dict, ref: dict) -> dict[str, list]:
    """Each step's relative loss and grad-norm difference and whether every layer's global
    routing counts equal the reference's."""

    def rel(a, b) -> float:
        return abs(float(a) - float(b)) / max(abs(float(b)), 1e-12)

    return {
        "loss": [rel(a, b) for a, b in zip(result["loss"], ref["loss"])],
        "norm": [rel(a, b) for a, b in zip(result["norm"], ref["norm"])],
        "routing": [torch.equal(a, b) for a, b in zip(result["tokens"], ref["tokens"])],
    }


def within_bound(diff: dict[str, list]) -> bool:
    return all(diff["routing"]) and max(diff["loss"]) < LOSS_BOUND and max(diff["norm"]) < NORM_BOUND


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    return launch_moe({"tp": MESH}, {BUG: MESH}, steps=STEPS)


@pytest.mark.slow
def test_moe_under_tp_stays_within_the_documented_bound(launched):
    ref = launched["reference"][0]
    assert len(ref["loss"]) == STEPS
    for rank, result in enumerate(launched["tp"]):
        diff = per_step(result, ref)
        print(rank, {k: [f"{v:.1e}" if isinstance(v, float) else v for v in vs] for k, vs in diff.items()})
        assert result["n"] == ref["n"]
        assert all(diff["routing"]), diff
        assert within_bound(diff), diff


@pytest.mark.slow
def test_router_unsummed_over_tp_breaks_the_bound(launched):
    ref, result = launched["reference"][0], launched[f"bug: {BUG}"][0]
    diff = per_step(result, ref)
    print(BUG, {k: [f"{v:.1e}" if isinstance(v, float) else v for v in vs] for k, vs in diff.items()})
    assert not within_bound(diff), diff
