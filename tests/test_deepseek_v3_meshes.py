"""DeepSeek-V3 on every mesh it composes with: the debug model's (a query latent, YaRN, a dense
first block, group-limited sigmoid routing, a shared expert, a value head narrower than the
query's) gradients of a fixed global batch equal one process's, uneven tokens per rank and
micro-batch; over three steps its losses, grad norms, balancing, routing biases and tokens per
expert do too with expert and pipeline parallelism; the sequence-wise balancing loss is exact
under accumulation and PP; and the faults of each kind, injected, fail the same comparison: the
MoE's (balancing per micro-batch, expert gradients divided by EP) and the latent attention's under
TP (the replicated latents' gradient shares left unsummed over TP, or summed twice); a
checkpoint, routing biases included, resumes on another mesh with the same curve; and with
``debug.layout_invariant`` FSDP trains one process's bits. Compiled
(``aot_eager``) under TP the gradients equal eager one-process ones; in float8 (rowwise) under TP
they are another float8 rounding of the same ones, as close to the high-precision gradients as one
process's float8 (docs/float8.md: each TP rank scales its own share of a contraction).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import COMMON, assert_resumes_on_another_mesh
from harness import (
    GLOBAL_BATCH,
    ROOT,
    argv_for,
    assert_matches,
    max_relative_error,
    reference,
    run_by_world,
    run_train,
    step_worker,
)
from moe_helpers import SKEW, TOLERANCE, differences, moe_argv, moe_steps
from torch.distributed.tensor import Replicate

from parallelisms import fsdp, tensor_parallel
from trainer.checkpoint.model_entry import read_dcp_model

sys.path.insert(0, str(ROOT / "scripts"))
import compare_checkpoints

DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "deepseek_v3_debug"]
ULYSSES = ["--parallelism.context_parallel_backend", "ulysses"]
ALLGATHER = ["--parallelism.context_parallel_backend", "allgather_kv"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
SEQUENCE = ["--moe.balance_loss_scope", "sequence"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager", "--compile.components", "model"]
FLOAT8 = ["--model.converters", "float8", "--float8.recipe_name", "rowwise"]

# name: (world size, local batch size, extra argv); global batch 8, accumulation = 8 / (local x dp)
GRADIENT_MESHES = {
    "FSDP 4 x 2 micro-batches": (4, 1, []),
    "FSDP 2 x TP 2 (loss parallel)": (4, 2, TP2),
    "FSDP 2 x TP 2, compiled (aot_eager)": (4, 2, [*TP2, *COMPILED]),
    "HSDP 2 x 2": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2"]),
    "FSDP 2 x CP 2, allgather_kv": (4, 2, ["--mesh", "dp_shard=2,cp=2", *ALLGATHER]),
    "CP 2 x TP 2, ulysses, full AC": (4, 4, ["--mesh", "cp=2,tp=2", *ULYSSES, *FULL_AC]),
}
"""One step through ``step_worker``: every parameter's gradient against one process's."""

ROUTED_MESHES = {
    "dp_shard=4 x ep=2, full recompute": (4, 1, ["--mesh", "dp_shard=4,ep=2", *FULL_AC]),
    "dp_shard=2 x ep=2 x tp=2": (4, 2, ["--mesh", "dp_shard=2,tp=2,ep=2"]),
    "pp=2 x dp_shard=2 x ep=2, 4 micro-batches": (4, 1, ["--mesh", "pp=2,dp_shard=2,ep=2"]),
    "sequence-wise balance, pp=2 x dp_shard=2 x ep=2": (4, 1, ["--mesh", "pp=2,dp_shard=2,ep=2", *SEQUENCE]),
    "sequence-wise balance, dp_shard=2 x ep=2, 4 micro-batches": (2, 1, ["--mesh", "dp_shard=2,ep=2", *SEQUENCE]),
}
"""Three steps through ``moe_steps``, against the one-process run of the same balancing scope."""

BUGS = {
    "balancing loss per micro-batch": (4, 1, ["--mesh", "dp_shard=4,ep=2", "--moe.balance_loss_scope", "micro_batch"]),
    "expert gradients divided by ep": ROUTED_MESHES["dp_shard=4 x ep=2, full recompute"],
    "latent gradients not summed over tp": ROUTED_MESHES["dp_shard=2 x ep=2 x tp=2"],
    "latent gradient shares all-reduced": ROUTED_MESHES["dp_shard=2 x ep=2 x tp=2"],
}


def _all_reduced(ctx: Any, grad: Any) -> tuple[torch.Tensor, None]:
    return grad.redistribute(ctx.mesh, (Replicate(),)).to_local(), None


def latent_steps(argv: list[str], bug: str) -> dict:
    """:func:`moe_steps`, with the latent attention's TP faults injected for the case alone."""
    replicated, backward = fsdp.replicated_over_tp, tensor_parallel._ShareOfReplica.backward
    if bug == "latent gradients not summed over tp":
        fsdp.replicated_over_tp = lambda attention: []
    if bug == "latent gradient shares all-reduced":
        tensor_parallel._ShareOfReplica.backward = staticmethod(_all_reduced)  # type: ignore[method-assign]
    try:
        return moe_steps(argv, bug)
    finally:
        fsdp.replicated_over_tp = replicated
        tensor_parallel._ShareOfReplica.backward = backward  # type: ignore[method-assign]


def _reference_of(extra: list[str]) -> str:
    return "sequence reference" if "sequence" in extra else "reference"


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    cases: dict[str, tuple[int, tuple]] = {
        "reference": (1, (latent_steps, moe_argv(8, [], DEEPSEEK), "")),
        "sequence reference": (1, (latent_steps, moe_argv(8, SEQUENCE, DEEPSEEK), "")),
        "gradients: reference": (1, (reference, argv_for(GLOBAL_BATCH, DEEPSEEK))),
        "float8: reference": (1, (step_worker, argv_for(GLOBAL_BATCH, [*DEEPSEEK, *FLOAT8]))),
        "float8: FSDP 2 x TP 2": (4, (step_worker, argv_for(2, [*DEEPSEEK, *FLOAT8, *TP2]))),
    }
    for name, (world, local, extra) in GRADIENT_MESHES.items():
        cases[f"gradients: {name}"] = (world, (step_worker, argv_for(local, [*DEEPSEEK, *extra])))
    for name, (world, local, extra) in ROUTED_MESHES.items():
        cases[name] = (world, (latent_steps, moe_argv(local, extra, DEEPSEEK), ""))
    for name, (world, local, extra) in BUGS.items():
        cases[f"bug: {name}"] = (world, (latent_steps, moe_argv(local, extra, DEEPSEEK), name))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(GRADIENT_MESHES))
def test_every_gradient_matches_one_process(mesh: str, launched: dict) -> None:
    ref, results = launched["gradients: reference"][0], launched[f"gradients: {mesh}"]
    assert_matches(results[0], ref)
    counts = [c for r in results for c in r["counts"]]
    assert len(set(counts)) > 1, counts  # uneven micro-batches, or a per-micro-batch mean would pass


@pytest.mark.slow
def test_float8_under_tp_rounds_as_well_as_one_process(launched: dict) -> None:
    """Each TP rank rounds its own share of a contraction (a latent projection's gradient is a sum
    of the ranks' shares), so the bits differ from one process's float8; measured: loss 1.3e-7 and
    grad norm 1.0e-6 apart, every gradient as far from the high-precision ones as one process's
    float8 (at most 12.1% of a tensor's norm, both). The TP faults above would be far larger."""
    exact, one, tp = (launched[k][0] for k in ("gradients: reference", "float8: reference", "float8: FSDP 2 x TP 2"))
    assert tp["n"] == one["n"] and tp["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert tp["norm"] == pytest.approx(one["norm"], rel=1e-5)
    for name, grad in tp["grads"].items():
        rounding = max_relative_error({name: one["grads"][name]}, {name: exact["grads"][name]})
        assert max_relative_error({name: grad}, {name: exact["grads"][name]}) < 1.5 * rounding + 1e-6, name
    assert max_relative_error(tp["grads"], exact["grads"]) < 1.05 * max_relative_error(one["grads"], exact["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(ROUTED_MESHES))
def test_every_routed_mesh_matches_one_process(mesh: str, launched: dict) -> None:
    ref = launched[_reference_of(ROUTED_MESHES[mesh][2])][0]
    results = launched[mesh]
    print(mesh, {k: f"{v:.1e}" for k, v in differences(results[0], ref).items()})
    for rank_result in results:
        assert rank_result["n"] == ref["n"]
        assert max(differences(rank_result, ref).values()) < TOLERANCE, differences(rank_result, ref)
    assert (ref["bias"][-1] - SKEW).abs().max() > 0  # the group-limited router's bias moved


@pytest.mark.slow
def test_the_sequence_wise_loss_is_another_loss(launched: dict) -> None:
    """The two scopes' references part: the sequence-wise comparisons above compare a loss of its own."""
    a, b = launched["reference"][0], launched["sequence reference"][0]
    assert max(differences(a, b)["balance"], differences(a, b)["norm"]) > 10 * TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_bug_is_caught(bug: str, launched: dict) -> None:
    ref, result = launched["reference"][0], launched[f"bug: {bug}"][0]
    print(bug, {k: f"{v:.1e}" for k, v in differences(result, ref).items()})
    assert max(differences(result, ref).values()) > 10 * TOLERANCE, differences(result, ref)


@pytest.mark.launcher
def test_a_checkpoint_resumes_on_another_mesh_with_the_same_curve(tmp_path) -> None:
    """FSDP 2 x EP 2 trains 4 steps, saving at 2 (the routing biases with the weights); TP 2
    without EP resumes step-2 and logs the losses and grad norms of steps 3-4."""
    job = [*COMMON, *DEEPSEEK, "--training.local_batch_size", "2", "--training.steps", "4"]
    job += ["--moe.bias_update_rate", "0.01", "--checkpoint.enable", "--checkpoint.interval", "2"]
    saved = assert_resumes_on_another_mesh(tmp_path, job, ["--mesh", "dp_shard=2,ep=2"], ["--mesh", "tp=2"])
    assert read_dcp_model(saved)["layers.1.feed_forward.expert_bias"].abs().max() > 0


EXACT = re.compile(r"exact step values: (loss \S+, tokens \d+, grad norm \S+)")


@pytest.mark.launcher
def test_the_layout_invariant_mode_trains_one_process_s_bits(tmp_path: Path) -> None:
    """``debug.layout_invariant`` without EP: 3 steps of FSDP 4 x 2 micro-batches log the exact
    values of 1 process x 8 and end in its checkpoint's bits (weights, routing biases, AdamW
    state), with full activation checkpointing (every forward held until the backwards) and the
    ``global_batch`` balancing loss, whose frequencies the held forwards count."""
    job = [*COMMON, *DEEPSEEK, *FULL_AC, "--training.local_batch_size", "1", "--training.steps", "3"]
    job += ["--debug.layout_invariant", "--moe.balance_loss_scope", "global_batch", "--moe.bias_update_rate", "0.01"]
    job += ["--checkpoint.enable", "--checkpoint.interval", "3", "--metrics.enable_tensorboard=false"]
    logged, final = {}, {}
    for ngpu in (1, 4):
        dump = tmp_path / str(ngpu)
        done = run_train(ngpu, [*job, "--job.dump_folder", str(dump)], timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        logged[ngpu] = EXACT.findall(done.stderr + done.stdout)
        final[ngpu] = compare_checkpoints.read_tensors(dump / "checkpoint" / "step-3")
    assert len(logged[1]) == 3 and len(set(logged[1])) == 3
    assert logged[4] == logged[1]
    assert final[1]["model.layers.1.feed_forward.expert_bias"].abs().max() > 0
    result = compare_checkpoints.compare(final[1], final[4])
    assert result.compared == len(final[1]) and not result.differing, result.differing[:3]
