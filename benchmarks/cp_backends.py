"""Context-parallel attention backends side by side: all-gather K/V against Ulysses, real ranks.

``--cp`` ranks are spawned here (gloo on CPU, NCCL on CUDA; one thread each on CPU). Each rank
holds its head-tail shard of q, k and v of one attention layer and runs forward and backward
through the backend, with causal attention and with document masking (random documents of
64-1024 tokens; the mask object built by the backend once per step, as the model does). Per
configuration, one JSON line:

- ``step_ms``: median over ``--steps`` of the slowest rank's forward + backward (after a warm-up);
- ``peak_mib``: the largest rank's peak memory over the configuration's steps, above its memory
  before them (CPU: resident set, whose high-water mark is reset before each configuration;
  CUDA: the allocator's peak);
- ``sent_mib``: bytes one rank sends to the others per step, counted at the collectives
  (all-gather and its reduce-scatter backward; all-to-alls forward and backward; the
  document-id gather under masking).

On two shared CPU cores the ranks of cp=4 take turns on the cores, so step times there measure
compute plus oversubscription more than communication; compare backends at the same cp.

    python benchmarks/cp_backends.py                      # cp 2 and 4, seq 2048 4096 8192
    python benchmarks/cp_backends.py --cp 2 --seq 4096 --heads 32 --kv-heads 8
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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import parallelisms.context_parallel as context_parallel
import parallelisms.sequence_shards as sequence_shards
import parallelisms.ulysses as ulysses
from parallelisms.context_parallel import AllGatherKVAttention, AllGatherKVMask
from parallelisms.sequence_shards import head_tail_positions
from parallelisms.ulysses import UlyssesAttention, UlyssesMask
from trainer.model.llama3 import causal_attention

SENT = {"bytes": 0}


def count_sent(degree: int) -> None:
    """Wrap the backends' collectives to add what this rank sends to the others to ``SENT``."""
    gather, scatter, a2a = sequence_shards.all_gather_into, context_parallel._reduce_scatter, ulysses._all_to_all

    def all_gather(out, x, group=None):
        SENT["bytes"] += x.numel() * x.element_size() * (degree - 1)
        return gather(out, x, group=group)

    def reduce_scatter(out, x, group=None):
        SENT["bytes"] += x.numel() * x.element_size() * (degree - 1) // degree
        return scatter(out, x, group=group)

    class CountedAllToAll(torch.autograd.Function):
        """Counts the forward all-to-all and the inverse one its backward runs."""

        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            SENT["bytes"] += x.numel() * x.element_size() * (degree - 1) // degree
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            SENT["bytes"] += grad.numel() * grad.element_size() * (degree - 1) // degree
            return grad

    sequence_shards.all_gather_into, context_parallel._reduce_scatter = all_gather, reduce_scatter
    ulysses._all_to_all = lambda x, group: a2a(CountedAllToAll.apply(x), group)


def status_mib(field: str) -> float:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def current_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return status_mib("VmRSS")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the resident set's high-water mark (VmHWM)


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return status_mib("VmHWM")


def documents(seq: int, gen: torch.Generator) -> torch.Tensor:
    lengths, total = [], 0
    while total < seq:
        lengths.append(int(torch.randint(64, 1025, (1,), generator=gen)))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq][None]


def measure(args: argparse.Namespace, seq: int, backend: str, masked: bool, device: torch.device) -> dict:
    group, rank, degree = dist.new_group(), dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seq)
    pos = head_tail_positions(seq, rank, degree)
    shape = (1, seq // degree, args.head_dim)
    q, k, v = (
        torch.randn((1, h, *shape[1:]), generator=gen).to(device, args.dtype).requires_grad_()
        for h in (args.heads, args.kv_heads, args.kv_heads)
    )
    upstream = torch.randn((1, args.heads, *shape[1:]), generator=gen).to(device, args.dtype)
    ids = documents(seq, gen)[:, pos].to(device)
    attention: UlyssesAttention | AllGatherKVAttention
    make_mask: UlyssesMask | AllGatherKVMask
    if backend == "ulysses":
        attention, make_mask = UlyssesAttention(causal_attention, group, degree), UlyssesMask(group, degree)
    else:
        attention = AllGatherKVAttention(causal_attention, group, rank, degree)
        make_mask = AllGatherKVMask(group, rank, degree)

    def step() -> None:
        # Each backend's mask is of the form its own attention takes.
        mask: Any = make_mask(ids, args.dtype) if masked else None
        attention(q, k, v, mask).backward(upstream)
        q.grad = k.grad = v.grad = None

    reset_peak(device)
    before = current_mib(device)
    step()  # warm-up, counted in the peak: the allocator keeps what it freed, later steps reuse it
    times, sent = [], []
    for _ in range(args.steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        SENT["bytes"] = 0
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        sent.append(SENT["bytes"])
    peak = torch.tensor(peak_mib(device) - before)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "cp": degree,
        "seq": seq,
        "backend": backend,
        "document_mask": masked,
        "step_ms": round(statistics.median(times) * 1e3, 1),
        "peak_mib": round(peak.item(), 1),
        "sent_mib": round(max(sent) / 2**20, 2),
    }


def rank_main(rank: int, degree: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(degree), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    count_sent(degree)
    rows = [
        measure(args, seq, backend, masked, device)
        for seq in args.seq
        for masked in (False, True)
        for backend in ("allgather_kv", "ulysses")
    ]
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, "rows.pt"))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--seq", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    for degree in args.cp:
        if args.heads % degree or any(seq % (2 * degree) for seq in args.seq):
            raise SystemExit(f"--cp {degree} must divide --heads and 2 x cp every --seq")
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(
                rank_main, args=(degree, free_port(), args, out_dir), nprocs=degree, start_method="spawn"
            )
            for row in torch.load(os.path.join(out_dir, "rows.pt")):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
