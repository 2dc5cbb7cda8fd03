"""The simulator's tokens/s against the device check's throughput rows, before and after the
calibration (``trainer/simulation/calibrations/``).

The rows are the second device check's (2026-11-27, one NVIDIA H200, torch 2.11.0+cu130; the
table is in docs/performance.md), whose probes are the stored H200 calibration. Each row's job
is simulated once for ``--target-gpu h200`` with the settings it ran with, and timed twice from
the same trace: with the constants (``efficiency`` 0.5, ``hbm_efficiency`` 0.7) and compile not
modelled ("before"), and with the stored H200 calibration and compile's fusion ("after"). The
calibration comes from kernel probes only; these rows are its test. The exact-scope MoE rows
are left out: their loss has changed since they ran (it computes its gradients in the forward).
Prints one table; about 8 minutes on 2 free cores at the rows' full depth.

    python benchmarks/simulator_calibration.py             # every row, at the depth it ran
    python benchmarks/simulator_calibration.py --layers 2  # traced at 1 and 2 blocks, extended

``--layers N`` traces each job at N - 1 and N blocks and extends the cost to the row's depth: the
blocks are alike, so a step's FLOPs and bytes are exactly linear in their count.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts" / "gpu")]

from jobs import Job  # noqa: E402

from trainer.entry.simulate import simulate_roles  # noqa: E402
from trainer.simulation.cost_model import TracedCost  # noqa: E402
from trainer.simulation.step_time import step_time  # noqa: E402
from trainer.simulation.targets import resolve_target  # noqa: E402

RAN_WITH = ["--training.mixed_precision_param", "bfloat16", "--training.seq_len", "8192", "--training.steps", "8"]
"""What every row shared: 8 steps of 8,192 tokens in bfloat16."""
EAGER = ["--activation_checkpoint.mode", "none"]
COMPILED = ["--compile.enable", "--activation_checkpoint.mode", "selective"]
MOE = [
    "--config", "qwen3_30b_a3b.toml", "--parallelism.expert_parallel_degree", "1", "--model.n_layers", "8",
    *RAN_WITH, "--training.local_batch_size", "1", "--training.global_batch_size", "8",
    "--activation_checkpoint.mode", "full", "--moe.balance_loss_weight", "0.001",
    "--moe.balance_loss_scope", "micro_batch",
]  # fmt: skip
"""The preset's shape at the 8 blocks the H200 holds, with the preset's per-GPU work (8
micro-batches of one sequence, full AC) and every expert local."""
ONE_B = ["--config", "llama3_1b.toml", *RAN_WITH]
EIGHT_B = ["--config", "llama3_8b.toml", "--model.n_layers", "8", *RAN_WITH]
FLOAT8 = ["--model.converters", "float8", "--float8.recipe_name"]
MEASURED = [
    (Job("30B-A3B x 8 layers", MOE, "eager, full AC, 8 micro-batches, micro_batch scope"), 39_336),
    (Job("30B-A3B x 8 layers", [*MOE, "--compile.enable"], "compiled, full AC, 8 micro-batches, micro_batch scope"), 41_607),
    (Job("1B", [*ONE_B, *EAGER], "eager, no AC"), 44_163),
    (Job("8B x 8 layers", [*EIGHT_B, *EAGER, "--training.loss_chunk_tokens", "1024"], "eager, no AC, chunked loss"), 28_048),
    (Job("1B", [*ONE_B, *COMPILED], "compiled + selective AC"), 47_593),
    (Job("8B x 8 layers", [*EIGHT_B, *COMPILED], "compiled + selective AC"), 32_175),
    (Job("8B x 8 layers", [*EIGHT_B, *COMPILED, *FLOAT8, "rowwise"], "compiled + selective AC, float8 rowwise"), 33_100),
    (Job("8B x 8 layers", [*EIGHT_B, *COMPILED, *FLOAT8, "tensorwise"], "compiled + selective AC, float8 tensorwise"), 38_329),
]  # fmt: skip
"""The check's throughput rows as they ran on the H200, each with its own settings, and the
tokens/s each measured (the float8 rows and their bf16 baseline in two later calls on the same
machine, warm)."""


@dataclass
class Prediction:
    job: str
    note: str
    measured: float
    before: float
    after: float
    compiled: bool


def check_jobs() -> list[tuple[Job, float]]:
    """The measured rows, each job with its tokens/s."""
    return list(MEASURED)


def traced(args: list[str], dump: Path) -> tuple[TracedCost, int]:
    """The job's step cost on one H200 and its tokens per step."""
    target = resolve_target("h200", {}, 1)
    with contextlib.redirect_stderr(io.StringIO()):
        plan, runs = simulate_roles([*args, "--job.dump_folder", str(dump)], 1, 1, target)
    return runs[0].cost, plan.global_batch_size * plan.config.training.seq_len


def extended(low: TracedCost, high: TracedCost, times: int) -> TracedCost:
    """``high`` plus ``times`` more blocks of what ``high`` adds over ``low`` (one block); the
    breakdowns by op and module are left out (the step's time does not read them)."""
    grown: dict[str, Any] = {}
    for f in fields(TracedCost):
        a, b = getattr(low, f.name), getattr(high, f.name)
        if isinstance(b, dict) and all(isinstance(v, int | float) for v in b.values()):
            grown[f.name] = {k: b.get(k, 0) + times * (b.get(k, 0) - a.get(k, 0)) for k in {*a, *b}}
        elif isinstance(b, int):
            grown[f.name] = b + times * (b - a)
    return TracedCost(**grown)


def layers_of(args: list[str]) -> int:
    from trainer.config import load_config

    return load_config(args).model.n_layers


def predict(jobs: list[tuple[Job, float]], layers: int | None, dump: Path) -> list[Prediction]:
    """Each job's tokens/s with the constants and with the H200's calibration, from one trace
    per distinct job (a compiled job traces eagerly the ops its compiled blocks run, such as the
    MoE combine compile fuses: ``MoE.fused_combine``)."""
    calibrated = resolve_target("h200", {}, 1)
    plain = replace(calibrated, calibration=None, calibration_file="")
    costs: dict[tuple[str, ...], tuple[TracedCost, int]] = {}
    predictions = []
    for job, measured in jobs:
        compiled = "--compile.enable" in job.args
        args = job.args
        if tuple(args) not in costs:
            depth = layers_of(args)
            if layers is None or layers >= depth:
                costs[tuple(args)] = traced(args, dump)
            else:
                (low, tokens), (high, _) = (
                    traced([*args, "--model.n_layers", str(n)], dump) for n in (layers - 1, layers)
                )
                costs[tuple(args)] = (extended(low, high, depth - layers), tokens)
        cost, tokens = costs[tuple(args)]
        # "before" is the simulator as it was: the constants, and compile not modelled
        before = tokens / step_time(cost, plain, 1, "1F1B", 1, 1).step_s
        after = tokens / step_time(cost, calibrated, 1, "1F1B", 1, 1, compiled).step_s
        predictions.append(Prediction(job.name, job.note, measured, before, after, compiled))
    return predictions


def table(predictions: list[Prediction]) -> str:
    lines = [
        "| job | setting | measured tokens/s | before: predicted (ratio) | after: predicted (ratio) |",
        "|---|---|---|---|---|",
    ]
    for p in predictions:
        lines.append(
            f"| {p.job} | {p.note} | {p.measured:,.0f} | {p.before:,.0f} ({p.before / p.measured:.2f}) | "
            f"{p.after:,.0f} ({p.after / p.measured:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="trace at this many blocks and one fewer, extended")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        print(table(predict(check_jobs(), args.layers, Path(dump))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
