"""The kernel probes that calibrate the simulator on this GPU (``trainer/simulation/calibration.py``).

Each probe times one kernel the cost model charges, at the shapes the check's jobs run:
dense bf16 matmuls of each shape class, the large one in float8, causal attention forward and backward, the experts'
grouped matmul, a device-to-device copy for the memory-bound ops, the eager kernels that cast each
element (:func:`casting`), and ``nn.RMSNorm`` (a figure the cost model does not read yet:
:func:`rms_norm`). Nothing here runs a training job: the whole-job rows of the check stay the
test of what these figures predict.
The result is one JSON file per GPU, which the check's simulations read at once and which a
developer commits to ``trainer/simulation/calibrations/<target>.json``.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ATTENTION = (32, 8, 128, 8192)
"""Query heads, key/value heads, head width and sequence: the 8B's and the 30B-A3B's attention."""
EXPERTS = (128, 2048, 768, 65_536)
"""Experts, model width, expert width, routed rows: the 30B-A3B's experts for one sequence."""
COPY_BYTES = 2 * 1024**3
CASTING_ELEMENTS = 2**28
"""A float32 accumulator of 1 GiB and its bfloat16 gradient: large enough that the rate, not the
launch, is timed (a Qwen3-30B-A3B layer's routed experts hold 604M values on one rank, 75M on
each of 8 EP ranks)."""
QUERY_NORM = (8192 * 32, 128)
"""Rows and width of the 30B-A3B's per-head query norm over one sequence (32 heads of 128)."""


def timed_ms(fn: Callable[..., Any], cpu: bool, repeats: int = 10) -> float:
    """Median milliseconds of ``repeats`` calls after three untimed ones (allocation, autotuning);
    on the CPU (the rehearsal) of three after one."""
    import torch

    warm, repeats = (1, 3) if cpu else (3, repeats)  # the rehearsal shows that each probe runs
    for _ in range(warm):
        fn()
    samples = []
    for _ in range(repeats):
        if cpu:
            start = time.perf_counter()
            fn()
            samples.append(1000 * (time.perf_counter() - start))
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


def gemm(cpu: bool) -> dict[str, dict[str, float]]:
    """FLOP/s of each shape class's dense matmul on random data."""
    import torch

    from trainer.simulation.calibration import GEMM_PROBES

    device, dtype, scale = ("cpu", torch.float32, 16) if cpu else ("cuda", torch.bfloat16, 1)
    results = {}
    for cls, (m, n, k) in GEMM_PROBES.items():
        m, n, k = m // scale, n // scale, k // scale
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        ms = timed_ms(lambda a=a, b=b: a @ b, cpu)
        results[cls] = {"m": m, "n": n, "k": k, "ms": ms, "flops": 2 * m * n * k / ms * 1e3}
    return results


def float8_gemm(cpu: bool) -> dict[str, float]:
    """FLOP/s of the large class's matmul in float8 (``torch._scaled_mm``, e4m3 operands with one
    scale each, bf16 out: the tensorwise recipe's forward kernel)."""
    import torch

    from trainer.simulation.calibration import GEMM_PROBES

    m, n, k = (d // (64 if cpu else 1) for d in GEMM_PROBES["large"])  # the CPU emulates float8: slowly
    device = "cpu" if cpu else "cuda"
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as the kernel takes it
    one = torch.ones((), device=device)
    ms = timed_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), cpu)
    return {"m": m, "n": n, "k": k, "ms": ms, "flops": 2 * m * n * k / ms * 1e3}


def attention(cpu: bool) -> dict[str, float]:
    """FLOP/s of the model's causal attention, forward and backward, counted as the cost model
    counts it (half the score and value products of the full square)."""
    import torch

    from trainer.model.llama3 import causal_attention

    heads, kv_heads, head_dim, seq = ATTENTION
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    seq = 256 if cpu else seq
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def step() -> None:
        causal_attention(q, k, v, None).backward(grad)

    ms = timed_ms(step, cpu)
    flops = (4 + 10) * heads * seq * seq * head_dim // 2
    return {"seq": seq, "ms": ms, "flops": flops / ms * 1e3}


def grouped_gemm(cpu: bool) -> dict[str, float]:
    """FLOP/s of the experts' SwiGLU forward through the grouped matmul (its three products;
    the elementwise product between them is in the time)."""
    import torch

    from trainer.model.routed_experts import grouped_swiglu

    n_experts, dim, hidden, rows = (8, 256, 256, 1024) if cpu else EXPERTS
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    skew = torch.rand(n_experts, generator=generator) ** 3 + 0.02  # uneven, as routing is
    counts = (skew / skew.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    x = torch.randn(rows, dim, generator=generator).to(device=device, dtype=dtype)
    w1 = (0.02 * torch.randn(n_experts, hidden, dim, generator=generator)).to(device=device, dtype=dtype)
    w3 = (0.02 * torch.randn(n_experts, hidden, dim, generator=generator)).to(device=device, dtype=dtype)
    w2 = (0.02 * torch.randn(n_experts, dim, hidden, generator=generator)).to(device=device, dtype=dtype)
    counts = counts.to(device)
    with torch.no_grad():
        ms = timed_ms(lambda: grouped_swiglu(x, counts, w1, w2, w3), cpu)
    flops = 3 * 2 * rows * dim * hidden
    return {"experts": n_experts, "dim": dim, "hidden": hidden, "rows": rows, "ms": ms, "flops": flops / ms * 1e3}


def copy(cpu: bool) -> dict[str, float]:
    """Bytes read and written per second by a device-to-device copy."""
    import torch

    size = COPY_BYTES // (64 if cpu else 1)
    source = torch.empty(size, dtype=torch.uint8, device="cpu" if cpu else "cuda")
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), cpu)
    return {"bytes": size, "ms": ms, "bytes_per_s": 2 * size / ms * 1e3}


def casting(cpu: bool) -> dict[str, float]:
    """Bytes per second of the two eager kernels that cast each element (CUDA's unrolled
    elementwise kernel, ``trainer/simulation/eager_kernels.py``): the float32 accumulation of a
    bfloat16 gradient (``acc += grad``: 10 bytes an element) and a bfloat16 -> float32 copy
    (6 bytes), together and each on its own."""
    import torch

    n = CASTING_ELEMENTS // (64 if cpu else 1)
    device = "cpu" if cpu else "cuda"
    accumulator = torch.zeros(n, device=device)
    grad = torch.ones(n, device=device, dtype=torch.bfloat16)
    upcast = torch.empty(n, device=device)
    add_ms = timed_ms(lambda: accumulator.add_(grad), cpu)
    cast_ms = timed_ms(lambda: upcast.copy_(grad), cpu)
    return {
        "elements": n,
        "add_ms": add_ms,
        "cast_ms": cast_ms,
        "add_bytes_per_s": 10 * n / add_ms * 1e3,
        "cast_bytes_per_s": 6 * n / cast_ms * 1e3,
        "bytes_per_s": 16 * n / (add_ms + cast_ms) * 1e3,
    }


def rms_norm(cpu: bool) -> dict[str, float]:
    """Bytes per second of ``nn.RMSNorm`` forward and backward at the query norm's shape, over
    the least a fused kernel moves: seven passes over the activations (forward reads the input
    and writes the output; backward's input gradient reads the gradient and the input and writes
    its result, the weight gradient reads both again). On CUDA torch runs it fused
    (``_fused_rms_norm``); ``--simulate`` traces the CPU's float32 composite, which moved about
    thirteen times these bytes on the Qwen3-30B-A3B preset. Whether rows of 128 values reach the
    copy's rate decides what the fused kernel costs; the CPU's rehearsal runs the composite."""
    import torch

    rows, dim = QUERY_NORM
    device, dtype, rows = ("cpu", torch.float32, rows // 64) if cpu else ("cuda", torch.bfloat16, rows)
    norm = torch.nn.RMSNorm(dim, eps=1e-6, device=device, dtype=dtype)
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    ms = timed_ms(lambda: torch.autograd.grad(norm(x), (x, norm.weight), grad), cpu)
    passes = 7 * x.numel() * x.element_size()
    return {"rows": rows, "dim": dim, "ms": ms, "bytes": passes, "bytes_per_s": passes / ms * 1e3}


def calibrate(cpu: bool, gpu: str, target: str) -> dict[str, Any]:
    """Every probe, as the calibration file's fields (``Calibration`` and its ``target``)."""
    import torch

    probes: dict[str, Any] = {
        "gemm": gemm(cpu),
        "float8_gemm": float8_gemm(cpu),
        "attention": attention(cpu),
        "grouped_gemm": grouped_gemm(cpu),
        "copy": copy(cpu),
        "casting": casting(cpu),
        "rms_norm": rms_norm(cpu),
    }
    if not cpu:
        torch.cuda.empty_cache()
    return {
        "target": target,
        "gpu": gpu,
        "torch": torch.__version__,
        "measured": f"{datetime.date.today()}, the device check's probes (scripts/gpu/calibrate.py)",
        "gemm_flops": {cls: p["flops"] for cls, p in probes["gemm"].items()},
        "attention_flops": probes["attention"]["flops"],
        "grouped_gemm_flops": probes["grouped_gemm"]["flops"],
        "hbm_bytes_per_s": probes["copy"]["bytes_per_s"],
        "float8_gemm_flops": probes["float8_gemm"]["flops"],
        "casting_bytes_per_s": probes["casting"]["bytes_per_s"],
        "probes": probes,
    }


Line = tuple[str, str, str, str, dict[str, Any]]
"""A row of the check: what, its setting, the figure measured, what it is read against, the raw figures."""


def probe_rows(figures: dict[str, Any], peak: float, fp8_peak: float, file: str) -> list[Line]:
    """The check's rows of :func:`calibrate`'s ``figures``: each rate, and its fraction of the
    peak (``peak``, ``fp8_peak``: FLOP/s) or of the copy's rate (which ``file`` now holds)."""
    probes = figures["probes"]
    lines: list[Line] = []
    for cls, probe in probes["gemm"].items():
        shape, rate = f"{probe['m']} x {probe['n']} x {probe['k']}", probe["flops"]
        lines.append((f"probe matmul {cls}", shape, f"{rate / 1e12:.0f} TFLOP/s", f"{rate / peak:.2f} of peak", probe))
    probe = probes["float8_gemm"]
    shape, rate = f"{probe['m']} x {probe['n']} x {probe['k']}, e4m3, one scale per operand", probe["flops"]
    fraction = f"{rate / fp8_peak:.2f} of the float8 peak"
    lines.append(("probe float8 matmul", shape, f"{rate / 1e12:.0f} TFLOP/s", fraction, probe))
    heads, kv_heads, head_dim, _ = ATTENTION
    for name, key in (("attention", "attention"), ("grouped matmul", "grouped_gemm")):
        probe = probes[key]
        shape = (
            f"causal, {heads}/{kv_heads} heads x {head_dim}, seq {probe['seq']:.0f}, forward + backward"
            if key == "attention"
            else f"{probe['experts']:.0f} experts {probe['dim']:.0f} -> {probe['hidden']:.0f}, "
            f"{probe['rows']:,.0f} rows, SwiGLU forward"
        )
        measured = f"{probe['flops'] / 1e12:.0f} TFLOP/s, {probe['ms']:.2f} ms"
        lines.append((f"probe {name}", shape, measured, f"{probe['flops'] / peak:.2f} of peak", probe))
    copied = probes["copy"]
    read_written = f"{copied['bytes_per_s'] / 1e12:.2f} TB/s read + written"
    lines.append(("probe copy", f"{copied['bytes'] / 2**30:.0f} GiB device to device", read_written, file, copied))
    cast = probes["casting"]
    shape = f"fp32 += bf16 and a bf16 -> fp32 copy, {cast['elements']:,} elements"
    measured = f"{cast['bytes_per_s'] / 1e12:.2f} TB/s (add {cast['add_ms']:.2f} ms, copy {cast['cast_ms']:.2f} ms)"
    lines.append(
        ("probe casting", shape, measured, f"{cast['bytes_per_s'] / copied['bytes_per_s']:.2f} of the copy's", cast)
    )
    norm = probes["rms_norm"]
    shape = f"{norm['rows']:,} rows x {norm['dim']}, forward + backward"
    measured = f"{norm['bytes_per_s'] / 1e12:.2f} TB/s over its 7 passes, {norm['ms']:.2f} ms"
    lines.append(
        ("probe RMSNorm", shape, measured, f"{norm['bytes_per_s'] / copied['bytes_per_s']:.2f} of the copy's", norm)
    )
    return lines


def write(calibration: dict[str, Any], folder: Path) -> Path:
    path = folder / f"{calibration['target']}.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=2) + "\n")
    return path
