"""Private ops and switches: multi-tensor kernels, the grouped matmul, attention ops, async TP, CUDA
memory history, whether autograd is running a backward (activation checkpointing recomputes) and an
op that counts only outside it, what compile traced, and selective checkpointing's dispatch modes."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.utils.checkpoint import (
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _is_compiling,
    create_selective_checkpoint_contexts,
)

FEATURE = "the gradient finalize, the experts' grouped matmul, activation checkpointing and the profiler"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = (
    "_foreach_norm",
    "_foreach_mul_",
    "_foreach_copy_",
    "_foreach_add_",
    "_dynamo",
    "_grouped_mm",
    "_scaled_mm",
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
    "_CachedTorchDispatchMode",
    "_CachingTorchDispatchMode",
    "_is_compiling",
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
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
"""The functional all-to-all, with or without autograd (expert parallelism's exchanges, Ulysses)."""
GROUPED_MM = _aten._grouped_mm.default
SCALED_MM = _aten._scaled_mm.default
"""The float8 matmul (``parallelisms/float8.py``)."""


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


@torch.library.custom_op("meshtrain::add_unless_in_backward", mutates_args=("targets",))
def add_unless_in_backward(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets += sources`` unless :func:`in_backward`: an MoE layer's routing counts, once per
    real forward. An op rather than a Python branch, so that ``torch.compile`` traces the block in
    one graph and the check runs when the graph does (a recomputation inside backward included)."""
    if not in_backward():
        torch._foreach_add_(targets, sources)


@add_unless_in_backward.register_fake
def _(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    return None


def compiled_graphs() -> tuple[int, dict[str, int]]:
    """What ``torch.compile`` has traced in this process so far: its distinct graphs, and its
    graph breaks by the first line of their reason."""
    from torch._dynamo.utils import counters

    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        first = (str(reason).strip().splitlines() or ["unknown"])[0]
        breaks[first] = breaks.get(first, 0) + count
    return counters["stats"]["unique_graphs"], breaks


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


class _SavedOnly:
    """Selective checkpointing's dispatch mode, blind to every op it does not save."""

    saved: Collection[Any] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.saved and not _is_compiling(func, args, kwargs):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]


class _SavingForward(_SavedOnly, _CachingTorchDispatchMode):
    pass


class _SavedRecompute(_SavedOnly, _CachedTorchDispatchMode):
    pass


def saving_checkpoint_contexts(saved: Collection[Any]) -> tuple[Any, Any]:
    """The forward and recomputation contexts of selective checkpointing that keeps the outputs
    of the ``saved`` ops and reruns every other op.

    torch's own contexts number every op in the region and fail when the recomputation runs an
    op more often than the forward did, although only the saved ops' numbers matter (the
    recomputation takes the n-th saved output of an op for its n-th call). Ops outside the model
    do differ between the two: a nested FSDP unit's hooks (its backward prefetch opens a
    ``record_function`` range, and may all-gather, only during recomputation), a profiler's
    ranges. Here only the saved ops are counted and matched. Under ``torch.compile`` torch's
    modes see every op, as they tag the traced graph. Built by torch's own function, then given
    this behaviour, so that the storage the two share stays torch's, whatever its shape."""
    forward, recompute = create_selective_checkpoint_contexts(list(saved))
    forward.__class__, recompute.__class__ = _SavingForward, _SavedRecompute
    forward.saved = recompute.saved = frozenset(saved)
    return forward, recompute
