"""How long a simulated rank's step would take on the target: an estimate from the traced ops.

:class:`CostRecorder` watches the ops of one step (a :class:`MemoryTracker` observer) and adds up
what the target's time depends on: matmul and attention FLOPs, the bytes the other ops read and
write, and every collective with its process group (so its mesh dimension and whether it
crosses nodes). ``step_time.py`` turns them into seconds. Nothing here is measured on the target: it is what
the real code asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from parallelisms.torch_private import dtensor
from parallelisms.torch_private.fake import process_group_name, tree_map_only
from trainer.simulation.calibration import gemm_class
from trainer.simulation.eager_kernels import casts_each_element
from trainer.simulation.fusion import Fusion, nbytes, storage
from trainer.simulation.memory_tracker import tensors_in

FSDP_DIMS = ("dp_shard_cp", "dp_replicate", "expert_shard", "dp_shard_cp_tp")
"""FSDP's groups: the routed experts' (``expert_shard``, under expert parallelism) and, under
tensor parallelism, the unit of MoE parameters replicated over TP (``dp_shard_cp_tp``) included."""
KINDS = {
    "all_gather": ("allgather", "all_gather", "_allgather_base"),
    "reduce_scatter": ("reduce_scatter", "_reduce_scatter_base"),
    "all_reduce": ("allreduce", "all_reduce"),
    "all_to_all": ("alltoall", "all_to_all"),
    "send": ("send",),
    "recv": ("recv",),
    "broadcast": ("broadcast",),
}
ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu": 4,
    "_scaled_dot_product_flash_attention": 4,
    "_scaled_dot_product_efficient_attention": 4,
    "_scaled_dot_product_cudnn_attention": 4,
}
ATTENTION_BACKWARD = {name + "_backward": 10 for name in ATTENTION_FORWARD}
"""FLOPs per (batch x head x query x key x head_dim): forward QK^T and PV; backward recomputes
the scores and forms four more products."""
GROUPED_MM = "_grouped_mm"
SCALED_MM = "_scaled_mm"
"""The experts' grouped matmul, which torch's FLOP counter does not know."""


@dataclass
class GroupInfo:
    dim: str
    size: int
    crosses_nodes: bool


@dataclass
class Collective:
    kind: str
    dim: str
    size: int
    bus_bytes: int
    crosses_nodes: bool
    times: float = 1.0
    """How many of it the step runs: more than one (or a fraction) where a traced micro-batch
    stands for micro-batches not traced (``microbatches.py``)."""
    under: TracedCost | None = None
    """What the rank computed while this collective was in flight: a functional collective
    started and waited for later (``parallelisms/async_exchange.py``) hides under it."""


@dataclass
class Cost:
    """One row of a step's breakdown: FLOPs and memory traffic, eager and as compile fuses it."""

    flops: float = 0.0
    memory_bytes: float = 0.0
    fused_bytes: float = 0.0
    casting_bytes: float = 0.0
    """The part of ``memory_bytes`` that eager kernels casting each element move (``eager_kernels.py``)."""
    fused_casting_bytes: float = 0.0
    """The same part of ``fused_bytes``: such ops outside the compiled regions."""

    def add(self, other: Cost, weight: float = 1.0) -> None:
        self.flops += weight * other.flops
        self.memory_bytes += weight * other.memory_bytes
        self.fused_bytes += weight * other.fused_bytes
        self.casting_bytes += weight * other.casting_bytes
        self.fused_casting_bytes += weight * other.fused_casting_bytes


@dataclass
class TracedCost:
    flops: int = 0
    fp8_flops: int = 0
    """The part of ``flops`` in float8 matmuls (``_scaled_mm``), timed at the float8 peak."""
    memory_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)
    fused_bytes: int = 0
    """``memory_bytes`` as compile would move them (:class:`Fusion`)."""
    casting_bytes: int = 0
    """The part of ``memory_bytes`` moved by eager kernels that cast each element (``Cost``)."""
    fused_casting_bytes: int = 0
    """The same part of ``fused_bytes``."""
    flops_by_kind: dict[str, int] = field(default_factory=dict)
    """The FLOPs by kernel kind (``calibration.KINDS``), each timed at its own measured rate."""
    host_bytes: int = 0
    """Bytes copied between the device and host memory, both ways (held forwards in host memory:
    ``trainer/step/host_offload.py``), by copy engines beside the kernels."""
    by_op: dict[str, Cost] = field(default_factory=dict)
    by_module: dict[str, Cost] = field(default_factory=dict)
    """Where the cost arose: ``phase module[/moe part]`` (``CostRecorder.where``)."""

    def record(self, op: str, where: str, cost: Cost, kind: str = "", weight: float = 1.0, fp8: bool = False) -> None:
        if fp8:
            self.fp8_flops += round(weight * cost.flops)
        if kind:
            self.flops_by_kind[kind] = self.flops_by_kind.get(kind, 0) + round(weight * cost.flops)
        self.flops += round(weight * cost.flops)
        self.memory_bytes += round(weight * cost.memory_bytes)
        self.fused_bytes += round(weight * cost.fused_bytes)
        self.casting_bytes += round(weight * cost.casting_bytes)
        self.fused_casting_bytes += round(weight * cost.fused_casting_bytes)
        self.by_op.setdefault(op, Cost()).add(cost, weight)
        self.by_module.setdefault(where, Cost()).add(cost, weight)

    def add_scaled(self, other: TracedCost, weight: float) -> None:
        """Add ``weight`` x ``other``'s FLOPs and bytes (not its collectives)."""
        self.flops += round(weight * other.flops)
        self.memory_bytes += round(weight * other.memory_bytes)
        self.fused_bytes += round(weight * other.fused_bytes)
        self.casting_bytes += round(weight * other.casting_bytes)
        self.fused_casting_bytes += round(weight * other.fused_casting_bytes)
        self.fp8_flops += round(weight * other.fp8_flops)
        self.host_bytes += round(weight * other.host_bytes)
        for kind, flops in other.flops_by_kind.items():
            self.flops_by_kind[kind] = self.flops_by_kind.get(kind, 0) + round(weight * flops)
        for mine, theirs in ((self.by_op, other.by_op), (self.by_module, other.by_module)):
            for key, cost in theirs.items():
                mine.setdefault(key, Cost()).add(cost, weight)

    def comm_bytes(self) -> dict[str, int]:
        by_dim: dict[str, int] = {}
        for c in self.collectives:
            if c.kind != "recv":
                by_dim[c.dim] = by_dim.get(c.dim, 0) + round(c.bus_bytes * c.times)
        return by_dim


@dataclass
class MicrobatchCosts:
    """A step's cost in all, and the part of it each traced micro-batch ran (the rest ran outside them)."""

    total: TracedCost = field(default_factory=TracedCost)
    per_microbatch: dict[int, TracedCost] = field(default_factory=dict)
    first_collective: dict[int, int] = field(default_factory=dict)
    """Micro-batch -> where its first collective lies in ``total.collectives``."""


MOVES_NO_DATA = ("empty", "detach", "_local", "_unsafe_view")
"""Aten ops, not tagged as views, that allocate or reinterpret without reading or writing:
``_unsafe_view`` is the reshape of a matmul's result (``aten.matmul`` of a 3-D input)."""


def group_infos(groups: dict[str, dist.ProcessGroup], gpus_per_node: int) -> dict[str, GroupInfo]:
    """Process group name -> its mesh dimension, size and whether its ranks span nodes."""
    infos: dict[str, GroupInfo] = {}
    for dim, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        nodes = {r // gpus_per_node for r in ranks}
        infos.setdefault(group.group_name, GroupInfo(dim, len(ranks), len(nodes) > 1))
    return infos


def _gemm_kind(flops: int, out: Any) -> str:
    """A dense matmul's shape class from its FLOPs and its output ``(..., M, N)``: ``K`` is what
    the FLOPs leave, and batched products count their batch in ``M``."""
    results = [dtensor.local_tensor(t) if isinstance(t, DTensor) else t for t in tensors_in(out)]
    result = results[0] if results else None
    if result is None or result.dim() < 2 or not result.numel():
        return "gemm_large"
    n = result.shape[-1]
    m = result.numel() // n
    return f"gemm_{gemm_class(m, n, max(1, flops // (2 * m * n)))}"


class CostRecorder:
    """Adds up one step's FLOPs, memory traffic and collectives while ``enabled``, in all and
    for the micro-batch running (``microbatch``; see ``microbatches.py``)."""

    def __init__(self, groups: dict[str, GroupInfo]):
        self.groups = groups
        self.enabled = False
        self.microbatch: int | None = None
        self.costs = MicrobatchCosts()
        self.where: Callable[[], tuple[str, bool]] = lambda: ("", False)
        """Where the running op is (a row of the breakdown) and whether compile would trace it."""
        self.after_graph: Callable[[Any, Any], bool] = lambda func, out: False
        """Whether the op (``func``, ``out``) is eager work on a compiled graph's outputs once the
        graph has run (autograd's gradient accumulation), which the fake job runs among its ops."""
        self.fusion = Fusion[tuple[str, str]]()
        self._in_flight: dict[int, TracedCost] = {}
        """Functional collectives not yet waited for (by their result's storage) -> what ran since."""

    @property
    def cost(self) -> TracedCost:
        return self.costs.total

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if not self.enabled:
            return
        name = func.__name__.split(".")[0]
        flops = memory = 0
        kind = ""
        if func.namespace in ("c10d", "_c10d_functional"):
            if name == "wait_tensor":
                self._in_flight.pop(id(storage(args[0])), None)
            else:
                self._collective(name, args, out, functional=func.namespace == "_c10d_functional")
        elif func.overloadpacket in flop_registry or name in (*ATTENTION_FORWARD, *ATTENTION_BACKWARD, GROUPED_MM):
            # A DTensor op computes on the local shards: count with their shapes. (``to_local``
            # would dispatch an op of its own per tensor, through every mode.)
            args, kwargs, out = tree_map_only(DTensor, dtensor.local_tensor, (args, kwargs, out))
            attention = name in (*ATTENTION_FORWARD, *ATTENTION_BACKWARD)
            # Attention first: torch's counter (which has the CPU flash kernels from 2.15 on)
            # counts a causal attention's masked half too.
            if attention:
                flops = _attention_flops(name, args, kwargs)
            elif name == GROUPED_MM:
                flops = _grouped_mm_flops(args[0], args[1])
            else:
                flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            kind = "attention" if attention else "grouped_gemm" if name == GROUPED_MM else _gemm_kind(flops, out)
        elif func.namespace == "aten" and not func.is_view and not name.startswith(MOVES_NO_DATA):
            memory = nbytes(args) + nbytes(out)
        if not (flops or memory):
            return
        fp8 = bool(flops) and (name == SCALED_MM or any(map(_is_float8, tensors_in(args))))
        where, compiled = self.where()
        after = bool(memory) and self.after_graph(func, out)
        compiled = compiled and not after
        fused = self.fusion.bytes(func, args, out, memory, compiled and not flops, (name, where), after)
        casting = memory if memory and casts_each_element(func, args, out) else 0
        cost = Cost(flops, memory, fused.nbytes, casting, 0 if compiled else casting)
        for traced in (*self._costs(), *self._in_flight.values()):
            traced.record(name, where, cost, "" if fp8 else kind, fp8=fp8)
            for (op, made_where), written in fused.corrections:
                traced.record(op, made_where, Cost(fused_bytes=written))

    def host_copy(self, nbytes: int) -> None:
        """A copy between the device and host memory (``trainer/step/host_offload.py``), which no op reports."""
        if self.enabled:
            for cost in self._costs():
                cost.host_bytes += nbytes

    def _costs(self) -> list[TracedCost]:
        if self.microbatch is None:
            return [self.costs.total]
        return [self.costs.total, self.costs.per_microbatch.setdefault(self.microbatch, TracedCost())]

    def _collective(self, name: str, args: tuple, out: Any, functional: bool) -> None:
        kind = next((k for k, names in KINDS.items() if name.startswith(names)), None)
        if kind is None or name.startswith("wait"):
            return
        info = self._group(args)
        if info is None:
            return
        full = max([nbytes(a) for a in args] + [nbytes(out)])
        n = info.size
        if kind in ("send", "recv", "broadcast"):
            bus = full
        else:
            bus = full * (n - 1) // n * (2 if kind == "all_reduce" else 1)
        # FSDP exchanges nothing all-to-all: one on its group is Muon's exchange of whole matrices
        # at the optimizer step, or else expert parallelism's token exchange over the same ranks
        # (ep = dp_shard); both exposed, not hidden under compute.
        dim = info.dim
        if kind == "all_to_all" and info.dim in FSDP_DIMS:
            dim = "optimizer" if self.where()[0].startswith("optimizer") else "ep"
        if self.microbatch is not None:
            self.costs.first_collective.setdefault(self.microbatch, len(self.costs.total.collectives))
        under = None
        if functional and isinstance(out, torch.Tensor):
            under = self._in_flight[id(storage(out))] = TracedCost()
        for cost in self._costs():
            cost.collectives.append(Collective(kind, dim, n, bus, info.crosses_nodes, under=under))

    def _group(self, args: tuple) -> GroupInfo | None:
        """The group a collective runs on: a name (functional collectives) or a process group
        boxed as a TorchScript object (``c10d`` ops)."""
        for a in args:
            name = process_group_name(a) or a
            if isinstance(name, str) and name in self.groups:
                return self.groups[name]
        return None


def _is_float8(value: Any) -> bool:
    """A float8 operand: torchao's float8 tensor (its matmul, seen here before the subclass turns it
    into ``_scaled_mm``) or a float8 dtype."""
    return isinstance(value, torch.Tensor) and (
        type(value).__name__ == "Float8TrainingTensor" or value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    )


def _grouped_mm_flops(a: Any, b: Any) -> int:
    """Every row of ``a`` meets one group's matrix: ``2 x a's elements x b's columns`` for the
    experts' forward (``(tokens, dim) x (experts, dim, hidden)``) and their input gradient, and
    for the weight gradient (``(dim, tokens) x (tokens, hidden)``, grouped along the tokens)."""
    groups = a.shape[0] if a.dim() == 3 and b.dim() == 2 else 1
    return 2 * a.numel() * b.shape[-1] // groups


def _attention_flops(name: str, args: tuple, kwargs: dict) -> int:
    """Attention FLOPs from the query and key shapes; causal counts half the score matrix."""
    backward = name.endswith("_backward")
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    batch, heads, queries, head_dim = q.shape
    keys = k.shape[-2]
    causal = kwargs.get("is_causal", False) or any(a is True for a in args[3:])
    per = (ATTENTION_BACKWARD if backward else ATTENTION_FORWARD)[name]
    flops = per * batch * heads * queries * keys * head_dim
    return flops // 2 if causal else flops
