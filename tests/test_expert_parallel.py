"""The MoE promise: for a fixed global batch, every mesh and accumulation count gives the 1-process
run's losses, grad norms, balancing loss (``global_batch`` scope), routing biases, tokens per
expert and ``n_valid_tokens``, over several optimizer steps; and the classic MoE bugs, injected,
fail the same comparison."""

from __future__ import annotations

import pytest
import torch
from harness import BASE_ARGV, run_by_world, trainer_for

from parallelisms.torch_private import kernels
from trainer.model.moe import moe_layers
from trainer.step import fetch_step, forward_backward, optimizer_step

STEPS = 3
TOLERANCE = 5e-5
MOE_ARGV = [
    *BASE_ARGV,
    "--model.name",
    "moe",
    "--model.flavor",
    "debugmoe",
    "--moe.balance_loss_weight",
    "0.1",
    "--moe.bias_update_rate",
    "0.01",
    "--optimizer.lr",
    "0.003",
    "--lr_scheduler.warmup_steps",
    "0",
]
# A routing bias that makes the last experts rare, so some get no token from some ranks.
SKEW = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.05, -0.1, -0.2])

# name: (world size, local batch size, extra argv); global batch 8, so accumulation = 8 / (local x dp)
MESHES = {
    "ep=2, 2 micro-batches": (2, 2, ["--mesh", "dp_shard=2,ep=2"]),
    "ep=4, 2 micro-batches": (4, 1, ["--mesh", "dp_shard=4,ep=4"]),
    "dp_shard=4 x ep=2, full recompute": (4, 1, ["--mesh", "dp_shard=4,ep=2", "--activation_checkpoint.mode", "full"]),
    "dp_replicate=2 x ep=2, 2 micro-batches": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2,ep=2"]),
}
BUGS = {
    "balancing loss per micro-batch": (4, 1, ["--mesh", "dp_shard=4,ep=2", "--moe.balance_loss_scope", "micro_batch"]),
    "tokens counted again in recompute": MESHES["dp_shard=4 x ep=2, full recompute"],
    "expert gradients divided by ep": MESHES["ep=4, 2 micro-batches"],
}


def moe_argv(local_batch: int, extra: list[str]) -> list[str]:
    return [*MOE_ARGV, "--training.local_batch_size", str(local_batch), *extra]


def moe_steps(argv: list[str], bug: str = "") -> dict:
    """``STEPS`` optimizer steps through the trainer's own code; what every rank reports."""
    if bug == "tokens counted again in recompute":
        kernels.in_backward = lambda: False
    p, parts = trainer_for(argv)
    layers = moe_layers(parts.model)
    for layer in layers:
        layer.expert_bias.copy_(SKEW)
    if bug == "expert gradients divided by ep":
        for layer in layers:
            layer.experts.set_gradient_divide_factor(float(p.dims.ep))
    assert parts.balance is not None
    out: dict[str, list] = {"loss": [], "norm": [], "n": [], "balance": [], "bias": [], "tokens": [], "local": []}
    for _ in range(STEPS):
        result = forward_backward(parts, fetch_step(parts))
        out["local"].append(torch.stack([layer.tokens_per_expert.clone() for layer in layers]))
        optimizer_step(parts, result)
        stats = parts.balance.finish_step(result.skipped)
        out["loss"].append(result.loss_avg)
        out["norm"].append(result.grad_norm)
        out["n"].append(result.n_valid_tokens)
        out["balance"].append(stats.balance_loss)
        out["bias"].append(stats.expert_bias)
        out["tokens"].append(stats.tokens_per_expert)
    return out


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    cases = {"reference": (1, (moe_steps, moe_argv(8, [])))}
    for name, (world, local, extra) in MESHES.items():
        cases[name] = (world, (moe_steps, moe_argv(local, extra)))
    for name, (world, local, extra) in BUGS.items():
        cases[f"bug: {name}"] = (world, (moe_steps, moe_argv(local, extra), name))
    return run_by_world(cases)


def differences(result: dict, ref: dict) -> dict[str, float]:
    """The largest relative difference of each reported value over the steps."""

    def rel(a, b) -> float:
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()

    return {
        key: max(rel(a, b) for a, b in zip(result[key], ref[key]))
        for key in ("loss", "norm", "balance", "bias", "tokens")
    }


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
