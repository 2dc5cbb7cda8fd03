"""MoE under every activation-checkpointing mode: with and without expert parallelism (and under
context parallelism), each mode gives the 1-process run without checkpointing's losses, grad norms,
balancing loss, routing biases and tokens per expert (counted once, never again in a
recomputation), while the MoE time split measures and, at op level, a profiler records: the
``record_function`` ranges these open, and the routed experts' own FSDP unit, inside the
checkpointed block. At op level the recomputation sends no token again, and the memory estimate
keeps what the simulation keeps. The crash of torch's own selective-checkpointing contexts, and a
recomputation that re-sends the tokens, put back, fail."""

from __future__ import annotations

import contextlib

import pytest
import torch
from harness import run_by_world
from moe_helpers import TOLERANCE, differences, moe_argv, moe_steps
from simulation_helpers import CONFIGS, simulate_job
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallelisms import activation_checkpoint
from parallelisms.moe_split import PARTS, SPLIT
from parallelisms.torch_private import kernels
from trainer.config import load_config
from trainer.planning.job_plan import resolve_job
from trainer.planning.memory_plan import estimate

MODES = {
    "none": [],
    "full": ["--activation_checkpoint.mode", "full"],
    "every 2nd block": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
}
# name: (world size, local batch size, extra argv); global batch 8, so every case accumulates 2 micro-batches
MESHES = {
    "ep=1": (1, 4, []),
    "dp_shard=2 x ep=2": (2, 2, ["--mesh", "dp_shard=2,ep=2"]),
}
CASES = {
    f"{mesh}, AC {mode}": (world, local, extra + MODES[mode])
    for mesh, (world, local, extra) in MESHES.items()
    for mode in MODES
}
CASES["dp_shard=2 x ep=2, AC full, held in host memory"] = (
    2,
    2,
    ["--mesh", "dp_shard=2,ep=2", *MODES["full"], "--moe.held_forwards", "host"],
)
CASES["cp=2 x ep=2 ulysses, AC op"] = (
    2,
    4,
    ["--mesh", "cp=2,ep=2", "--parallelism.context_parallel_backend", "ulysses", *MODES["op"]],
)
PROFILED = {name for name in CASES if name.endswith("AC op")}
BUGS = {
    "torch's selective-checkpointing contexts": CASES["dp_shard=2 x ep=2, AC op"],
    "all-to-alls recomputed": CASES["dp_shard=2 x ep=2, AC op"],
    "tokens counted again in recompute, AC op": CASES["dp_shard=2 x ep=2, AC op"],
    "tokens counted again in recompute, AC every 2nd block": CASES["dp_shard=2 x ep=2, AC every 2nd block"],
}
MICRO_BATCHES, MOE_LAYERS = 2, 3
STEPS = 2
"""The second step routes with the biases, and steps with the optimizer state, the first left: what
a third would check again."""
CHUNKS = 2
"""``parallelism.expert_parallel_overlap_chunks``, as these runs leave it."""
EXCHANGES = 1 + 2 * CHUNKS
"""All-to-alls of an MoE layer's forward under expert parallelism: the counts, each chunk's tokens
there and back; the backward sends each chunk's gradients back and there (``2 x CHUNKS``)."""


class CollectivesInBackward(TorchDispatchMode):
    """Counts the all-to-alls that run while autograd runs a backward: below selective
    checkpointing's mode, it sees only what is really sent, not what a recomputation takes saved."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is kernels.ALL_TO_ALL and kernels.in_backward()
        return func(*args, **(kwargs or {}))


def _torch_contexts():
    def policy(ctx, op, *args, **kwargs):
        saved = op in activation_checkpoint.SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed_steps(argv: list[str], profiled: bool, bug: str = "") -> dict:
    """``moe_steps`` with the MoE time split measuring, under a profiler if ``profiled``; what
    each rank reports, with the split, the all-to-alls sent in backward, or the error."""
    contexts, saved, in_backward = (
        activation_checkpoint._op_contexts,
        activation_checkpoint.SAVED_OPS,
        kernels.in_backward,
    )
    if bug == "torch's selective-checkpointing contexts":
        activation_checkpoint._op_contexts = _torch_contexts
    if bug == "all-to-alls recomputed":
        activation_checkpoint.SAVED_OPS = saved - {kernels.ALL_TO_ALL}
    counting = CollectivesInBackward()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    SPLIT.start(torch.device("cpu"))
    try:
        with profiler if profiled else contextlib.nullcontext(), counting:
            out = moe_steps(argv, bug.split(",")[0], steps=STEPS)
    except RuntimeError as error:
        return {"error": str(error)}
    finally:
        split = SPLIT.stop()
        activation_checkpoint._op_contexts, activation_checkpoint.SAVED_OPS = contexts, saved
        kernels.in_backward = in_backward
    return {**out, "split": split, "sent in backward": counting.count}


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    cases = {"reference": (1, (moe_steps, moe_argv(8, []), "", False, STEPS))}
    for name, (world, local, extra) in CASES.items():
        cases[name] = (world, (checkpointed_steps, moe_argv(local, extra), name in PROFILED))
    for name, (world, local, extra) in BUGS.items():
        cases[f"bug: {name}"] = (world, (checkpointed_steps, moe_argv(local, extra), True, name))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_matches_the_single_process_moe(case, launched):
    ref, results = launched["reference"][0], launched[case]
    print(case, {k: f"{v:.1e}" for k, v in differences(results[0], ref).items()})
    for rank_result in results:
        assert "error" not in rank_result, rank_result["error"]
        assert rank_result["n"] == ref["n"]
        assert max(differences(rank_result, ref).values()) < TOLERANCE, differences(rank_result, ref)
        assert all(rank_result["split"][part] > 0 for part in PARTS), rank_result["split"]
        assert (rank_result["to host"] > 0) == case.endswith("host memory"), rank_result["to host"]


@pytest.mark.slow
def test_op_level_recomputation_sends_no_token_again(launched):
    for case in ("dp_shard=2 x ep=2, AC op", "dp_shard=2 x ep=2, AC full"):
        recomputed = EXCHANGES if case.endswith("full") else 0
        expected = (2 * CHUNKS + recomputed) * MOE_LAYERS * MICRO_BATCHES * STEPS
        assert [r["sent in backward"] for r in launched[case]] == [expected] * 2, case


@pytest.mark.slow
def test_torch_contexts_crash_on_the_experts_unit(launched):
    for rank_result in launched["bug: torch's selective-checkpointing contexts"]:
        assert "not found in storage" in rank_result.get("error", ""), rank_result


@pytest.mark.slow
def test_recomputed_all_to_alls_are_caught(launched):
    sent = [r["sent in backward"] for r in launched["bug: all-to-alls recomputed"]]
    assert sent == [(2 * CHUNKS + EXCHANGES) * MOE_LAYERS * MICRO_BATCHES * STEPS] * 2


@pytest.mark.slow
@pytest.mark.parametrize("bug", [bug for bug in BUGS if bug.startswith("tokens counted again")])
def test_tokens_counted_again_in_recompute_are_caught(bug, launched):
    ref, result = launched["reference"][0], launched[f"bug: {bug}"][0]
    assert differences(result, ref)["tokens"] > 10 * TOLERANCE, differences(result, ref)


@pytest.mark.slow
def test_the_estimate_keeps_per_moe_layer_what_the_simulation_keeps(tmp_path):
    """What op-level checkpointing keeps of an MoE block, the routed experts' matmul outputs and
    the token all-to-alls' included: Qwen3-30B-A3B at 2 and 4 layers, ep=4 of 8 ranks, the
    estimate's growth per layer within 10% of the simulated peak's."""
    estimated, simulated = {}, {}
    for layers in (2, 4):
        args = ["--config", str(CONFIGS / "qwen3_30b_a3b.toml"), "--model.n_layers", str(layers), *MODES["op"]]
        args += ["--training.global_batch_size", "8", "--mesh", "dp_shard=8,ep=4"]
        code, text, report = simulate_job(tmp_path / str(layers), 8, *args, "--target-gpu", "h100")
        assert code == 0, text
        simulated[layers] = report["roles"][0]["needed_bytes"]
        estimated[layers] = estimate(resolve_job(load_config(args), 8, device="cuda", figures={}).workload).total
    assert estimated[4] - estimated[2] == pytest.approx(simulated[4] - simulated[2], rel=0.1), (estimated, simulated)


@pytest.mark.slow
def test_full_checkpointing_counts_the_step_in_its_own_forwards(monkeypatch):
    """Exact balancing under full checkpointing runs no counting pre-pass: every forward of the
    step, then the step's counts, then the backwards, whose recomputations read them. Losses,
    grad norms, balancing loss, biases and counts are the pre-pass's (the reference); the step's
    counts left unset before the backwards (the recomputations reading none) fail."""
    from trainer import loss
    from trainer.planning.workload import Workload
    from trainer.step import expert_balance, schedules

    full = moe_argv(2, MODES["full"])  # 4 micro-batches
    with monkeypatch.context() as patched:
        patched.setattr(Workload, "holds_forwards", property(lambda self: False))
        ref = moe_steps(full, steps=STEPS)

    def no_prepass(*args):
        raise AssertionError("the interleaved schedule, whose pre-pass counts, ran")

    held_losses = []
    with_gradients = loss.linear_cross_entropy_sum_with_gradients
    monkeypatch.setattr(schedules.Interleaved, "run", no_prepass)
    monkeypatch.setattr(
        loss, "linear_cross_entropy_sum_with_gradients", lambda *a: held_losses.append(1) or with_gradients(*a)
    )
    assert max(differences(moe_steps(full, steps=STEPS), ref).values()) < TOLERANCE
    assert len(held_losses) == 4 * STEPS  # the held forwards computed their loss's gradients at once
    monkeypatch.setattr(expert_balance.ExpertBalance, "forwards_done", lambda self: None)
    wrong = differences(moe_steps(full, steps=STEPS), ref)
    assert wrong["balance"] > 0.1 and wrong["norm"] > 10 * TOLERANCE, wrong
