"""The simulator's tokens/s against the device check's throughput rows, before and after the
calibration (``trainer/simulation/calibrations/``).

The rows are the first device check's (2026-11-27, one NVIDIA H200, torch 2.11.0+cu130; the
table is in docs/performance.md). Each job of the check's list (``scripts/gpu/jobs.py``) is
simulated once for ``--target-gpu h200`` as it ran then (the loss chunked in 1,024 tokens, the
default of that day, where the row did not set it), and timed twice from the same trace: with
the constants (``efficiency`` 0.5, ``hbm_efficiency`` 0.7) and compile not modelled, as the
check's own simulator rows were ("before"), and with the stored H200 calibration and compile's
fusion ("after"). The calibration comes from kernel probes only; these rows are its
test. Prints one table; about 6 minutes on 2 free cores at the rows' full depth.

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

from jobs import Job, Shape, throughput_jobs  # noqa: E402

from trainer.entry.simulate import simulate_roles  # noqa: E402
from trainer.hardware import GPUS  # noqa: E402
from trainer.simulation.cost_model import TracedCost, step_time  # noqa: E402
from trainer.simulation.targets import resolve_target  # noqa: E402

MEASURED = {
    ("30B-A3B x 8 layers", "eager"): 22_750,
    ("30B-A3B x 8 layers", "compiled"): 25_118,
    ("1B", "eager"): 39_007,
    ("8B x 8 layers", "eager, no AC, chunked loss"): 26_795,
    ("1B", "compiled"): 42_866,
    ("8B x 8 layers", "compiled"): 28_474,
    ("8B x 8 layers", "eager, no AC, unchunked loss"): 29_419,
}
"""Tokens/s of the check's throughput rows on the H200, by job name and the start of its note."""
CHUNKED_THEN = ["--training.loss_chunk_tokens", "1024"]
"""The default of 2026-11-27, which the rows that did not set the chunking ran with."""


@dataclass
class Prediction:
    job: str
    note: str
    measured: float
    before: float
    after: float
    compiled: bool


def measured_of(job: Job) -> float | None:
    found = (v for (name, note), v in MEASURED.items() if job.name == name and job.note.startswith(note))
    return next(found, None)


def check_jobs() -> list[Job]:
    """The check's jobs that have a recorded row, as they ran on the H200 (its memory decides the
    block counts)."""
    listed = throughput_jobs(Shape(), GPUS["h200"].memory_bytes)
    return [
        replace(job, args=[*job.args, *([] if "--training.loss_chunk_tokens" in job.args else CHUNKED_THEN)])
        for job in listed
        if measured_of(job) is not None
    ]


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


def predict(jobs: list[Job], layers: int | None, dump: Path) -> list[Prediction]:
    """Each job's tokens/s with the constants and with the H200's calibration, from one trace
    per distinct job (a compiled job traces as its eager twin: the simulation does not compile)."""
    calibrated = resolve_target("h200", {}, 1)
    plain = replace(calibrated, calibration=None, calibration_file="")
    costs: dict[tuple[str, ...], tuple[TracedCost, int]] = {}
    predictions = []
    for job in jobs:
        compiled = "--compile.enable" in job.args
        args = [a for a in job.args if a != "--compile.enable"]
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
        predictions.append(Prediction(job.name, job.note, measured_of(job) or 0.0, before, after, compiled))
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
