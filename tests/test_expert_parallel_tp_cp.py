"""The MoE promise under tensor and context parallelism: ``ep`` from the ``dp_shard x cp`` ranks,
each TP and CP rank routing its own sequence shard, gives the 1-process run's losses, grad norms,
balancing loss, routing biases, tokens per expert and ``n_valid_tokens`` over several steps with
accumulation and uneven routing, on both CPU context-parallel backends and with loss parallel on
and off; and gradients left unsummed over TP or CP, injected, fail the same comparison."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import SKEW, TOLERANCE, differences, launch_moe

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


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    return launch_moe(MESHES, BUGS)


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
