"""The device check's probes: whether a seed gives the GPU the CPU's initial weights; which
kernels the model's attention and experts run on this GPU, read from the profiler rather than
inferred from the torch version; and the experts' grouped matmul timed against the per-expert
loop it replaces."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any


def initial_weights(cpu: bool) -> tuple[str, str, str, str, dict[str, Any]]:
    """``(setting, measured, reference, result, figures)``: the debug model and the debug MoE
    initialised from one seed in CPU memory and on the GPU (float32, built on the meta device
    as the trainer builds them), compared bit for bit. The rehearsal compares two CPU copies."""
    from dataclasses import replace

    import torch

    from trainer.model.llama3 import FLAVORS, Transformer
    from trainer.model.moe import FLAVORS as MOE_FLAVORS

    device = "cpu" if cpu else "cuda"
    differing: list[str] = []
    total, worst, seconds = 0, 0.0, 0.0
    for args in (FLAVORS["debugmodel"], MOE_FLAVORS["debugmoe"]):
        args = replace(args, max_seq_len=256)
        reference = Transformer(args)
        reference.init_weights(0)
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device=device)
        start = time.perf_counter()
        with synchronized(cpu):
            model.init_weights(0)
        seconds += time.perf_counter() - start
        for (name, expected), got in zip(reference.named_parameters(), model.parameters()):
            total += 1
            if not torch.equal(expected, got.cpu()):
                differing.append(name)
                worst = max(worst, (expected - got.cpu()).abs().max().item())
    measured = f"{total - len(differing)} of {total} parameters bit-identical"
    if differing:
        measured += f"; worst difference {worst:.3g} ({differing[0]}, ...)"
    return (
        f"debug model and debug MoE, seed 0, {'CPU' if cpu else 'GPU'} vs CPU",
        measured,
        "all bit-identical",
        "FAIL" if differing else "ok",
        {"parameters": total, "differing": differing, "worst": worst, "init_s": seconds},
    )


def attention_kernels(cpu: bool) -> Iterator[tuple[str, str, str]]:
    """``(setting, ATen op, first kernel)`` for SDPA's causal and document-masked attention."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model.llama3 import causal_attention, document_causal_mask

    device, seq, dtype = ("cpu", 256, torch.float32) if cpu else ("cuda", 8192, torch.bfloat16)
    heads, kv_heads, head_dim = 32, 8, 64
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    documents = torch.arange(seq, device=device).div(seq // 3, rounding_mode="floor")[None]
    activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    for setting, mask in (("causal", None), ("document mask", document_causal_mask(documents, dtype))):
        with profile(activities=activities) as prof, synchronized(cpu):
            causal_attention(q, k, v, mask).sum().backward()
        ops = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
        kernels = [e.name for e in prof.events() if cpu or str(e.device_type).endswith("CUDA")]
        words = ("flash", "fmha", "efficient", "cudnn", "attention", "softmax")
        kernel = next((n for n in kernels if any(w in n.lower() for w in words)), "?")
        yield (
            f"{dtype}, {setting}, seq {seq}".replace("torch.", ""),
            (ops[0] if ops else "?").removeprefix("aten::"),
            kernel[:70],
        )


def expert_kernels(cpu: bool) -> tuple[str, str, str, dict[str, Any]]:
    """``(setting, ATen op and first matmul kernel, forward times, figures)`` of the experts as
    the model dispatches them (``GroupedExperts``: the grouped matmul on CUDA in bf16 at sm90+,
    else the per-expert loop), forward and backward on the Qwen3-30B-A3B expert shapes and one
    sequence's routed rows; then the forward alone, grouped against looped (medians of 5)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model.routed_experts import GroupedExperts, grouped_swiglu, looped_swiglu

    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    n_experts, dim, hidden, rows = (8, 256, 256, 1024) if cpu else (128, 2048, 768, 8192 * 8)
    generator = torch.Generator().manual_seed(0)
    experts = GroupedExperts(n_experts, dim, hidden)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.02, generator=generator)
    experts.to(device=device, dtype=dtype)
    skew = torch.rand(n_experts, generator=generator) ** 3 + 0.02  # uneven, as routing is
    counts = (skew / skew.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    counts = counts.to(device)
    x = torch.randn(rows, dim, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof, synchronized(cpu):
        experts.swiglu(x, counts).float().sum().backward()
    events = [e.name for e in prof.events()]
    grouped = any(name == "aten::_grouped_mm" for name in events)
    kernels = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]
    words = ("gemm", "grouped", "cutlass", "sm90", "matmul")
    kernel = next((n for n in kernels if any(w in n.lower() for w in words)), "-" if cpu else "?")
    weights = (x.detach(), counts, experts.w1.detach(), experts.w2.detach(), experts.w3.detach())
    with torch.no_grad():
        times = {
            name: forward_ms(fn, weights, cpu) for name, fn in (("grouped", grouped_swiglu), ("looped", looped_swiglu))
        }
        difference = (grouped_swiglu(*weights).float() - looped_swiglu(*weights).float()).abs().max().item()
    ratio = times["grouped"] / times["looped"]
    return (
        f"{dtype}, {n_experts} experts {dim} -> {hidden}, {rows} rows, forward + backward".replace("torch.", ""),
        f"{'_grouped_mm (grouped matmul)' if grouped else 'mm (per-expert loop)'}, {kernel[:60]}",
        f"forward: grouped {times['grouped']:.2f} ms, loop {times['looped']:.2f} ms ({ratio:.2f}x)",
        {
            "grouped_mm": grouped,
            "grouped_ms": times["grouped"],
            "looped_ms": times["looped"],
            "max_abs_diff": difference,
        },
    )


def forward_ms(fn: Callable[..., Any], operands: tuple[Any, ...], cpu: bool) -> float:
    """Median of 5 timed calls after one untimed (allocation, the kernel's first launch)."""
    samples = []
    for _ in range(6):
        start = time.perf_counter()
        with synchronized(cpu):
            fn(*operands)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples[1:])


def release_memory(cpu: bool) -> None:
    """Hand the probes' blocks back to the driver: the caching allocator would keep them for this
    process, and the jobs after the probes are sized to 90% of the GPU."""
    if not cpu:
        import torch

        torch.cuda.empty_cache()


@contextlib.contextmanager
def synchronized(cpu: bool) -> Iterator[None]:
    yield
    if not cpu:
        import torch

        torch.cuda.synchronize()
