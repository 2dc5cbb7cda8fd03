"""Pipeline schedules side by side: step time, memory per stage, measured and theoretical bubble.

For each schedule, ``--pp`` ranks (spawned here, gloo on CPU, one thread each) train the same
model on the same global batch with the trainer's own step (``forward_backward`` through the
pipeline, optimizer step) for ``--warmup`` unmeasured and ``--steps`` measured steps. Per rank:

- ``compute_s``: time inside the stage's forward / backward / weight-gradient calls;
- ``bubble``: ``1 - compute_s / step_s``, the share of the step the rank waits (on CPU the
  point-to-point transfers are copies, so waiting is almost all of it);
- ``peak_rss_step_mib``: peak resident memory during the measured steps above the memory after
  building (CPU has no allocator statistics; it counts the activations a schedule keeps alive,
  plus gradients and optimizer state created by the first step, taken before measuring).

Beside them the schedule's theoretical bubble ``BUBBLE_FRACTION`` (equal stage times). One JSON
line per schedule. Extra trainer options after ``--``:

    python benchmarks/pipeline.py [--pp 2] [--steps 3] [--schedules 1F1B,GPipe] [-- --training.seq_len 256]
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

from parallelisms.pipeline_split import BUBBLE_FRACTION, SCHEDULES
from trainer.build import build_training
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.metrics.accounting import peak_rss_bytes
from trainer.planning.job_plan import resolve_job
from trainer.step.train_step import run_step

COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def rss_mib() -> float:
    """Peak resident set size of this process so far (its own, not its launcher's)."""
    return peak_rss_bytes() / 2**20


def instrument(stage, clock: dict[str, float]) -> None:
    """Add the time of the stage's compute calls to ``clock["compute"]``."""
    for name in COMPUTE_METHODS:
        original = getattr(stage, name)

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                clock["compute"] += time.perf_counter() - start

        setattr(stage, name, timed)


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
    pipeline = job.pipeline
    assert pipeline is not None  # main() asks for pp >= 2
    clock = {"compute": 0.0}
    for stage in pipeline.stages:
        instrument(stage, clock)
    for _ in range(warmup):
        run_step(job.step, job.step.batches.fetch())
    built = rss_mib()
    step_times, compute_times = [], []
    for _ in range(steps):
        microbatches = job.step.batches.fetch()
        dist.barrier()
        clock["compute"] = 0.0
        start = time.perf_counter()
        result = run_step(job.step, microbatches)
        step_times.append(time.perf_counter() - start)
        compute_times.append(clock["compute"])
    step_s, compute_s = statistics.median(step_times), statistics.median(compute_times)
    torch.save(
        {
            "rank": rank,
            "stages": [s.stage_index for s in pipeline.stages],
            "step_s": round(step_s, 4),
            "compute_s": round(compute_s, 4),
            "bubble": round(1 - compute_s / step_s, 3),
            "peak_rss_step_mib": round(rss_mib() - built, 1),
            "loss": result.loss_avg,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own, trainer_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args(own)
    if args.pp < 2:
        parser.error("--pp must be at least 2: the benchmark compares pipeline schedules")
    base = [
        "--training.dataset",
        "shakespeare_dialogue",
        "--training.seq_len",
        str(args.seq_len),
        "--training.global_batch_size",
        str(args.global_batch),
        "--training.local_batch_size",
        str(args.global_batch),
        "--parallelism.pipeline_parallel_microbatch_size",
        str(args.microbatch_size),
        "--mesh",
        f"pp={args.pp}",
        "--metrics.enable_tensorboard=false",
        "--training.check_memory=false",
    ]
    microbatches = args.global_batch // args.microbatch_size
    for schedule in args.schedules.split(","):
        argv = base + ["--parallelism.pipeline_parallel_schedule", schedule] + trainer_args
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(
                rank_main,
                args=(args.pp, free_port(), argv, args.warmup, args.steps, out_dir),
                nprocs=args.pp,
                start_method="spawn",
            )
            ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.pp)]
        per_rank = len(ranks[0]["stages"])
        print(
            json.dumps(
                {
                    "schedule": schedule,
                    "pp": args.pp,
                    "stages_per_rank": per_rank,
                    "microbatches": microbatches,
                    "global_batch": args.global_batch,
                    "seq_len": args.seq_len,
                    "step_time_s": max(r["step_s"] for r in ranks),
                    "bubble_measured": round(statistics.mean(r["bubble"] for r in ranks), 3),
                    "bubble_theoretical": round(BUBBLE_FRACTION[schedule](args.pp, per_rank, microbatches), 3),
                    "loss": ranks[0]["loss"],
                    "ranks": [
                        {k: r[k] for k in ("rank", "stages", "step_s", "compute_s", "bubble", "peak_rss_step_mib")}
                        for r in ranks
                    ],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
