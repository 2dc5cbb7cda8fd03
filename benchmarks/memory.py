"""The per-rank memory estimate against the measured peak, on CPU, for several configurations.

Each configuration trains two steps of two micro-batches through ``./run_train.sh`` (where
activations outweigh the runtime, and the peak has settled) and reads rank 0's peak resident
memory from its last log line; the estimate is what ``--dry-run`` prints for the same command.
Prints one JSON line per configuration, with the ratio.

    python benchmarks/memory.py            # or only some: python benchmarks/memory.py MoE
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.planning.job_plan import resolve_job  # noqa: E402

COMMON = [
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard=false",
    "--metrics.disable_color_printing",
]
MOE = ["--config", "debug_moe.toml", "--validation.enable=false"]
CONFIGS = {
    "1 rank, seq 1024": (1, ["--training.seq_len", "1024"]),
    "1 rank, seq 1024, AC full": (1, ["--training.seq_len", "1024", "--activation_checkpoint.mode", "full"]),
    "1 rank, seq 1024, AC per op": (1, ["--training.seq_len", "1024", "--activation_checkpoint.mode", "selective"]),
    "1 rank, seq 2048": (1, ["--training.seq_len", "2048"]),
    "FSDP 2, seq 1024": (2, ["--training.seq_len", "1024", "--training.global_batch_size", "16"]),
    "TP 2, seq 1024": (2, ["--training.seq_len", "1024", "--mesh", "tp=2"]),
    "CP 2, seq 1024": (2, ["--training.seq_len", "1024", "--mesh", "cp=2"]),
    "debug MoE, FSDP 2 x EP 2, seq 1024": (
        2,
        [*MOE, "--training.seq_len", "1024", "--training.global_batch_size", "16", "--mesh", "dp_shard=2,ep=2"],
    ),
    "debug MoE, CP 2 x EP 2, seq 1024": (2, [*MOE, "--training.seq_len", "1024", "--mesh", "cp=2,ep=2"]),
    "debug MoE, FSDP 2 x TP 2 x EP 2, seq 1024": (
        4,
        [*MOE, "--training.seq_len", "1024", "--training.global_batch_size", "16", "--mesh", "dp_shard=2,tp=2,ep=2"],
    ),
}


def measure(ngpu: int, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as dump:
        proc = subprocess.run(
            [str(REPO_ROOT / "run_train.sh"), *args, "--job.dump_folder", dump],
            env={**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": str(max(1, 2 // ngpu))},
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return float(re.findall(r"step: 2/2 .*?memory: ([0-9.]+)GiB", proc.stdout + proc.stderr)[-1])


def main() -> None:
    """Every configuration, or those whose names contain one of the arguments."""
    for name, (ngpu, extra) in CONFIGS.items():
        if sys.argv[1:] and not any(word in name for word in sys.argv[1:]):
            continue
        args = COMMON + extra
        estimate = resolve_job(load_config(args), ngpu).memory
        measured = measure(ngpu, args)
        print(
            json.dumps(
                {
                    "config": name,
                    "estimate_gib": round(estimate.total / 1024**3, 2),
                    "measured_gib": measured,
                    "estimate_over_measured": round(estimate.total / 1024**3 / measured, 2),
                    "activations_gib": round(estimate.activations / 1024**3, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
