"""The hardware table every estimate reads: each GPU's figures, and what a process holds
whatever the model.

The planner compares its memory estimate with a GPU's memory, the metrics divide by its bf16
peak for MFU, and the simulator times a step with its peak and bandwidths: one table, so the
three never disagree. Figures are per GPU, from the vendors' data sheets (SXM parts, dense bf16
without sparsity); ``memory_bytes`` is what ``torch.cuda.get_device_properties().total_memory``
reports, a little less than the marketed size. A leaf: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


def gib(n: float) -> str:
    """``n`` bytes as the reports print them."""
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class Gpu:
    memory_bytes: int
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per direction, between two GPUs of a node."""
    network_bytes_per_s: float
    """Per GPU, between nodes (one NIC per GPU)."""
    fp8_flops: float = 0.0
    """Dense float8 tensor-core peak, FLOP/s; 0: no float8 tensor cores (float8 matmuls run at ``bf16_flops``)."""
    host_bytes_per_s: float = 64e9
    """Per direction, the GPU's link to host memory: PCIe Gen5 x16 (A100's Gen4: 32 GB/s)."""


GPUS: dict[str, Gpu] = {
    "h100": Gpu(85_029_158_912, 989e12, 3.35e12, 450e9, 400e9 / 8, fp8_flops=1979e12),
    "h200": Gpu(150_754_820_096, 989e12, 4.8e12, 450e9, 400e9 / 8, fp8_flops=1979e12),
    "a100": Gpu(85_089_697_792, 312e12, 2.0e12, 300e9, 200e9 / 8, host_bytes_per_s=32e9),
    "b200": Gpu(183_359 * 1024**2, 2.25e15, 8.0e12, 900e9, 400e9 / 8, fp8_flops=4.5e15),
}
"""The GPUs a job can be planned and simulated for (``--target-gpu NAME``)."""

PEAK_BF16_FLOPS: dict[tuple[str, ...], float] = {
    ("H100", "NVL"): 835e12,
    ("H100", "PCIe"): 756e12,
    ("H100",): GPUS["h100"].bf16_flops,
    ("H200",): GPUS["h200"].bf16_flops,
    ("A100",): GPUS["a100"].bf16_flops,
    ("B200",): GPUS["b200"].bf16_flops,
}
"""Dense bf16 peaks by device name, for MFU. Keys are substrings that must all appear in
``torch.cuda.get_device_name()`` (case-insensitive). The first matching entry wins, so variants
that share a family name with a faster part (H100 NVL/PCIe vs. SXM) come first."""

RUNTIME_BYTES = {"cpu": int(0.40 * GIB), "cuda": int(1.5 * GIB)}
"""Held whatever the model: on a GPU the CUDA context and NCCL's buffers; on the CPU the
process's own memory (the interpreter, torch's libraries: those of its CPU build)."""

CUDA_BUILD_ON_CPU_BYTES = int(0.35 * GIB)
"""What a CUDA build of torch adds to a CPU process: its CUDA and Triton libraries' resident pages
and data, mapped even with no GPU (after the trainer's imports, 0.35 GiB over the CPU build's on
torch 2.13, 0.37 on 2.15: the build, not the release)."""


def runtime_bytes(device: str, cuda_build: bool) -> int:
    """What a process on ``device`` holds whatever the model, with a CUDA build of torch or not."""
    device = device if device in RUNTIME_BYTES else "cpu"
    return RUNTIME_BYTES[device] + (CUDA_BUILD_ON_CPU_BYTES if cuda_build and device == "cpu" else 0)


ALLOCATOR_SLACK = {"cpu": 0.45, "cuda": 0.1}
"""Memory the allocator holds beyond the live tensors, as a fraction of the peak's activations."""
