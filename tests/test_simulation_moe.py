"""``--simulate`` of Mixture-of-Experts jobs: the real token exchange on fake tensors, its
all-to-alls timed, the grouped matmul's FLOPs counted, the stated routing imbalance sizing the
simulated rank, and the estimate following the simulation."""

from __future__ import annotations

from dataclasses import replace

import pytest
from simulation_helpers import CONFIGS, simulate_job

from trainer.config import load_config
from trainer.metrics import model_flops_per_token
from trainer.planning.job_plan import resolve_job
from trainer.planning.memory_limits import TARGET_MEMORY_BYTES
from trainer.planning.memory_plan import estimate, estimates
from trainer.simulation.cost_model import Collective, TracedCost
from trainer.simulation.step_time import memory_bandwidth, step_time
from trainer.simulation.targets import target_named

H100 = TARGET_MEMORY_BYTES["h100"]
"""The target the simulations run for: the estimates resolve ``auto`` (the loss chunking) for it too."""
DEBUG_MOE = ["--config", str(CONFIGS / "debug_moe.toml"), "--target-gpu", "h100"]
QWEN3_BLOCKS = [
    "--config",
    str(CONFIGS / "qwen3_30b_a3b.toml"),
    "--model.n_layers",
    "4",
    "--activation_checkpoint.mode",
    "none",
    "--training.global_batch_size",
    "8",
]
"""Qwen3-30B-A3B's blocks at 4 layers without checkpointing: the routed tokens' activations
weigh most."""


@pytest.mark.slow
def test_debug_moe_exchanges_its_routed_tokens_as_the_routing_says(tmp_path):
    """ep 2 and 4 of 4 ranks: the all-to-alls carry the (ep - 1) / ep of the routed rows that
    leave the rank, so their bytes grow by 3/4 : 1/2; the busiest rank receiving 1.5x the
    average makes every token exchange 1.5x larger and the activations larger. The FLOPs are
    the model's, grouped matmuls included (without them a third of the FLOPs would be missing),
    and the same when float32 experts loop instead."""
    reports = {}
    for name, extra in {
        "ep2": ["--mesh", "dp_shard=4,ep=2"],
        "ep4": ["--mesh", "dp_shard=4,ep=4"],
        "ep2 imbalanced": ["--mesh", "dp_shard=4,ep=2", "--target.routing_imbalance", "1.5"],
        "ep2 float32": ["--mesh", "dp_shard=4,ep=2", "--training.mixed_precision_param", "float32"],
    }.items():
        code, text, report = simulate_job(tmp_path / name.replace(" ", "_"), 4, *DEBUG_MOE, *extra)
        assert code == 0 and report["fits"], text
        reports[name] = report
    roles = {name: report["roles"][0] for name, report in reports.items()}
    assert roles["ep4"]["comm_bytes_per_step"]["ep"] == pytest.approx(
        1.5 * roles["ep2"]["comm_bytes_per_step"]["ep"], rel=1e-3
    )
    assert roles["ep2 imbalanced"]["comm_bytes_per_step"]["ep"] == pytest.approx(
        1.5 * roles["ep2"]["comm_bytes_per_step"]["ep"], rel=1e-2
    )
    assert roles["ep2 imbalanced"]["memory_largest"]["activations"] > roles["ep2"]["memory_largest"]["activations"]
    # float32 rows loop over the experts (the grouped kernel takes bfloat16): the same FLOPs.
    assert roles["ep2 float32"]["flops_per_step"] == roles["ep2"]["flops_per_step"]
    imbalanced = reports["ep2 imbalanced"]
    assert imbalanced["target_gpu"]["routing_imbalance"] == 1.5
    assert any("routing_imbalance" in a for a in imbalanced["assumptions"])

    plan = resolve_job(load_config(DEBUG_MOE[:2]), 4)
    tokens = plan.global_batch_size * plan.config.training.seq_len / 4
    prepass = 4 / 3  # the global balancing loss's forward-only counting pass: 2N of the 6N again
    model = model_flops_per_token(plan.model_args, plan.config.training.seq_len) * tokens * prepass
    assert roles["ep2"]["flops_per_step"] == pytest.approx(model, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("imbalance", ["1", "1.5"])
def test_the_estimate_follows_the_simulated_routed_activations(tmp_path, imbalance):
    """Qwen3-30B-A3B's blocks at 4 layers without checkpointing, where the routed tokens'
    activations are most of the memory: estimate and simulation within 15%, balanced or not."""
    args = QWEN3_BLOCKS
    figures = ["--target-gpu", "h100", "--target.routing_imbalance", imbalance]
    code, text, report = simulate_job(tmp_path, 8, *args, *figures)
    assert code == 0, text
    (role,) = report["roles"]
    job = resolve_job(load_config(args), 8, "cuda", {"routing_imbalance": float(imbalance)}, H100)
    assert job.workload.experts is not None and job.workload.experts.imbalance == float(imbalance)
    estimated = estimate(job.workload)
    assert estimated.activations > estimated.model_state / 2  # the routed tokens' share matters here
    assert estimated.total == pytest.approx(role["needed_bytes"], rel=0.15), (estimated.line(), role["memory"])


def test_the_token_exchange_is_timed_over_nvlink_inside_a_node_and_the_network_across():
    target = target_named("h100", {}, 8)
    inside = Collective("all_to_all", "ep", 8, 2**30, crosses_nodes=False)
    across = Collective("all_to_all", "ep", 8, 2**30, crosses_nodes=True)

    times = [step_time(TracedCost(collectives=[c]), target, 1, "1F1B", 1, 1) for c in (inside, across)]
    assert times[0].exposed_comm_s == pytest.approx(7 * target.nvlink_alpha_s + 2**30 / target.nvlink_bytes_per_s)
    assert times[1].exposed_comm_s == pytest.approx(7 * target.network_alpha_s + 2**30 / target.network_bytes_per_s)


def test_an_exchange_waited_for_later_hides_under_what_ran_meanwhile():
    """A collective started and waited for later (expert parallelism's chunked exchanges) is
    exposed only for the seconds the compute in between does not cover, per time it runs."""
    target = target_named("h100", {}, 8)
    alone = Collective("all_to_all", "ep", 8, 2**30, crosses_nodes=False)
    seconds = step_time(TracedCost(collectives=[alone]), target, 1, "1F1B", 1, 1).exposed_comm_s
    half = TracedCost(memory_bytes=round(seconds / 2 * memory_bandwidth(target)))
    twice = TracedCost(memory_bytes=2 * half.memory_bytes)
    for under, times, exposed in ((half, 1, seconds / 2), (twice, 1, 0.0), (half, 4, 2 * seconds)):
        hidden = replace(alone, under=under, times=times)
        time = step_time(TracedCost(collectives=[hidden]), target, 1, "1F1B", 1, 1)
        assert time.exposed_comm_s == pytest.approx(exposed, abs=1e-9)


@pytest.mark.slow
def test_each_tp_and_cp_rank_exchanges_its_own_tokens_over_the_nodes_its_group_spans(tmp_path):
    """Four ranks routing a step's tokens: with dp_shard 4, or 2 x TP 2 (each TP rank routes its
    sequence shard), or 2 x CP 2, every rank sends the same routed rows to its EP peer. An EP
    group of every other rank (stride tp) lies inside a node of 8 and spans two nodes of 4: the
    same bytes, timed over the network."""
    ep_bytes, ep_seconds = {}, {}
    for name, mesh, nproc, nnodes in [
        ("fsdp", "dp_shard=4,ep=2", 4, 1),
        ("tp", "dp_shard=2,tp=2,ep=2", 4, 1),
        ("cp", "dp_shard=2,cp=2,ep=2", 4, 1),
        ("one node", "dp_shard=2,cp=2,tp=2,ep=4", 8, 1),
        ("two nodes", "dp_shard=2,cp=2,tp=2,ep=4", 4, 2),
    ]:
        code, text, report = simulate_job(
            tmp_path / name.replace(" ", "_"), nproc, *DEBUG_MOE, "--mesh", mesh, nnodes=nnodes
        )
        assert code == 0 and report["fits"], text
        (role,) = report["roles"]
        ep_bytes[name], ep_seconds[name] = role["comm_bytes_per_step"]["ep"], role["comm_s"]["ep"]
    assert ep_bytes["tp"] == pytest.approx(ep_bytes["fsdp"], rel=1e-3)
    assert ep_bytes["cp"] == pytest.approx(ep_bytes["fsdp"], rel=1e-3)
    assert ep_bytes["two nodes"] == ep_bytes["one node"]
    # The network's latency is twice NVLink's and its bandwidth a ninth: at least twice the time
    # (these messages are small, so latency rules), where a group inside a node would take the same.
    target = target_named("h100", {}, 8)
    assert target.network_alpha_s == 2 * target.nvlink_alpha_s
    assert ep_seconds["two nodes"] > 1.99 * ep_seconds["one node"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp_shard=4,tp=2,ep=4", "dp_shard=4,cp=2,ep=8", "dp_shard=2,cp=2,tp=2,ep=4"])
def test_the_estimate_follows_the_simulation_under_tp_and_cp(tmp_path, mesh):
    """Under TP the MoE's weights are whole (router and shared experts replicated, experts split
    by EP) and its routed tokens the rank's sequence shard; under CP the rank's chunks; EP may
    take CP's ranks. Qwen3-30B-A3B's blocks at 4 layers without checkpointing: within 15%. With
    CP its backend is named: on a GPU target `auto` is the ring attention, which the simulator (fake
    CPU tensors) cannot run."""
    backend = ["--parallelism.context_parallel_backend", "allgather_kv"] if "cp=" in mesh else []
    args = [*QWEN3_BLOCKS, *backend, "--mesh", mesh]
    code, text, report = simulate_job(tmp_path, 8, *args, "--target-gpu", "h100")
    assert code == 0, text
    (role,) = report["roles"]
    estimated = estimate(resolve_job(load_config(args), 8, "cuda", limit=H100).workload)
    assert estimated.total == pytest.approx(role["needed_bytes"], rel=0.15), (estimated.line(), role["memory"])


@pytest.mark.slow
def test_the_estimate_follows_the_simulation_of_each_pipeline_stage(tmp_path):
    """MoE inside pipeline stages: each stage holds its own blocks' experts, gathered with their
    unsharded gradients for the step (PipelineStage defers FSDP's reshard and reduce), and 1F1B
    keeps ``pp - r`` micro-batches' routed tokens in flight on rank ``r``. Qwen3-30B-A3B at 8
    layers without checkpointing: every pipeline rank's estimate within 15% of its simulation."""
    args = [
        "--config",
        str(CONFIGS / "qwen3_30b_a3b.toml"),
        "--model.n_layers",
        "8",
        "--activation_checkpoint.mode",
        "none",
        "--training.global_batch_size",
        "16",
        "--mesh",
        "pp=2,dp_shard=4,ep=4",
    ]
    code, text, report = simulate_job(tmp_path, 8, *args, "--target-gpu", "h100")
    assert code == 0, text
    estimated = estimates(resolve_job(load_config(args), 8, "cuda", limit=H100).workload)
    assert len(report["roles"]) == len(estimated) == 2
    # The first stage keeps two micro-batches' routed tokens, the last one and the logits.
    assert estimated[0].activations > 2 * estimated[1].activations
    for role, stage in zip(report["roles"], estimated, strict=True):
        assert stage.total == pytest.approx(role["needed_bytes"], rel=0.15), (stage.line(), role["memory"])


@pytest.mark.slow
def test_the_breakdown_adds_up_and_one_fsdp_rank_copies_once_a_step(tmp_path):
    """The debug MoE on one rank, 8 micro-batches, compiled: the rows by module and by op add up
    to the step's bytes, eager and fused; the MoE parts have rows of their own; compile's fusion
    moves fewer bytes than eager. FSDP over one rank keeps the parameters gathered and the
    gradients unsharded through the step (``fsdp_reshard_after_forward = default``): fewer bytes
    than resharding, which gathers (casts and copies) and reduces each micro-batch again."""
    one_rank = [*DEBUG_MOE, "--training.global_batch_size", "32", "--compile.enable"]
    roles = {}
    for name, extra in {"kept": [], "resharded": ["--parallelism.fsdp_reshard_after_forward", "always"]}.items():
        code, text, report = simulate_job(tmp_path / name, 1, *one_rank, *extra)
        assert code == 0, text
        (roles[name],) = report["roles"]
        assert report["compiled"] and report["batch"]["microbatches"] == 8
    role = roles["kept"]
    for key in ("by_module", "by_op"):
        assert sum(r["memory_bytes"] for r in role[key]) == pytest.approx(role["eager_memory_traffic_bytes_per_step"])
        assert sum(r["fused_bytes"] for r in role[key]) == pytest.approx(role["memory_traffic_bytes_per_step"])
    names = [r["name"] for r in role["by_module"]]
    for part in ("router", "dispatch", "experts", "combine"):
        assert any(n.startswith("forward layers.*.feed_forward") and n.endswith(f"/{part}") for n in names), part
    assert role["memory_traffic_bytes_per_step"] < 0.9 * role["eager_memory_traffic_bytes_per_step"]
    # FSDP's fp32 accumulation of each micro-batch's bf16 gradients casts each element, eagerly
    # around the compiled blocks: CUDA's unrolled kernel, timed at its own rate.
    assert sum(r["casting_bytes"] for r in role["by_op"]) == pytest.approx(role["casting_traffic_bytes_per_step"])
    (accumulate,) = [r for r in role["by_op"] if r["name"] == "add_"]
    assert accumulate["casting_bytes"] == pytest.approx(accumulate["fused_bytes"], rel=1e-3)
    # Traced as the compiled job runs it: the combine as the chain compile fuses, not eager's matmul.
    assert not any(r["name"] == "bmm" for r in role["by_op"])
    kept, resharded = (roles[n]["eager_memory_traffic_bytes_per_step"] for n in ("kept", "resharded"))
    assert kept < 0.9 * resharded


@pytest.mark.slow
def test_experts_over_one_fsdp_rank_stay_gathered_through_the_step(tmp_path):
    """ep = dp_shard: each routed expert lives on one rank, so its FSDP unit spans one rank and
    ``fsdp_reshard_after_forward = default`` keeps it gathered and its gradients unsharded for the
    step. Resharding it (``always``) copies the experts in and out and casts them in every
    micro-batch's forward and backward again; kept, they are copied once a step (fewer than half
    the bytes of ``copy_``), and the gathered experts are in the peak. Either way their reduction
    over one rank is a copy that divides by nothing, while the blocks' (over two ranks) sum."""
    layout = ["--mesh", "dp_shard=2,ep=2", "--training.local_batch_size", "1", "--training.global_batch_size", "16"]
    job = [*DEBUG_MOE, *layout]
    roles = {}
    for name in ("default", "always"):
        code, text, report = simulate_job(tmp_path / name, 2, *job, "--parallelism.fsdp_reshard_after_forward", name)
        assert code == 0, text
        (roles[name],) = report["roles"]
        assert report["batch"]["microbatches"] == 8

    def moved(role: dict, op: str) -> float:
        return sum(r["memory_bytes"] for r in role["by_op"] if r["name"] == op)

    kept, resharded = roles["default"], roles["always"]
    assert any(r["name"] == "bmm" and r["flops"] > 0 for r in kept["by_op"])  # eager's combine
    assert moved(kept, "copy_") < 0.5 * moved(resharded, "copy_")
    # A divide factor of 1 on the one-rank unit would divide its gradients in each reduction.
    assert moved(resharded, "div") == pytest.approx(moved(kept, "div"))
    assert kept["eager_memory_traffic_bytes_per_step"] < 0.95 * resharded["eager_memory_traffic_bytes_per_step"]
    assert kept["memory"]["unsharded_params"] > 2 * resharded["memory"]["unsharded_params"]
    plan = resolve_job(load_config([*DEBUG_MOE[:2], *layout]), 2)
    assert plan.parallel.experts_stay_gathered and plan.workload.experts_stay_gathered


@pytest.mark.slow
def test_held_forwards_in_host_memory_leave_two_micro_batches_on_the_gpu(tmp_path):
    """Exact balancing's held forwards in host memory (``moe.held_forwards = host``) against held
    on the GPU, Qwen3-30B-A3B's blocks as the preset runs them (full checkpointing, ep 8, 4
    micro-batches a rank): the peak keeps two micro-batches' block inputs, not four; the copies
    are each block's input and the loss's two gradients (hidden states and output weight) of
    every micro-batch, out and back, nothing more (no chunk's logits); they are timed on the host
    link beside the compute; the estimate follows the simulated peak."""
    job = [*QWEN3_BLOCKS[:3], "1", "--training.global_batch_size", "32"]
    roles, plans = {}, {}
    for where in ("device", "host"):
        args = [*job, "--moe.held_forwards", where]
        code, text, report = simulate_job(tmp_path / where, 8, *args, "--target-gpu", "h100")
        assert code == 0, text
        (roles[where],) = report["roles"]
        plans[where] = resolve_job(load_config(args), 8, device="cuda", figures={}, limit=H100).workload
    w = plans["host"]
    assert w.offloads_forwards and not plans["device"].offloads_forwards and w.accumulation == 4
    token_row = w.seq_len * w.dim * w.compute_bytes
    per_microbatch = (w.n_layers + 1) * token_row + w.vocab_size * w.dim * w.compute_bytes
    host, device = roles["host"], roles["device"]
    # Beside those, the final norm's saved input (float32 too: the composite norm's) and RoPE's table.
    norm = 6 * token_row
    assert (
        2 * w.accumulation * per_microbatch
        <= host["host_bytes_per_step"]
        <= 2 * w.accumulation * (per_microbatch + norm)
    )
    assert device["host_bytes_per_step"] == 0 and "host" not in device["comm_s"]
    target = target_named("h100", {}, 8)
    assert host["comm_s"]["host"] == pytest.approx(host["host_bytes_per_step"] / target.host_rate)
    held_on_gpu = (w.accumulation - 2) * per_microbatch
    assert device["memory"]["activations"] - host["memory"]["activations"] >= 0.9 * held_on_gpu
    assert host["peak_bytes"] < device["peak_bytes"]
    for where, role in roles.items():
        assert estimate(plans[where]).total == pytest.approx(role["needed_bytes"], rel=0.15), where
