"""Document-masked vs plain causal attention: time and memory, side by side in one run.

Packed windows of documents whose lengths are drawn like web text (log-normal, median about
400 tokens, a long tail; ``--median`` and ``--sigma`` change it), cut at random offsets as the
packed data is. Per sequence length, one JSON line with the forward+backward time (median of
``--repeats``) of

* ``causal``: SDPA with ``is_causal`` (what an unmasked packed run does);
* ``masked``: the trainer's document masking, i.e. ``document_causal_mask`` built from the
  document ids plus SDPA with that additive mask (the CPU flash kernel accepts it; on CUDA
  SDPA picks the memory-efficient kernel, the flash kernel takes no mask);
* ``per_document``: each document attended on its own with ``is_causal``, the work a
  block-sparse or variable-length kernel would do (``sum(len^2)`` instead of ``seq^2``),

and the memory each keeps for backward (bytes autograd saves, counted once per storage) plus
the mask's own bytes. The mask is built once per forward and shared by all blocks, so a model
pays its bytes once; the time of building it is included in ``masked``.

    python benchmarks/attention.py                  # CPU: seq 2048, 4096; CUDA: 8192 too
    python benchmarks/attention.py --seq 4096 --batch 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trainer.data.documents import document_ids
from trainer.model.llama3 import causal_attention, document_causal_mask

BOS = 1


def document_lengths(total: int, median: float, sigma: float, gen: torch.Generator) -> list[int]:
    """Log-normal document lengths (at least 8 tokens) until they cover ``total`` tokens."""
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = torch.empty(1).log_normal_(mean=float(torch.tensor(median).log()), std=sigma, generator=gen)
        lengths.append(max(8, int(draw)))
    return lengths


def packed_ids(batch: int, seq: int, median: float, sigma: float, seed: int) -> torch.Tensor:
    """Document ids of ``batch`` packed windows, each starting at a random point of a document."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        tokens = []
        for length in document_lengths(2 * seq, median, sigma, gen):
            tokens += [BOS] + [0] * (length - 1)
        start = int(torch.randint(0, len(tokens) - seq, (1,), generator=gen))
        rows.append(torch.tensor(tokens[start : start + seq]))
    return document_ids(torch.stack(rows), BOS)


def timed(fn, device: torch.device, repeats: int) -> float:
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


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward during ``fn()``, each storage counted once."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def bench(
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    median: float,
    sigma: float,
    repeats: int,
    device: torch.device,
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn((batch, h, seq, head_dim), generator=gen, device=device, dtype=dtype, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    upstream = torch.randn((batch, heads, seq, head_dim), generator=gen, device=device, dtype=dtype)
    ids = packed_ids(batch, seq, median, sigma, seed=1).to(device)

    def causal() -> torch.Tensor:
        return causal_attention(q, k, v)

    def masked() -> torch.Tensor:
        return causal_attention(q, k, v, document_causal_mask(ids, dtype))

    def per_document() -> torch.Tensor:
        rows = []
        for b in range(batch):
            _, counts = torch.unique_consecutive(ids[b], return_counts=True)
            parts = zip(*(t[b : b + 1].split(counts.tolist(), dim=2) for t in (q, k, v)))
            rows.append(torch.cat([causal_attention(*part) for part in parts], dim=2))
        return torch.cat(rows)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), upstream)

    out_masked, out_docs = masked(), per_document()
    lengths = [int(c) for b in range(batch) for c in torch.unique_consecutive(ids[b], return_counts=True)[1]]
    mask_bytes = batch * seq * seq * torch.finfo(dtype).bits // 8
    row = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "seq": seq,
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."),
        "documents_per_window": round(len(lengths) / batch, 1),
        "in_document_fraction_of_causal_work": round(
            sum(n * (n + 1) / 2 for n in lengths) / (batch * seq * (seq + 1) / 2), 3
        ),
        "masked_vs_per_document_max_abs_diff": (out_masked - out_docs).abs().max().item(),
    }
    fwd_bwd_ms = {}
    for name, fn in (("causal", causal), ("masked", masked), ("per_document", per_document)):
        fwd_bwd_ms[name] = row[f"{name}_fwd_bwd_ms"] = round(timed(fwd_bwd(fn), device, repeats), 1)
    for name, fn in (("causal", causal), ("masked", masked)):
        row[f"{name}_saved_for_backward_mib"] = round(saved_bytes(fn) / 2**20, 1)
    row["mask_mib"] = round(mask_bytes / 2**20, 1)
    row["masked_over_causal_time"] = round(fwd_bwd_ms["masked"] / fwd_bwd_ms["causal"], 2)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for name, fn in (("causal", causal), ("masked", masked)):
            torch.cuda.reset_peak_memory_stats(device)
            fwd_bwd(fn)()
            row[f"{name}_peak_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--median", type=float, default=400.0, help="median document length in tokens")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of document lengths")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    seqs = args.seq or ([2048, 4096, 8192] if cuda else [2048, 4096])
    heads = args.heads or (32 if cuda else 8)
    kv_heads = args.kv_heads or (8 if cuda else 2)
    for seq in seqs:
        for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
            row = bench(
                seq, args.batch, heads, kv_heads, args.head_dim, dtype, args.median, args.sigma, args.repeats, device
            )
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
