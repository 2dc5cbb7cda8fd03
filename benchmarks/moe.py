"""The debug Mixture-of-Experts on CPU at ep = 1, 2, 4: step time, peak memory, all-to-all bytes;
and the experts' grouped matmul against the exact per-expert fallback.

Training: for each ``ep``, ``--world`` ranks (spawned here, gloo, one thread each) train
``debug_moe.toml`` with ``--mesh dp_shard=<world>,ep=<ep>`` through the trainer's own build and
step (``build_training``; ``run_step`` on each fetched step): ``--warmup``
unmeasured steps, then ``--steps`` measured ones. Per ``ep``:

- ``step_s``: the slowest rank's median time of ``run_step`` (the step without its fetch);
- ``peak_rss_mib``: the largest peak resident memory of a rank (the whole process: Python,
  torch, the model, its gradients and AdamW state, the activations; CPU has no allocator stats);
- all-to-all MiB per rank (mean over ranks) and step, from ``ExpertParallelDispatch.bytes_sent``
  (token rows a rank sends to the other EP ranks in the dispatch and combine of every MoE layer):
  ``a2a_forward_mib`` in the training forward; ``a2a_prepass_mib`` in the counting pre-pass that
  the ``global_batch`` balancing loss runs before it (a no-grad forward of every micro-batch,
  ``trainer/step/expert_balance.py``), which exchanges the same tokens; ``a2a_step_mib`` = 2 x forward
  + pre-pass, as the backward sends as much as the forward (the gradient of an all-to-all is the
  reverse all-to-all, not counted by ``bytes_sent``). The small exchange of per-expert counts is
  left out. ep = 1 exchanges nothing.

Grouped matmul: ``grouped_swiglu`` (three ``kernels.grouped_mm``, i.e. ``torch._grouped_mm``)
against ``looped_swiglu`` (one matmul per expert), forward only, on the debug flavor's expert
shapes (8 experts, dim 256, hidden 256) with uneven, seeded token counts per expert (one expert
gets none), at the routed rows of one rank's micro-batch and of the whole global batch, fp32 and
bf16, interleaved and median of ``--mm-repeats``. Training uses the grouped one only on CUDA in
bf16 at compute capability 9.0+ (``has_grouped_mm`` in ``trainer/model/moe.py``), the fallback
everywhere else, this CPU included (torch 2.13's CPU ``_grouped_mm`` has a forward, but its
backward rejects the broadcast gradients).

Simulated bytes: first, ``--simulate`` of the device check's Qwen3-30B-A3B job at the preset's
per-GPU work on an H200 (:data:`PRESET_SHAPED`), eager and compiled: the memory traffic per token
the cost model counts, the predicted step and MFU, the costliest rows of its breakdown
(``--bytes-only`` stops there; about a minute).

Prints a table and one JSON line. Extra trainer options after ``--``:

    python benchmarks/moe.py [--eps 1,2,4] [--steps 5] [--warmup 2] [--bytes-only] [-- --training.seq_len 256]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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

from parallelisms.expert_parallel import ExpertParallelDispatch
from trainer.build import build_training
from trainer.config import load_config
from trainer.data.datasets import load_dataset
from trainer.entry.simulate import simulate
from trainer.metrics.accounting import peak_rss_bytes
from trainer.model.moe import moe_layers
from trainer.model.routed_experts import grouped_swiglu, looped_swiglu
from trainer.planning.job_plan import resolve_job
from trainer.step.train_step import run_step


def rss_mib() -> float:
    """Peak resident set size of this process so far (its own, not its launcher's)."""
    return peak_rss_bytes() / 2**20


def tally_exchanges(model: torch.nn.Module, tally: dict[str, int]) -> int:
    """Wrap every MoE layer's EP exchange to add the bytes it sends to ``tally["prepass"]`` (the
    global-batch balancing loss's counting pre-pass) or ``tally["forward"]``; the number wrapped."""
    wrapped = 0
    for moe in moe_layers(model):
        exchange = moe.experts.dispatch
        if not isinstance(exchange, ExpertParallelDispatch):
            continue

        def counted(rows, counts, experts, _moe=moe, _exchange=exchange):
            before = _exchange.bytes_sent
            out = _exchange(rows, counts, experts)
            tally["prepass" if _moe.balancing.prepass else "forward"] += _exchange.bytes_sent - before
            return out

        moe.experts.dispatch = counted
        wrapped += 1
    return wrapped


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
    tally = {"forward": 0, "prepass": 0}
    wrapped = tally_exchanges(job.model, tally)
    for _ in range(warmup):
        run_step(job.step, job.step.batches.fetch())
    tally.update(forward=0, prepass=0)
    step_times = []
    for _ in range(steps):
        microbatches = job.step.batches.fetch()
        dist.barrier()
        start = time.perf_counter()
        result = run_step(job.step, microbatches)
        step_times.append(time.perf_counter() - start)
    torch.save(
        {
            "rank": rank,
            "step_s": statistics.median(step_times),
            "peak_rss_mib": rss_mib(),
            "a2a_forward_bytes": tally["forward"] / steps,
            "a2a_prepass_bytes": tally["prepass"] / steps,
            "moe_layers_with_ep": wrapped,
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


def train_rows(args: argparse.Namespace, trainer_args: list[str]) -> list[dict]:
    base = [
        "--config",
        "debug_moe.toml",
        "--training.global_batch_size",
        str(args.global_batch),
        "--training.local_batch_size",
        str(args.global_batch // args.world),
        "--training.seq_len",
        str(args.seq_len),
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.check_memory=false",
    ]
    rows = []
    for ep in (int(e) for e in args.eps.split(",")):
        argv = [*base, "--mesh", f"dp_shard={args.world},ep={ep}", *trainer_args]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(
                rank_main,
                args=(args.world, free_port(), argv, args.warmup, args.steps, out_dir),
                nprocs=args.world,
                start_method="spawn",
            )
            ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(args.world)]
        forward = statistics.mean(r["a2a_forward_bytes"] for r in ranks) / 2**20
        prepass = statistics.mean(r["a2a_prepass_bytes"] for r in ranks) / 2**20
        rows.append(
            {
                "ep": ep,
                "step_s": round(max(r["step_s"] for r in ranks), 3),
                "peak_rss_mib": round(max(r["peak_rss_mib"] for r in ranks), 1),
                "a2a_forward_mib": round(forward, 3),
                "a2a_prepass_mib": round(prepass, 3),
                "a2a_step_mib": round(2 * forward + prepass, 3),
                "moe_layers_with_ep": ranks[0]["moe_layers_with_ep"],
                "loss": round(ranks[0]["loss"], 6),
                "ranks_step_s": [round(r["step_s"], 3) for r in ranks],
                "ranks_peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks],
            }
        )
    return rows


def uneven_counts(rows: int, n_experts: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` split over the experts unevenly (skewed weights), the last expert getting none."""
    weights = torch.rand(n_experts - 1, generator=generator) ** 3 + 0.02
    counts = (weights / weights.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return torch.cat([counts, counts.new_zeros(1)])


def time_ms(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return 1000 * (time.perf_counter() - start)


def matmul_rows(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.mm_threads)
    n_experts, dim, hidden, top_k = 8, 256, 256, 2  # the debugmoe flavor
    generator = torch.Generator().manual_seed(0)
    tokens_micro = (args.global_batch // args.world) * args.seq_len
    rows = []
    for label, routed in (
        ("one rank's micro-batch", tokens_micro * top_k),
        ("global batch", args.global_batch * args.seq_len * top_k),
    ):
        counts = uneven_counts(routed, n_experts, generator)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(routed, dim, generator=generator).to(dtype)
            w1, w3 = (
                torch.randn(n_experts, hidden, dim, generator=generator).div(dim**0.5).to(dtype) for _ in range(2)
            )
            w2 = torch.randn(n_experts, dim, hidden, generator=generator).div(hidden**0.5).to(dtype)
            operands = (x, counts, w1, w2, w3)
            with torch.no_grad():
                grouped, looped = grouped_swiglu(*operands), looped_swiglu(*operands)
                times: dict[str, list[float]] = {"grouped": [], "looped": []}
                for _ in range(args.mm_repeats):
                    times["grouped"].append(time_ms(grouped_swiglu, *operands))
                    times["looped"].append(time_ms(looped_swiglu, *operands))
            grouped_ms, looped_ms = statistics.median(times["grouped"]), statistics.median(times["looped"])
            rows.append(
                {
                    "rows": label,
                    "routed_rows": routed,
                    "counts": counts.tolist(),
                    "dtype": str(dtype).removeprefix("torch."),
                    "grouped_ms": round(grouped_ms, 3),
                    "looped_ms": round(looped_ms, 3),
                    "grouped_over_looped": round(grouped_ms / looped_ms, 3),
                    "max_abs_diff": float((grouped.float() - looped.float()).abs().max()),
                }
            )
    return rows


PRESET_SHAPED = [
    "--config",
    "qwen3_30b_a3b.toml",
    "--parallelism.expert_parallel_degree",
    "1",
    "--training.global_batch_size",
    "8",
    "--model.n_layers",
    "8",
    "--training.mixed_precision_param",
    "bfloat16",
    "--target-gpu",
    "h200",
]
"""The device check's Qwen3-30B-A3B job at the preset's per-GPU work: 8 blocks, 8 micro-batches of
one 8192-token sequence, full AC, ep 1, the preset's ``global_batch`` scope."""


def simulated_bytes_rows() -> list[dict]:
    """``--simulate`` of :data:`PRESET_SHAPED` on one rank, eager and compiled: the memory
    traffic per token the cost model counts, the step and the predicted MFU on an H200."""
    rows = []
    for compiled in (False, True):
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()) as out:
            simulate([*PRESET_SHAPED, f"--compile.enable={str(compiled).lower()}", "--job.dump_folder", folder], 1, 1)
            report = json.loads(Path(out.getvalue().strip().splitlines()[-1]).read_text())
        (role,) = report["roles"]
        rows.append(
            {
                "compiled": compiled,
                "mb_per_token": role["memory_traffic_bytes_per_token"] / 1e6,
                "step_s": role["step_time_s"],
                "mfu": role["mfu"],
                "top_modules": [r["name"] for r in role["by_module"][:3]],
            }
        )
    return rows


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    own, trainer_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--eps", default="1,2,4")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mm-repeats", type=int, default=30)
    parser.add_argument("--mm-threads", type=int, default=1, help="threads for the grouped matmul timing")
    parser.add_argument(
        "--bytes-only", action="store_true", help="only the simulator's bytes per token of the preset-shaped job"
    )
    args = parser.parse_args(own)

    simulated = simulated_bytes_rows()
    for r in simulated:
        print(
            f"simulated Qwen3-30B-A3B x 8 blocks, 8 x 8192 tokens, full AC, ep 1 on an H200, "
            f"{'compiled' if r['compiled'] else 'eager'}: {r['mb_per_token']:.1f} MB of memory traffic per token, "
            f"step {r['step_s']:.2f} s, MFU {r['mfu']:.1%}; most time: {', '.join(r['top_modules'])}",
            flush=True,
        )
    if args.bytes_only:
        print(json.dumps({"torch": torch.__version__, "simulated": simulated}), flush=True)
        return

    matmul = matmul_rows(args)
    train = train_rows(args, trainer_args)

    print(
        f"debugmoe on CPU, world {args.world}, global batch {args.global_batch} x {args.seq_len} tokens, torch {torch.__version__}"
    )
    print(
        "| mesh | step (s) | step / ep=1 | peak RSS per rank (MiB) "
        "| all-to-all MiB sent per rank per step: forward | counting pre-pass | step total | loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    first = next((r for r in train if r["ep"] == 1), train[0])["step_s"]
    for r in train:
        print(
            f"| dp_shard={args.world},ep={r['ep']} | {r['step_s']:.3f} | {r['step_s'] / first:.2f} "
            f"| {r['peak_rss_mib']:.0f} | {r['a2a_forward_mib']:.2f} | {r['a2a_prepass_mib']:.2f} "
            f"| {r['a2a_step_mib']:.2f} | {r['loss']:.6f} |"
        )
    print()
    print(
        f"| experts forward ({args.mm_threads} thread) | routed rows | dtype | grouped (ms) | looped (ms) | grouped / looped | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in matmul:
        print(
            f"| {r['rows']} | {r['routed_rows']} | {r['dtype']} | {r['grouped_ms']:.2f} | {r['looped_ms']:.2f} "
            f"| {r['grouped_over_looped']:.2f} | {r['max_abs_diff']:.1e} |"
        )
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "world": args.world,
                "global_batch": args.global_batch,
                "seq_len": args.seq_len,
                "steps": args.steps,
                "warmup": args.warmup,
                "train": train,
                "grouped_mm": matmul,
                "simulated": simulated,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
