"""The debug Mixture-of-Experts on CPU inside pipeline stages, and compiled: what the
``global_batch`` balancing loss's counting pre-pass costs under PP, and compiled against eager.

Pipeline rows: ``--world`` ranks (spawned here, gloo, one thread each) train ``debug_moe.toml``
with ``--mesh pp=<world>`` through the trainer's own build and step (``build_training``;
``run_step`` on each fetched step), ``--warmup`` unmeasured steps, then
``--steps`` measured ones, for three balancing settings: the loss off (no pre-pass), the
``micro_batch`` scope (no pre-pass) and the ``global_batch`` scope, whose pre-pass runs the step's
batch forward-only through the pipeline; with it the schedule switches between ``eval`` and
``step`` twice a step, and each switch makes the stages learn their shapes again (a micro-batch
forward, and for ``step`` its input backward). ``shape_passes`` counts the stage forwards of
those per rank and step (a rank runs one per stage it holds).
Compile rows: one process, the same step eager and with ``--compile.enable`` (per-block compile;
the routing's data-dependent parts run eagerly inside the blocks), after the warm-up steps that
compile. ``step_s``: the slowest rank's median ``run_step`` (the step without its fetch).

Prints a table and one JSON line. Extra trainer options after ``--``:

    python benchmarks/moe_pipeline.py [--world 2] [--steps 4] [--warmup 2] [-- --training.seq_len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelisms.torch_private import pipelining
from trainer.build import build_training
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.planning.job_plan import resolve_job
from trainer.step.train_step import run_step

BALANCING = {
    "balancing loss off": ["--moe.balance_loss_weight", "0"],
    "micro_batch scope": ["--moe.balance_loss_scope", "micro_batch"],
    "global_batch scope (pre-pass)": ["--moe.balance_loss_scope", "global_batch"],
}


def rank_main(rank: int, world: int, port: int, argv: list[str], warmup: int, steps: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    job_plan = resolve_job(load_config(argv), world)
    job = build_training(job_plan, load_dataset(job_plan.config, job_plan.tokenizer, job_plan.global_batch_size))
    shape_passes = [0]

    def count_shape_pass(module: torch.nn.Module, inputs: object) -> None:
        shape_passes[0] += pipelining.in_metadata_inference()

    for stage in job.pipeline.stages if job.pipeline else []:
        stage.submod.register_forward_pre_hook(count_shape_pass)
    for _ in range(warmup):
        run_step(job.step, job.step.batches.fetch())
    shape_passes[0] = 0
    step_times = []
    for _ in range(steps):
        microbatches = job.step.batches.fetch()
        dist.barrier()
        start = time.perf_counter()
        result = run_step(job.step, microbatches)
        step_times.append(time.perf_counter() - start)
    torch.save(
        {"step_s": statistics.median(step_times), "shape_passes": shape_passes[0] / steps, "loss": result.loss_avg},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, argv: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            rank_main,
            args=(world, free_port(), argv, args.warmup, args.steps, out_dir),
            nprocs=world,
            start_method="spawn",
        )
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    return {
        "step_s": round(max(r["step_s"] for r in ranks), 3),
        "shape_passes": max(r["shape_passes"] for r in ranks),
        "loss": round(ranks[0]["loss"], 6),
    }


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own, trainer_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(own)
    base = [
        "--config",
        "debug_moe.toml",
        "--training.global_batch_size",
        str(args.global_batch),
        "--training.seq_len",
        str(args.seq_len),
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.check_memory=false",
    ]
    pipeline = {
        name: measure(
            args.world,
            [*base, "--training.local_batch_size", str(args.global_batch), "--mesh", f"pp={args.world}", *flags]
            + trainer_args,
            args,
        )
        for name, flags in BALANCING.items()
    }
    local = ["--training.local_batch_size", str(args.global_batch // 2)]
    compiled = {
        name: measure(1, [*base, *local, *flags, *trainer_args], args)
        for name, flags in {"eager": [], "compiled": ["--compile.enable"]}.items()
    }

    print(f"debugmoe on CPU, global batch {args.global_batch} x {args.seq_len} tokens, torch {torch.__version__}")
    print(f"| pp={args.world}, 1F1B | step (s) | step / loss off | shape-learning passes per rank and step | loss |")
    print("|---|---|---|---|---|")
    off = pipeline["balancing loss off"]["step_s"]
    for name, r in pipeline.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / off:.2f} | {r['shape_passes']:.0f} | {r['loss']:.6f} |")
    print()
    print("| 1 process, 2 micro-batches, global_batch scope | step (s) | step / eager | loss |")
    print("|---|---|---|---|")
    eager = compiled["eager"]["step_s"]
    for name, r in compiled.items():
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / eager:.2f} | {r['loss']:.6f} |")
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "world": args.world,
                "global_batch": args.global_batch,
                "seq_len": args.seq_len,
                "steps": args.steps,
                "warmup": args.warmup,
                "pipeline": pipeline,
                "compile": compiled,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
