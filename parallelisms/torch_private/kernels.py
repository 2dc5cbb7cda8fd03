"""Private ops and switches: multi-tensor kernels, the grouped matmul, attention ops, async TP, CUDA
memory history, and whether autograd is running a backward (activation checkpointing recomputes)."""

from __future__ import annotations

import torch

FEATURE = "the gradient finalize, the experts' grouped matmul, activation checkpointing and the profiler"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")
NAMES = (
    "_foreach_norm",
    "_foreach_mul_",
    "_foreach_copy_",
    "_grouped_mm",
    "_C",
    "_current_graph_task_id",
    "_autograd",
    "_profiler_enabled",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional",
    "_inductor",
    "_micro_pipeline_tp",
    "_symmetric_memory",
    "enable_symm_mem_for_group",
    "_record_memory_history",
    "_snapshot",
)

_aten = torch.ops.aten
ATTENTION_OPS = (
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
)
"""SDPA's kernels, one op each."""
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in float32, in one multi-tensor kernel."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``scale``, in one multi-tensor kernel."""
    torch._foreach_mul_(tensors, scale)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    torch._foreach_copy_(targets, sources)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a``'s rows cut at ``offsets`` (int32 cumulative ends), group ``g`` times ``b[g]``: one
    kernel for every expert's matmul (CUDA sm90+ in bfloat16; torch 2.13's CPU forward matches a
    loop, but its backward rejects broadcast gradients)."""
    return torch._grouped_mm(a, b, offs=offsets)


def profiler_enabled() -> bool:
    """Whether a torch.profiler is recording on this thread: a ``record_function`` range costs
    microseconds even when none is, so ranges that only a trace reads open only then."""
    return torch._C._autograd._profiler_enabled()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward that runs now is
    activation checkpointing's recomputation, which must not count anything twice."""
    return torch._C._current_graph_task_id() != -1


def enable_async_tp(group: torch.distributed.ProcessGroup) -> None:
    """Let ``torch.compile`` overlap TP's matmuls with their collectives over symmetric memory."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group.group_name)


def record_cuda_memory_history() -> None:
    torch.cuda.memory._record_memory_history(max_entries=100_000)


def cuda_memory_snapshot() -> object:
    return torch.cuda.memory._snapshot()
