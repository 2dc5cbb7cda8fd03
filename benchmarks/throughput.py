"""Training throughput of a config: tokens/s per device, MFU, peak memory, step times.

Runs the trainer's own step (``trainer.step.train_step`` pieces: fetch, forward/backward with
the gradient accumulator, optimizer step) for ``--warmup`` steps that are not measured (compile
and allocator warm-up happen there), then ``--steps`` measured steps, and prints one JSON line.
Accepts every trainer option after the script's own:

    python benchmarks/throughput.py --config llama3_1b.toml --steps 20 -- --compile.enable \\
        --activation_checkpoint.mode selective --training.seq_len 4096
    torchrun --nproc_per_node 8 benchmarks/throughput.py --config llama3_8b.toml

Tokens/s per device and MFU are counted as torchtitan counts them (tokens a data-parallel
replica processes / (time x its devices); 6N + 12·L·d·S FLOPs per token), so the figures are
comparable with torchtitan's logs. On CPU there is no MFU.
"""

from __future__ import annotations

import argparse
import json
import os
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
from trainer.metrics import device_memory, model_flops_per_token, peak_flops, tokens_per_second_per_device
from trainer.model.llama3 import num_params, whole_model
from trainer.planning.job_plan import resolve_job
from trainer.step.train_step import run_step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_model.toml")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (compile, allocator)")
    args, trainer_args = parser.parse_known_args()
    trainer_args = [a for a in trainer_args if a != "--"]
    total = args.warmup + args.steps
    config = load_config(
        ["--config", args.config, "--training.steps", str(total), "--metrics.enable_tensorboard=false", *trainer_args]
    )
    job_plan = resolve_job(config, int(os.environ.get("WORLD_SIZE", 1)))
    job = build_training(job_plan, load_dataset(job_plan.config, job_plan.tokenizer, job_plan.global_batch_size))
    training, dims, margs = config.training, job_plan.dims, job_plan.model_args

    times = []
    for step in range(1, total + 1):
        if step == args.warmup + 1 and job.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(job.device)
        synchronize(job.device)
        start = time.perf_counter()
        run_step(job.step, job.step.batches.fetch())
        synchronize(job.device)
        if step > args.warmup:
            times.append(time.perf_counter() - start)

    tps = tokens_per_second_per_device(job.step.tokens, statistics.median(times), dims.pp * dims.tp * dims.cp)
    fpt = model_flops_per_token(margs, training.seq_len)
    peak = peak_flops(job.device, override=training.peak_flops or None)
    memory = device_memory(job.device)
    out = {
        "config": args.config,
        "flavor": config.model.flavor,
        "params": num_params(whole_model(margs)),
        "device": torch.cuda.get_device_name(job.device) if job.device.type == "cuda" else "cpu",
        "world_size": dist.get_world_size(),
        "mesh": {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
        },
        "global_batch": job_plan.global_batch_size,
        "seq_len": training.seq_len,
        "param_dtype": str(job_plan.parallel.param_dtype).removeprefix("torch."),
        "compile": config.compile.enable,
        "activation_checkpoint": config.activation_checkpoint.mode
        + (
            f":{config.activation_checkpoint.selective_ac_option}"
            if config.activation_checkpoint.mode == "selective"
            else ""
        ),
        "tokens_per_s_per_device": round(tps, 1),
        "tflops_per_device": round(fpt * tps / 1e12, 2),
        "mfu_pct": round(100 * fpt * tps / peak, 2) if peak else None,
        "peak_memory_active_gib": round(memory.active_gib, 2),
        "peak_memory_reserved_gib": round(memory.reserved_gib, 2) if memory.reserved_gib is not None else None,
        "step_time_median_s": round(statistics.median(times), 4),
        "step_time_min_s": round(min(times), 4),
        "step_time_max_s": round(max(times), 4),
        "measured_steps": len(times),
        "warmup_steps": args.warmup,
    }
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
