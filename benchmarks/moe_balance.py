"""What exact (``global_batch``) MoE balancing costs over the per-micro-batch scope, on CPU.

The debug Mixture-of-Experts (``debug_moe.toml``) with full activation checkpointing and 8
micro-batches a step trains in one process (gloo, one thread) through the trainer's own build
and step (``build_training``; ``run_step`` on each fetched step), in
four settings built side by side:

- ``micro_batch``: ``moe.balance_loss_scope = "micro_batch"``, what most frameworks do;
- ``global_batch``: the exact scope as the trainer runs it here, every micro-batch's forward
  before the backwards, the step's own forwards counting the routing
  (``trainer/step/expert_balance.py``, ``Workload.holds_forwards``);
- ``global_batch, host``: the same with the held forwards' saved tensors in host memory
  (``moe.held_forwards = host``, ``trainer/step/host_offload.py``): on a CPU a copy of each out and
  back, the mechanism's own cost here, not a GPU's PCIe copies;
- ``global_batch, pre-pass``: the exact scope with the forward-only counting pre-pass
  (``moe.held_forwards = prepass``), as under no or selective checkpointing and pipeline
  parallelism.

Each round times ``--steps`` steps of each setting, interleaved (after ``--warmup`` unmeasured
steps each), and prints each setting's median step time and its ratio to ``micro_batch`` in the
same round; the last line is JSON with every round and the median ratios over the rounds. A step
is timed in this process's CPU seconds (``time.process_time``; one thread, so its compute),
which other processes sharing the cores do not inflate as they do the wall-clock seconds, also
shown. Read the ratios, side by side, not one round's seconds.

    python benchmarks/moe_balance.py [--rounds 5] [--steps 3] [--warmup 2] [-- --training.seq_len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.build import build_training
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.planning.job_plan import resolve_job
from trainer.step.schedules import HeldForwards
from trainer.step.train_step import run_step
from trainer.training import Training

EXACT = ["--moe.balance_loss_scope", "global_batch", "--moe.held_forwards"]
SETTINGS = {
    "micro_batch": ["--moe.balance_loss_scope", "micro_batch"],
    "global_batch": [*EXACT, "device"],
    "global_batch, host": [*EXACT, "host"],
    "global_batch, pre-pass": [*EXACT, "prepass"],
}
"""Name: its trainer options."""


def build(argv: list[str]) -> Training:
    plan = resolve_job(load_config(argv), 1)
    return build_training(plan, load_dataset(plan.config, plan.tokenizer, plan.global_batch_size))


def step_seconds(training: Training) -> tuple[float, float]:
    """One step's CPU seconds and wall-clock seconds."""
    microbatches = training.step.batches.fetch()
    cpu, wall = time.process_time(), time.perf_counter()
    run_step(training.step, microbatches)
    return time.process_time() - cpu, time.perf_counter() - wall


def held(training: Training) -> str:
    """Where the step holds its forwards: on the device, in host memory, or not at all (a pre-pass)."""
    schedule = training.step.schedule
    if not isinstance(schedule, HeldForwards):
        return "no"
    return "host" if schedule.offload is not None else "device"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--local-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args, trainer_args = parser.parse_known_args()
    trainer_args = [a for a in trainer_args if a != "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    base = [
        "--config",
        "debug_moe.toml",
        "--activation_checkpoint.mode",
        "full",
        "--moe.balance_loss_weight",
        "0.01",
        "--training.local_batch_size",
        str(args.local_batch),
        "--training.global_batch_size",
        str(args.local_batch * args.microbatches),
        "--training.seq_len",
        str(args.seq_len),
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.check_memory=false",
        *trainer_args,
    ]
    jobs = {name: build([*base, *extra]) for name, extra in SETTINGS.items()}
    where = {name: held(training) for name, training in jobs.items()}
    print(f"{args.microbatches} micro-batches of {args.local_batch} x {args.seq_len} tokens, full AC; held: {where}")
    for parts in jobs.values():
        for _ in range(args.warmup):
            step_seconds(parts)
    rounds = []
    names = list(jobs)
    print(
        "| round | "
        + " | ".join(f"{n}: CPU s (wall s)" for n in names)
        + " | "
        + " | ".join(f"{n} / micro_batch" for n in names[1:])
        + " |"
    )
    for r in range(args.rounds):
        cpu, wall = {}, {}
        for name, parts in jobs.items():
            timed = [step_seconds(parts) for _ in range(args.steps)]
            cpu[name] = statistics.median(t[0] for t in timed)
            wall[name] = statistics.median(t[1] for t in timed)
        ratios = {name: cpu[name] / cpu["micro_batch"] for name in names}
        wall_ratios = {name: wall[name] / wall["micro_batch"] for name in names}
        rounds.append({"cpu_s": cpu, "wall_s": wall, "ratio": ratios, "wall_ratio": wall_ratios})
        cells = [f"{cpu[n]:.3f} ({wall[n]:.3f})" for n in names] + [f"{ratios[n]:.3f}" for n in names[1:]]
        print(f"| {r} | " + " | ".join(cells) + " |")
    median = {n: round(statistics.median(x["ratio"][n] for x in rounds), 4) for n in names[1:]}
    wall_median = {n: round(statistics.median(x["wall_ratio"][n] for x in rounds), 4) for n in names[1:]}
    print(f"median CPU-time ratio to micro_batch over {args.rounds} rounds: {median}; wall-clock: {wall_median}")
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps({"held": held, "median_ratio": median, "median_wall_ratio": wall_median, "rounds": rounds}))


if __name__ == "__main__":
    main()
