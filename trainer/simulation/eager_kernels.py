"""Which CUDA elementwise kernel an eager op launches: the vectorized one, or the unrolled one that
casts every element as it loads and stores it, and so moves the same bytes more slowly.

ATen vectorizes an elementwise op (wide loads and stores) only when every operand has the dtype
the op computes in. An op that mixes dtypes (``fp32 += bf16``) needs a cast per element and
takes ``launch_unrolled_kernel`` on CUDA (``gpu_kernel_impl`` in ``ATen/native/cuda/CUDALoops.cuh``;
only ROCm has a vectorized kernel for float32 mixed with bfloat16). Copies that change the dtype
take the same generic path (``direct_copy_kernel_cuda`` in ``Copy.cu``), except float32 ->
bfloat16 / float16 and float8 targets, which have conversion kernels of their own: a bfloat16 ->
float32 copy is unrolled, its reverse is not. The second device check's eager MoE step spent 146
and 98 ms of its 1,818 ms of kernels in two unrolled kernels, an add and a direct copy by their
names (docs/performance.md): the fp32 accumulation of each micro-batch's bf16 gradients and the
bf16 -> fp32 upcasts are such ops. The cost model times these bytes at the rate the device check
probes (``Calibration.casting_bytes_per_s``). A compiled region has none: Inductor converts in
registers after vectorized loads.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.simulation.memory_tracker import tensors_in

COPIES = ("_to_copy", "copy_", "copy", "_foreach_copy_")
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def casts_each_element(func: Any, args: tuple, out: Any) -> bool:
    """Whether eager CUDA would run this op through the unrolled, casting elementwise kernel: a
    copy that converts other than float32 -> half types or into float8, or a pointwise op whose
    floating-point tensors (0-dim ones aside: CUDA passes those as scalars) have several dtypes."""
    name = func.__name__.split(".")[0]
    if name in COPIES:
        return any(_copy_casts(source, target) for source, target in _copy_pairs(name, args, out))
    if torch.Tag.pointwise not in func.tags:
        return False
    dtypes = {t.dtype for t in tensors_in((args, out)) if t.dim() > 0 and t.is_floating_point()}
    return len(dtypes) > 1


def _copy_pairs(name: str, args: tuple, out: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(source, target)`` of each tensor a copy op converts."""
    if name == "_to_copy":
        return [(args[0], out)]
    if name == "_foreach_copy_":
        return list(zip(args[1], args[0], strict=True))
    return [(args[1], args[0] if name == "copy_" else out)]


def _copy_casts(source: torch.Tensor, target: torch.Tensor) -> bool:
    if source.dtype == target.dtype or target.dtype in FLOAT8:
        return False
    return not (source.dtype == torch.float32 and target.dtype in (torch.bfloat16, torch.float16))
