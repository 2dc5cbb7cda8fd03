"""A simulated rank's step in seconds on the target: :func:`step_time` times what
``cost_model.py`` traced under the model :data:`ASSUMPTIONS` states (the report prints it), at
the rates of the target's calibration (``calibration.py``), else its data sheet's x efficiencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.pipeline_split import BUBBLE_FRACTION
from trainer.simulation.cost_model import FSDP_DIMS, Collective, Cost, TracedCost
from trainer.simulation.targets import Target

ASSUMPTIONS = (
    "compute: traced matmul and attention FLOPs at the rates the target's calibration measured on that GPU "
    "(trainer/simulation/calibrations/: dense matmuls by shape class, attention, the grouped matmul), a kind "
    "it has not measured at the dense bf16 peak x `efficiency`; float8 matmuls at their measured rate, else at the "
    "float8 peak x the fraction of its peak the large bf16 matmul measured (x `efficiency` without a calibration); "
    "causal attention counts half its score and "
    "value matmuls (flash kernels skip the masked blocks)",
    "memory-bound ops: bytes every other op reads and writes at the calibration's measured copy bandwidth "
    "(else the HBM bandwidth x `hbm_efficiency`), not overlapped with the matmuls; an eager op that casts each "
    "element (mixed float dtypes, such as fp32 += bf16, or a bf16 -> fp32 copy: CUDA's unrolled kernel, "
    "trainer/simulation/eager_kernels.py) at the calibration's measured casting rate, else the copy's; per-kernel launch costs "
    "are not modelled; with `compile.enable` (the blocks and the loss compiled), chains of elementwise "
    "ops and the reductions along some dimensions among them (a norm, softmax, the loss, a row-wise float8 "
    "scale) inside a block or the loss count as one fused kernel that loads each input once and writes an "
    "intermediate only if a later kernel reads it, the rest as eager; fusion into matmul epilogues and "
    "common-subexpression elimination are not modelled",
    "collectives: ring alpha-beta, alpha x (n - 1) + bus bytes / bandwidth; bus bytes per rank are "
    "(n-1)/n of the buffer for all-gather and reduce-scatter, twice that for all-reduce, the message "
    "for send; NVLink inside a node of NGPU ranks, the per-GPU network between nodes",
    "FSDP all-gathers, reduce-scatters and HSDP all-reduces overlap compute (prefetch), except the "
    "step's first all-gather and last reduce-scatter / all-reduce; what does not fit under the compute "
    "adds to the step; so do the copies of held forwards to and from host memory (`moe.held_forwards` "
    "= host), at the host link's rate x `host_efficiency`",
    "tensor-parallel, context-parallel and loss/statistics collectives are exposed (no async TP)",
    "a functional collective waited for later than it was started hides under what the rank computed "
    "in between, up to that time (expert parallelism's chunked token exchanges, "
    "`parallelism.expert_parallel_overlap_chunks`); collectives in flight together are not serialised, "
    "and that compute also still hides FSDP's collectives",
    "Mixture-of-Experts: expert parallelism's token all-to-alls (dispatch and combine, and their "
    "gradients) are exposed except as above, NVLink when the EP group is inside a node, the network when it spans "
    "nodes; their splits follow the stated routing (`routing_imbalance`: the simulated rank receives "
    "that multiple of the average tokens, 1 = balanced); the experts run the grouped matmul, 2 x rows "
    "x dim x hidden FLOPs per product",
    "pipeline send/recv overlaps compute; the schedule's bubble stretches the busy time: step = "
    "busy / (1 - bubble), bubble from parallelisms/pipeline_split.py (1F1B: (pp-1)/(m+pp-1))",
    "micro-batches: gradient accumulation traces 4 of them (all when exact MoE balancing holds every "
    "forward on the device before the backwards), 1F1B pipeline rank r max(3, pp - r + 1), other schedules all; the peak is measured on those, and the steady ones' average FLOPs, bytes "
    "and collectives stand for each one not traced",
    "data: synthetic samples of `training.seq_len` tokens, every label valid (the job's data are not "
    "read, so their size and format are not checked: `--dry-run` on the machine that holds them does)",
    "MFU counts the model's FLOPs (6N + 12 L h q S per token, h heads of q channels, as the training log does; "
    "N of a Mixture-of-Experts model its active parameters: router, shared and top-k routed experts); HFU the traced ones, with "
    "activation-checkpointing recompute",
)


@dataclass
class StepTime:
    compute_s: float
    memory_s: float
    comm_s: dict[str, float]
    exposed_comm_s: float
    busy_s: float
    bubble: float
    step_s: float


def _collective_s(c: Collective, target: Target) -> float:
    bandwidth = target.network_bytes_per_s if c.crosses_nodes else target.nvlink_bytes_per_s
    alpha = target.network_alpha_s if c.crosses_nodes else target.nvlink_alpha_s
    steps = 1 if c.kind in ("send", "recv", "broadcast") else max(c.size - 1, 1)
    return (alpha * steps + c.bus_bytes / bandwidth) * c.times


def compute_s(cost: TracedCost, target: Target) -> dict[str, float]:
    """Seconds of the traced FLOPs by kernel kind: at the rate the target's calibration measured
    for the kind, else at its peak x ``efficiency``; float8 matmuls at ``Target.float8_flops``."""
    default = target.bf16_flops * target.efficiency
    float8 = {"float8": cost.fp8_flops / target.float8_flops()}
    float8 = float8 if cost.fp8_flops else {}
    if target.calibration is None:
        return {"all": (cost.flops - cost.fp8_flops) / default, **float8}
    seconds = {
        kind: flops / (target.calibration.flops(kind)[0] or default) for kind, flops in cost.flops_by_kind.items()
    }
    rest = cost.flops - cost.fp8_flops - sum(cost.flops_by_kind.values())
    return {**seconds, **float8, **({"other": rest / default} if rest else {})}


def memory_bandwidth(target: Target) -> float:
    """What memory-bound ops reach: the calibration's measured copy, else the data sheet's
    bandwidth x ``hbm_efficiency``."""
    measured = target.calibration.hbm_bytes_per_s if target.calibration else None
    return measured or target.hbm_bytes_per_s * target.hbm_efficiency


def casting_bandwidth(target: Target) -> float:
    """What eager kernels that cast each element reach: the calibration's probe, else the copy's rate."""
    measured = target.calibration.casting_bytes_per_s if target.calibration else None
    return measured or memory_bandwidth(target)


def traffic(cost: Cost | TracedCost, compiled: bool) -> tuple[float, float]:
    """``cost``'s bytes moved and the part of them in eager kernels that cast each element; ``compiled``:
    as compile's fusion leaves them."""
    return (cost.fused_bytes, cost.fused_casting_bytes) if compiled else (cost.memory_bytes, cost.casting_bytes)


def memory_s(cost: Cost | TracedCost, target: Target, compiled: bool) -> float:
    """Seconds of ``cost``'s memory-bound ops: the casting kernels' bytes at their rate, the rest
    at the copy's."""
    moved, casting = traffic(cost, compiled)
    return (moved - casting) / memory_bandwidth(target) + casting / casting_bandwidth(target)


def _busy_s(cost: TracedCost | None, target: Target, compiled: bool) -> float:
    """Seconds the rank computes ``cost`` (no collective's)."""
    if cost is None:
        return 0.0
    return sum(compute_s(cost, target).values()) + memory_s(cost, target, compiled)


def step_time(
    cost: TracedCost,
    target: Target,
    pp: int,
    schedule: str,
    stages_per_rank: int,
    pipeline_microbatches: int,
    compiled: bool = False,
) -> StepTime:
    """Seconds of one step on ``target`` under the model in :data:`ASSUMPTIONS`; ``compiled``:
    the memory-bound ops move the bytes compile's fusion leaves (:class:`Fusion`)."""
    compute = sum(compute_s(cost, target).values())
    memory = memory_s(cost, target, compiled)
    comm: dict[str, float] = {}
    overlappable = exposed = 0.0
    fsdp = [c for c in cost.collectives if c.dim in FSDP_DIMS]
    gathers = [id(c) for c in fsdp if c.kind == "all_gather"][:1]
    reductions = [id(c) for c in fsdp if c.kind in ("reduce_scatter", "all_reduce")][-2:]
    hidden = {id(c) for c in fsdp} - set(gathers) - set(reductions)
    if cost.host_bytes:
        comm["host"] = cost.host_bytes / target.host_rate
        overlappable += comm["host"]
    for c in cost.collectives:
        if c.kind == "recv":
            continue
        seconds = _collective_s(c, target)
        comm[c.dim] = comm.get(c.dim, 0.0) + seconds
        if c.dim == "pp":
            continue
        if id(c) in hidden:
            overlappable += seconds
        else:
            exposed += max(0.0, seconds - _busy_s(c.under, target, compiled) * c.times)
    busy = compute + memory + exposed + max(0.0, overlappable - compute - memory)
    bubble = BUBBLE_FRACTION[schedule](pp, stages_per_rank, pipeline_microbatches) if pp > 1 else 0.0
    return StepTime(compute, memory, comm, exposed, busy, bubble, busy / (1.0 - bubble))
