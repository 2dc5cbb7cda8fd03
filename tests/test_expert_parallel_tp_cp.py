"""The MoE promise under tensor and context parallelism: ``ep`` from the ``dp_shard x cp`` ranks,
each TP and CP rank routing its own sequence shard, gives the 1-process run's losses, grad norms,
balancing loss, routing biases, tokens per expert and ``n_valid_tokens`` over several steps with
accumulation and uneven routing, on both CPU context-parallel backends and with loss parallel on
and off; and gradients left unsummed over TP or CP, injected, fail the same comparison.

How close MoE under TP stays, as docs/parallelisms.md states it: on dp_shard=2 x ep=2 x tp=2 over
six steps every layer's global routing counts equal the 1-process run's at every step, and the
loss and grad norm stay within the documented bound (TP's partial matmul sums round differently,
so the bound is round-off, not identity); router and shared-expert gradients left unsummed over
TP, injected, break it."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import SKEW, TOLERANCE, differences, launch_moe, moe_argv, moe_steps

from parallelisms.parallel_dims import ParallelDims, expert_rank_grid

ALLGATHER = ["--parallelism.context_parallel_backend", "allgather_kv"]
ULYSSES = ["--parallelism.context_parallel_backend", "ulysses"]
# name: (world size, local batch size, extra argv); global batch 8, so accumulation = 8 / (local x dp)
MESHES = {
    "dp_shard=2 x ep=2 x tp=2": (4, 2, ["--mesh", "dp_shard=2,tp=2,ep=2"]),
    "tp=2, no expert parallelism": (2, 4, ["--mesh", "tp=2"]),
    "dp_replicate=2 x dp_shard=2 x ep=2 x tp=2": (8, 1, ["--mesh", "dp_replicate=2,dp_shard=2,tp=2,ep=2"]),
    "dp_shard=2 x cp=2 x ep=2, allgather_kv": (4, 2, ["--mesh", "dp_shard=2,cp=2,ep=2", *ALLGATHER]),
    "dp_shard=2 x cp=2 x ep=4, ulysses": (4, 2, ["--mesh", "dp_shard=2,cp=2,ep=4", *ULYSSES]),
    "cp=2 x ep=2 x tp=2, ulysses, no loss parallel, full recompute": (
        4,
        4,
        [
            "--mesh",
            "cp=2,tp=2,ep=2",
            *ULYSSES,
            "--parallelism.disable_loss_parallel",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
}
BUGS = {
    "router and shared experts not summed over tp": MESHES["dp_shard=2 x ep=2 x tp=2"],
    "expert gradients not summed over tp": MESHES["dp_shard=2 x ep=2 x tp=2"],
    "expert gradients not summed over cp": MESHES["dp_shard=2 x cp=2 x ep=2, allgather_kv"],
}


BOUND_MESH = "dp_shard=2 x ep=2 x tp=2"
BOUND_STEPS = 6
# The bound docs/parallelisms.md states, relative, per step: measured at worst 1.1e-7 (loss) and
# 9.8e-8 (grad norm); QK-norm gradients left unsummed over TP reach 5.9e-7 and 1.4e-5, the
# injected router bug 1.2e-4 and 5.3e-3.
LOSS_BOUND = 1e-6
NORM_BOUND = 1e-6


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    world, local, extra = MESHES[BOUND_MESH]
    bound = {
        "bound: reference": (1, (moe_steps, moe_argv(8, []), "", False, BOUND_STEPS)),
        "bound": (world, (moe_steps, moe_argv(local, extra), "", False, BOUND_STEPS)),
    }
    return launch_moe(MESHES, BUGS, also=bound)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_tp_cp_mesh_matches_the_single_process_moe(mesh, launched):
    ref, results = launched["reference"][0], launched[mesh]
    print(mesh, {k: f"{v:.1e}" for k, v in differences(results[0], ref).items()})
    for rank_result in results:
        assert rank_result["n"] == ref["n"]
        assert max(differences(rank_result, ref).values()) < TOLERANCE, differences(rank_result, ref)
    assert (ref["bias"][-1] - SKEW).abs().max() > 0
    # Some expert got no token from some rank's shard in some layer while others did.
    local = torch.stack([torch.stack(r["local"]) for r in results])  # ranks, steps, layers, experts
    assert ((local == 0) & (local.sum(0, keepdim=True) > 0)).any()


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_tp_cp_bug_is_caught(bug, launched):
    ref, result = launched["reference"][0], launched[f"bug: {bug}"][0]
    print(bug, {k: f"{v:.1e}" for k, v in differences(result, ref).items()})
    assert max(differences(result, ref).values()) > 10 * TOLERANCE, differences(result, ref)


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


@pytest.mark.slow
def test_moe_under_tp_stays_within_the_documented_bound(launched):
    ref = launched["bound: reference"][0]
    assert len(ref["loss"]) == BOUND_STEPS
    for rank, result in enumerate(launched["bound"]):
        diff = per_step(result, ref)
        print(rank, {k: [f"{v:.1e}" if isinstance(v, float) else v for v in vs] for k, vs in diff.items()})
        assert result["n"] == ref["n"]
        assert len(result["loss"]) == BOUND_STEPS and within_bound(diff), diff


@pytest.mark.slow
def test_router_unsummed_over_tp_breaks_the_bound(launched):
    bug = "router and shared experts not summed over tp"
    diff = per_step(launched[f"bug: {bug}"][0], launched["reference"][0])
    print(bug, {k: [f"{v:.1e}" if isinstance(v, float) else v for v in vs] for k, vs in diff.items()})
    assert not within_bound(diff), diff


def test_ep_takes_consecutive_dp_shard_x_cp_ranks_and_experts_shard_over_the_rest_and_tp():
    """On 16 ranks (dp_replicate 2, dp_shard 2, cp 2, tp 2) with ep = 4: every EP group is the
    ``dp_shard x cp`` ranks of one replica and TP index, and each EP rank's expert shards span the
    ranks of its replica that hold the same experts, TP included (so every token's gradient is
    summed), and nothing else."""
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, world_size=16, ep=4)
    world = torch.arange(16).reshape(1, 2, 2, 2, 2)  # (pp, dp_replicate, dp_shard, cp, tp)
    grid, names = expert_rank_grid(world, dims)
    assert names == ("pp", "dp_replicate", "ep", "expert_shard") and grid.shape == (1, 2, 4, 2)
    assert sorted(grid.flatten().tolist()) == list(range(16))
    for replica in range(2):
        for tp in range(2):
            ep_group = world[0, replica, :, :, tp].flatten()  # dp_shard x cp, consecutive
            assert ep_group.tolist() in grid[0, replica].T.tolist()
        for e in range(4):
            shard_group = grid[0, replica, e]
            assert shard_group.tolist() == world[0, replica].flatten()[e * 2 : e * 2 + 2].tolist()
