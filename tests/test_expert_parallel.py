"""The MoE promise: for a fixed global batch, every mesh and accumulation count gives the 1-process
run's losses, grad norms, balancing loss (``global_batch`` scope), routing biases, tokens per
expert and ``n_valid_tokens``, over several optimizer steps; and the classic MoE bugs, injected,
fail the same comparison."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import SKEW, TOLERANCE, differences, launch_moe

# name: (world size, local batch size, extra argv); global batch 8, so accumulation = 8 / (local x dp)
MESHES = {
    "ep=2, 2 micro-batches": (2, 2, ["--mesh", "dp_shard=2,ep=2"]),
    # Exchanges overlapped in 3 chunks of unequal tokens (default 2), and not at all below.
    "ep=4, 2 micro-batches, 3 exchange chunks": (
        4,
        1,
        ["--mesh", "dp_shard=4,ep=4", "--parallelism.expert_parallel_overlap_chunks", "3"],
    ),
    # ep = dp_shard: the experts' FSDP unit spans one rank and stays gathered through the step.
    "ep=2, 4 micro-batches, full recompute": (
        2,
        1,
        ["--mesh", "dp_shard=2,ep=2", "--activation_checkpoint.mode", "full"],
    ),
    "dp_shard=4 x ep=2, full recompute": (4, 1, ["--mesh", "dp_shard=4,ep=2", "--activation_checkpoint.mode", "full"]),
    "dp_replicate=2 x ep=2, 2 micro-batches, 1 exchange chunk": (
        4,
        1,
        ["--mesh", "dp_replicate=2,dp_shard=2,ep=2", "--parallelism.expert_parallel_overlap_chunks", "1"],
    ),
}
BUGS = {
    "balancing loss per micro-batch": (4, 1, ["--mesh", "dp_shard=4,ep=2", "--moe.balance_loss_scope", "micro_batch"]),
    "tokens counted again in recompute": MESHES["dp_shard=4 x ep=2, full recompute"],
    # Under full recompute the step's own forwards count the routing (no pre-pass).
    "step's counts not summed over the routing mesh": MESHES["dp_shard=4 x ep=2, full recompute"],
    "expert gradients divided by ep": MESHES["ep=4, 2 micro-batches, 3 exchange chunks"],
}


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    return launch_moe(MESHES, BUGS)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_matches_the_single_process_moe(mesh, launched):
    ref, results = launched["reference"][0], launched[mesh]
    print(mesh, {k: f"{v:.1e}" for k, v in differences(results[0], ref).items()})
    for rank_result in results:
        assert rank_result["n"] == ref["n"]
        assert max(differences(rank_result, ref).values()) < TOLERANCE, differences(rank_result, ref)
    # The bias really moved, and the routing really was uneven: some expert got no token from
    # some rank in some layer while others did.
    assert (ref["bias"][-1] - SKEW).abs().max() > 0
    local = torch.stack([torch.stack(r["local"]) for r in results])  # ranks, steps, layers, experts
    if len(results) > 1:
        assert ((local == 0) & (local.sum(0, keepdim=True) > 0)).any()


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_moe_bug_is_caught(bug, launched):
    ref, result = launched["reference"][0], launched[f"bug: {bug}"][0]
    print(bug, {k: f"{v:.1e}" for k, v in differences(result, ref).items()})
    assert max(differences(result, ref).values()) > 10 * TOLERANCE, differences(result, ref)
