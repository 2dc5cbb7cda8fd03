"""Muon against AdamW, side by side in one run: what Muon costs and whether it learns.

Prints (1) the median step time of the debug dense and MoE models on ``--nproc`` processes with
each optimizer, the runs alternating over ``--rounds`` rounds (``benchmarks/throughput.py``);
(2) the debug model's loss after ``--steps`` steps on one process with each, at the same
``optimizer.lr``; (3) ``--simulate`` of the Llama 3 8B preset on its 8 H100s with each, at the
preset's batch and at a global batch of 64 sequences (gradient accumulation of 8), with the
simulated optimizer phase. Absolute CPU times mean little; compare the columns.

    python benchmarks/muon.py [--rounds 3] [--steps 60] [--nproc 4] [--skip-simulation]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("AdamW", "Muon")


def step_time(config: str, optimizer: str, nproc: int) -> float:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += [str(ROOT / "benchmarks" / "throughput.py"), "--config", config, "--steps", "8", "--warmup", "2"]
    command += ["--", "--optimizer.name", optimizer, "--validation.enable=false"]
    out = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith("{"))
    return float(json.loads(line)["step_time_median_s"])


def final_loss(optimizer: str, steps: int) -> float:
    command = [str(ROOT / "run_train.sh"), "--training.steps", str(steps), "--optimizer.name", optimizer]
    command += ["--metrics.enable_tensorboard=false", "--validation.enable=false", "--job.dump_folder"]
    command += [f"/tmp/meshtrain-muon-benchmark-{optimizer}"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, "NGPU": "1"})
    found = re.search(r"final loss ([\d.]+)", out.stdout + out.stderr)
    assert found, (out.stdout + out.stderr)[-2000:]
    return float(found.group(1))


def simulated(optimizer: str, extra: list[str]) -> tuple[float, float]:
    """The simulated step time and the optimizer phase's time, in seconds."""
    command = [str(ROOT / "run_train.sh"), "--config", "llama3_8b.toml", "--simulate", "--optimizer.name", optimizer]
    out = subprocess.run(command + extra, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    step = float(re.search(r"^job: step ([\d.]+) s", text, re.M).group(1))  # type: ignore[union-attr]
    phase = re.search(r"^\s+optimizer -\s+([\d.]+)", text, re.M)
    return step, float(phase.group(1)) if phase else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--skip-simulation", action="store_true")
    args = parser.parse_args()
    for config in ("debug_model.toml", "debug_moe.toml"):
        times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
        for _ in range(args.rounds):
            for name in OPTIMIZERS:
                times[name].append(step_time(config, name, args.nproc))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"{config} on {args.nproc} processes, median step s over {args.rounds} rounds: "
            + ", ".join(f"{name} {medians[name]:.4f} {times[name]}" for name in OPTIMIZERS)
            + f"; Muon / AdamW {medians['Muon'] / medians['AdamW']:.3f}",
            flush=True,
        )
    losses = {name: final_loss(name, args.steps) for name in OPTIMIZERS}
    print(f"debug model, 1 process, loss after {args.steps} steps: {losses}", flush=True)
    if args.skip_simulation:
        return
    for label, extra in (("the preset's batch", []), ("a global batch of 64", ["--training.global_batch_size", "64"])):
        runs = {name: simulated(name, extra) for name in OPTIMIZERS}
        (adamw, _), (muon, phase) = runs["AdamW"], runs["Muon"]
        print(
            f"llama3_8b.toml --simulate (8 H100), {label}: AdamW step {adamw:.3f} s, Muon step {muon:.3f} s "
            f"(optimizer phase {phase:.3f} s): Muon costs {100 * (muon / adamw - 1):.1f}% of the step",
            flush=True,
        )


if __name__ == "__main__":
    main()
