"""What ``--simulate`` tells the user: a table per rank role and ``simulation.json``.

The JSON keys ``world_size``, ``mesh``, ``target_gpu``, ``fits`` and ``roles`` (each with
``pp_stage``, ``ranks``, ``peak_bytes``, ``memory``, ``flops_per_step``, ``comm_bytes_per_step``,
``step_time_s``, ``tokens_per_s_per_gpu``, ``mfu``) are a contract (``tests/test_simulation.py``);
the rest may grow.

A role fits when its peak live tensors, plus the allocator's slack on the activations and the
runtime the target holds whatever the model, are within the target's memory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from trainer.hardware import gib
from trainer.metrics import model_flops_per_token
from trainer.planning.job_plan import JobPlan
from trainer.planning.loss_chunking import LossChunking
from trainer.planning.memory_fixes import what_would_fit
from trainer.planning.memory_plan import estimates
from trainer.simulation.cost_model import Cost, TracedCost
from trainer.simulation.fake_job import RoleRun
from trainer.simulation.memory_tracker import CATEGORIES
from trainer.simulation.step_time import ASSUMPTIONS, compute_s, memory_s, step_time, traffic
from trainer.simulation.targets import Target

TOP_ROWS = 8
"""Rows of each breakdown printed (``simulation.json`` holds them all)."""


def breakdown(
    costs: dict[str, Cost], whole: TracedCost, target: Target, compiled: bool, tokens: float
) -> list[dict[str, Any]]:
    """Rows by time on ``target``, largest first: FLOPs at the step's compute rate (``whole``'s
    FLOPs over its seconds at the calibrated rate of each kernel kind; a row's own kinds are not
    kept), bytes (eager and fused by compile) at the memory rates (``step_time.memory_s``), the
    bytes also per token of the rank."""
    compute = sum(compute_s(whole, target).values())
    rate = whole.flops / compute if compute else target.bf16_flops * target.efficiency
    rows = []
    for name, cost in costs.items():
        moved, casting = traffic(cost, compiled)
        seconds = cost.flops / rate + memory_s(cost, target, compiled)
        rows.append(
            {
                "name": name,
                "time_s": seconds,
                "flops": cost.flops,
                "memory_bytes": cost.memory_bytes,
                "fused_bytes": cost.fused_bytes,
                "casting_bytes": casting,
                "bytes_per_token": moved / tokens,
            }
        )
    return sorted(rows, key=lambda r: -r["time_s"])


def build_report(plan: JobPlan, target: Target, runs: list[RoleRun], compiled: bool = False) -> dict[str, Any]:
    """The JSON document (see the module docstring); ``compiled``: the job compiles its blocks,
    whose elementwise chains move fewer bytes (``fusion.Fusion``)."""
    dims, training = plan.dims, plan.config.training
    tokens = plan.global_batch_size * training.seq_len
    per_token = model_flops_per_token(plan.model_args, training.seq_len)
    roles: list[dict[str, Any]] = []
    for run in runs:
        time = step_time(
            run.cost,
            target,
            dims.pp,
            plan.parallel.pp_schedule,
            len(run.stages),
            plan.pipeline_microbatches if dims.pp > 1 else 1,
            compiled=compiled,
        )
        rank_tokens = tokens / (dims.world_size // dims.pp)
        moved, casting = traffic(run.cost, compiled)
        at_peak = run.memory.at_peak
        needed = int(run.memory.peak_bytes + target.allocator_slack * at_peak["activations"] + target.runtime_bytes)
        seconds = time.step_s
        roles.append(
            {
                "pp_stage": run.pp_rank,
                "stages": run.stages,
                "simulated_rank": run.rank,
                "ranks": dims.world_size // dims.pp,
                "peak_bytes": run.memory.peak_bytes,
                "peak_step": run.memory.peak_step,
                "peak_phase": run.memory.peak_phase,
                "needed_bytes": needed,
                "fits": needed <= target.memory_bytes,
                "memory": dict(at_peak),
                "memory_largest": dict(run.memory.largest),
                "phases": [asdict(p) for p in run.memory.phases],
                "flops_per_step": run.cost.flops,
                "memory_traffic_bytes_per_step": moved,
                "memory_traffic_bytes_per_token": moved / rank_tokens,
                "eager_memory_traffic_bytes_per_step": run.cost.memory_bytes,
                "casting_traffic_bytes_per_step": casting,
                "by_module": breakdown(run.cost.by_module, run.cost, target, compiled, rank_tokens),
                "by_op": breakdown(run.cost.by_op, run.cost, target, compiled, rank_tokens),
                "comm_bytes_per_step": run.cost.comm_bytes(),
                "host_bytes_per_step": run.cost.host_bytes,
                "comm_s": time.comm_s,
                "compute_s": time.compute_s,
                "compute_s_by_kind": compute_s(run.cost, target),
                "flops_by_kind": run.cost.flops_by_kind,
                "memory_bound_s": time.memory_s,
                "exposed_comm_s": time.exposed_comm_s,
                "bubble": time.bubble,
                "step_time_s": seconds,
                "tokens_per_s_per_gpu": tokens / seconds / dims.world_size,
                "mfu": per_token * tokens / dims.world_size / seconds / target.bf16_flops,
                "hfu": run.cost.flops / seconds / target.bf16_flops,
                "traced_microbatches": run.traced_microbatches,
                "simulated_in_s": run.seconds,
            }
        )
    step_s = max(r["step_time_s"] for r in roles)
    return {
        "world_size": dims.world_size,
        "mesh": {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
            **({"ep": dims.ep} if dims.ep > 1 else {}),
        },
        "target_gpu": target.to_json(),
        "calibration": target.calibration_line(),
        "compile": "modelled: fused elementwise bytes" if compiled else "off",
        "fits": all(r["fits"] for r in roles),
        "model": {"flavor": plan.config.model.flavor, "params": plan.workload.params},
        "batch": {
            "global_batch_size": plan.global_batch_size,
            "seq_len": training.seq_len,
            "tokens_per_step": tokens,
            "microbatches": plan.microbatches,
            "pipeline_microbatches": plan.pipeline_microbatches if dims.pp > 1 else None,
            "param_dtype": str(plan.parallel.param_dtype).removeprefix("torch."),
        },
        "loss_chunking": {"tokens": plan.loss_chunking.tokens, "why": plan.loss_chunking.why},
        "compiled": compiled,
        "step_time_s": step_s,
        "tokens_per_s_per_gpu": tokens / step_s / dims.world_size,
        "mfu": per_token * tokens / dims.world_size / step_s / target.bf16_flops,
        "assumptions": list(ASSUMPTIONS),
        "roles": roles,
    }


def fit_advice(plan: JobPlan, target: Target, report: dict[str, Any]) -> str:
    """Which role does not fit and what would (the pre-launch estimate's own suggestions)."""
    over = [r for r in report["roles"] if not r["fits"]]
    worst = max(over, key=lambda r: r["needed_bytes"])
    workload = replace(
        plan.workload if target.name == "cpu" else replace(plan.workload, device="cuda"),
        runtime_bytes=target.runtime_bytes,
        allocator_slack=target.allocator_slack,
    )
    # The estimate proposes the changes; where it thinks this very job smaller than the simulation
    # measured, its limit shrinks by that ratio, so that it cannot propose the job just simulated.
    by_pp_rank = {e.pp_rank: e.total for e in estimates(workload)}
    estimated = by_pp_rank.get(worst["pp_stage"], max(by_pp_rank.values()))
    limit = int(target.memory_bytes * min(1.0, estimated / worst["needed_bytes"]))
    advice = what_would_fit(workload, limit, plan.dims.world_size, machines="GPUs")
    return (
        f"does not fit: pipeline stage {worst['pp_stage']} ({worst['ranks']} ranks) needs {gib(worst['needed_bytes'])}, "
        f"more than the {target.name}'s {gib(target.memory_bytes)}; by the pre-launch estimate, {advice}. "
        "Simulate again to confirm."
    )


def render(report: dict[str, Any]) -> str:
    """The table printed per role, then every assumption."""
    mesh, target = report["mesh"], report["target_gpu"]
    lines = [
        f"simulated {report['model']['flavor']} on {report['world_size']} ranks: mesh "
        + " ".join(f"{k}={v}" for k, v in mesh.items())
        + f"; target {target['name']} ({gib(target['memory_bytes'])}, "
        f"{target['bf16_flops'] / 1e12:.3g} TFLOP/s bf16, {target['hbm_bytes_per_s'] / 1e12:.3g} TB/s)",
    ]
    lines.append(report["calibration"])
    if report["compile"] != "off":
        lines.append(f"compile: {report['compile']} (the trace itself runs eager)")
    lines.append(f"loss: {LossChunking(**report['loss_chunking']).line()}")
    for role in report["roles"]:
        memory = role["memory"]
        parts = " + ".join(f"{gib(memory[c])} {c}" for c in CATEGORIES if memory.get(c))
        headroom = 1 - role["needed_bytes"] / target["memory_bytes"]
        comm = ", ".join(f"{dim} {gib(b)}" for dim, b in role["comm_bytes_per_step"].items()) or "none"
        if role["host_bytes_per_step"]:
            comm += f"; to and from host memory {gib(role['host_bytes_per_step'])} (held forwards)"
        lines += [
            f"pipeline stage {role['pp_stage']} (stages {role['stages']}, {role['ranks']} ranks; "
            f"rank {role['simulated_rank']} simulated in {role['simulated_in_s']:.1f} s)",
            f"  peak {gib(role['peak_bytes'])} in step {role['peak_step']} {role['peak_phase']} = {parts}",
            f"  needed with runtime and allocator slack: {gib(role['needed_bytes'])} -> "
            + (f"fits ({headroom:.0%} headroom)" if role["fits"] else "DOES NOT FIT"),
            "  largest: "
            + ", ".join(
                f"{c} {gib(role['memory_largest'][c])}" for c in ("params", "grads", "optimizer", "activations")
            ),
            f"  per step: {role['flops_per_step']:.3g} FLOPs, {gib(role['memory_traffic_bytes_per_step'])} "
            f"memory traffic ({role['memory_traffic_bytes_per_token'] / 1e6:.1f} MB per token"
            + (", compile's fusion modelled" if report["compiled"] else ", eager")
            + f"; {gib(role['casting_traffic_bytes_per_step'])} in eager kernels that cast each element"
            + f"); communication {comm}",
            f"  time: compute {role['compute_s']:.3f} s + memory-bound {role['memory_bound_s']:.3f} s + exposed "
            f"communication {role['exposed_comm_s']:.3f} s, bubble {role['bubble']:.0%} -> step "
            f"{role['step_time_s']:.3f} s, {role['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
            f"{role['mfu']:.0%} (HFU {role['hfu']:.0%})",
        ]
        for key, title in (("by_module", "phase module/MoE part"), ("by_op", "op")):
            lines.append(f"  top {TOP_ROWS} by {title}: time s, TFLOP, GB moved, MB per token")
            lines += [
                f"    {r['name']:<48} {r['time_s']:7.3f} {r['flops'] / 1e12:8.1f} "
                f"{(r['fused_bytes'] if report['compiled'] else r['memory_bytes']) / 1e9:8.1f} "
                f"{r['bytes_per_token'] / 1e6:7.2f}"
                for r in role[key][:TOP_ROWS]
            ]
    lines.append(
        f"job: step {report['step_time_s']:.3f} s, {report['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
        f"MFU {report['mfu']:.0%}; " + ("every role fits" if report["fits"] else "a role does not fit")
    )
    lines.append(
        f"assumptions (target figures overridable with --target.KEY; efficiency {target['efficiency']}, "
        f"HBM efficiency {target['hbm_efficiency']}, runtime {gib(target['runtime_bytes'])}, allocator slack "
        f"{target['allocator_slack']:.0%} of the activations, routing imbalance {target['routing_imbalance']:g}):"
    )
    lines += [f"  - {a}" for a in report["assumptions"]]
    return "\n".join(lines)


def write(report: dict[str, Any], dump_folder: str) -> Path:
    path = Path(dump_folder) / "simulation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
