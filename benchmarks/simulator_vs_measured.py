"""The memory predictions against measured runs on this CPU: the pre-launch estimate
(``trainer/planning/memory_plan.py``) and, where ``trainer/simulation`` exists, the simulator's
peak for ``--target-gpu cpu``.

Each case trains two steps of two micro-batches of the debug model through ``./run_train.sh``
(FSDP, TP, CP, PP, activation checkpointing; 1, 2 and 4 processes) and reads every logged rank's
peak resident memory (``VmHWM``) from its last step line. What is compared is the growth
over a tiny baseline of the same process count (one step of 32 tokens): the process's own
memory (torch, gloo, the loader) is then out of both sides, and what remains is the model
state, the activations and the allocator's slack that the predictions claim to know. Prints one
table of growths and ratios (predicted / measured); runs in about 4 minutes on 2 free cores.

    python benchmarks/simulator_vs_measured.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.hardware import GIB  # noqa: E402
from trainer.planning.job_plan import resolve_job  # noqa: E402

COMMON = [
    "--training.local_batch_size",
    "4",
    "--training.steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard=false",
    "--metrics.disable_color_printing",
    "--validation.enable=false",
]
SEQ = ["--training.seq_len", "1024"]
CASES: dict[str, tuple[int, list[str]]] = {
    "PP 2 (1F1B, 4 micro-batches of 2)": (
        2,
        [
            *SEQ,
            "--training.global_batch_size",
            "8",
            "--mesh",
            "pp=2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ),
    "1 rank, no AC": (1, [*SEQ, "--training.global_batch_size", "8"]),
    "1 rank, AC full": (1, [*SEQ, "--training.global_batch_size", "8", "--activation_checkpoint.mode", "full"]),
    "1 rank, AC op, seq 2048": (
        1,
        [
            "--training.seq_len",
            "2048",
            "--training.global_batch_size",
            "8",
            "--activation_checkpoint.mode",
            "selective",
        ],
    ),
    "FSDP 2": (2, [*SEQ, "--training.global_batch_size", "16"]),
    "TP 2": (2, [*SEQ, "--training.global_batch_size", "8", "--mesh", "tp=2"]),
    "CP 2": (2, [*SEQ, "--training.global_batch_size", "8", "--mesh", "cp=2"]),
    "PP 2 x FSDP 2, AC full": (
        4,
        [
            *SEQ,
            "--training.global_batch_size",
            "16",
            "--mesh",
            "pp=2,dp_shard=2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
}
BASELINE = ["--training.seq_len", "32", "--training.local_batch_size", "1", "--training.global_batch_size", "-1"]
"""A tiny job of the same process count: one step of one 32-token sample per rank."""


def measure(nproc: int, args: list[str]) -> float:
    """The largest peak resident memory any rank logs for its last step, in bytes."""
    with tempfile.TemporaryDirectory() as dump:
        proc = subprocess.run(
            [str(REPO_ROOT / "run_train.sh"), *args, "--job.dump_folder", dump],
            env={
                **os.environ,
                "NGPU": str(nproc),
                "LOG_RANK": ",".join(map(str, range(nproc))),
                "OMP_NUM_THREADS": str(max(1, 2 // nproc)),
            },
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    steps = re.findall(r"step: (\d+)/(\d+) .*?memory: ([0-9.]+)GiB", proc.stdout + proc.stderr)
    return max(float(gib) for step, total, gib in steps if step == total) * GIB


def simulated(nproc: int, args: list[str]) -> float | None:
    """The simulator's need on this machine (peak, allocator slack and runtime) for the largest
    role, or None where ``trainer/simulation`` is absent or fails."""
    try:
        import trainer.entry.simulate  # noqa: F401
    except ImportError:
        return None
    code = (
        "import sys; from trainer.entry.simulate import simulate; sys.exit(simulate(sys.argv[2:], int(sys.argv[1]), 1))"
    )
    with tempfile.TemporaryDirectory() as dump:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(nproc), *args, "--job.dump_folder", dump, "--target-gpu", "cpu"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
        report = Path(dump) / "simulation.json"
        if not report.exists():
            print(f"simulator failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        return max(role["needed_bytes"] for role in json.loads(report.read_text())["roles"])


def estimated(nproc: int, args: list[str]) -> float:
    return resolve_job(load_config(args), nproc).memory.total


def ratio(predicted: float | None, measured: float) -> str:
    return f"{predicted / GIB:6.2f} ({predicted / measured:4.2f})" if predicted is not None else "   n/a"


def main() -> None:
    start = time.monotonic()
    baselines: dict[int, tuple[float, float, float | None]] = {}
    print(
        f"{'case':36} {'ranks':>5} {'measured GiB':>12} {'estimate (ratio)':>17} {'simulator (ratio)':>18}", flush=True
    )
    for name, (nproc, extra) in CASES.items():
        if nproc not in baselines:
            tiny = [*COMMON, *BASELINE]
            baselines[nproc] = (measure(nproc, tiny), estimated(nproc, tiny), simulated(nproc, tiny))
        base_measured, base_estimated, base_simulated = baselines[nproc]
        args = [*COMMON, *extra]
        measured = measure(nproc, args) - base_measured
        estimate = estimated(nproc, args) - base_estimated
        sim = simulated(nproc, args)
        sim_growth = sim - base_simulated if sim is not None and base_simulated is not None else None
        print(
            f"{name:36} {nproc:>5} {measured / GIB:12.2f} {ratio(estimate, measured):>17} {ratio(sim_growth, measured):>18}",
            flush=True,
        )
    print(
        "growth of the largest rank's peak RSS over a tiny job of the same process count; "
        f"baselines (measured): {', '.join(f'{n} rank(s) {b[0] / GIB:.2f} GiB' for n, b in baselines.items())}; "
        f"{time.monotonic() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
