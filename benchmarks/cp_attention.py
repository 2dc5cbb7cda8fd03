"""Context-parallel attention checked against full causal attention, with simulated CP ranks.

One process plays every rank of a CP group: the sequence is laid out head-tail, each rank's
query chunks attend to the whole sequence's K/V exactly as the ``allgather_kv`` backend does
after its all-gather, and the outputs and gradients (q, k, v) are compared with one full
causal attention. Prints one JSON line per (sequence length, dtype): max relative errors and
the forward+backward time of the full attention and of the slowest simulated rank.

    python benchmarks/cp_attention.py                       # CUDA: seq 8k, 16k, 32k; CPU: 1k, 2k
    python benchmarks/cp_attention.py --seq 8192 --cp 4

The ring backend (PyTorch's) needs a real multi-rank NCCL group and is not simulated here.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from parallelisms.context_parallel import attend_local_chunks
from parallelisms.sequence_shards import head_tail_positions
from trainer.model.llama3 import causal_attention


def timed(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(
    seq: int, cp: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn((1, h, seq, head_dim), generator=gen, device=device, dtype=dtype, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    upstream = torch.randn((1, heads, seq, head_dim), generator=gen, device=device, dtype=dtype)

    def full() -> tuple[torch.Tensor, ...]:
        out = causal_attention(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), upstream))

    def rank(r: int) -> tuple[torch.Tensor, ...]:
        pos = head_tail_positions(seq, r, cp).to(device)
        q_local = q[:, :, pos]
        out = attend_local_chunks(causal_attention, q_local, k, v, r, cp)
        return (out, pos, *torch.autograd.grad(out, (q, k, v), upstream[:, :, pos]))

    want_out, want_dq, want_dk, want_dv = full()
    out = torch.empty_like(want_out)
    # Summed in float32, as NCCL's reduce-scatter of the real backend would with fp32 reduction.
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (want_dq, want_dk, want_dv))
    for r in range(cp):
        o, pos, gq, gk, gv = rank(r)
        out[:, :, pos] = o
        dq += gq.float()
        dk += gk.float()  # the reduce-scatter's sum, done in one place
        dv += gv.float()
    return {
        "seq": seq,
        "cp": cp,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rel_err_out": rel_err(out, want_out),
        "rel_err_dq": rel_err(dq, want_dq),
        "rel_err_dk": rel_err(dk, want_dk),
        "rel_err_dv": rel_err(dv, want_dv),
        "full_fwd_bwd_ms": round(timed(full, device), 2),
        "slowest_rank_fwd_bwd_ms": round(max(timed(functools.partial(rank, r), device) for r in range(cp)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seqs = args.seq or ([8192, 16384, 32768] if device.type == "cuda" else [1024, 2048])
    heads = args.heads if device.type == "cuda" else min(args.heads, 8)
    kv_heads = args.kv_heads if device.type == "cuda" else min(args.kv_heads, 2)
    for seq in seqs:
        if seq % (2 * args.cp):
            raise SystemExit(f"--seq {seq} must be divisible by 2 x --cp = {2 * args.cp}")
        for dtype in (torch.float32, torch.bfloat16):
            print(json.dumps(check(seq, args.cp, dtype, heads, kv_heads, args.head_dim, device)), flush=True)


if __name__ == "__main__":
    main()
