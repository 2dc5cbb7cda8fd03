"""What would make a job fit: the changes the memory check, ``--dry-run`` and ``--simulate``
propose when the per-rank estimate (``memory_plan.py``) exceeds the target's memory, each one
checked against the same estimate, written as the user would type them."""

from __future__ import annotations

from dataclasses import replace

from parallelisms.parallel_dims import ParallelismError
from parallelisms.pipeline_split import plan_split
from trainer.planning.memory_plan import Workload, estimate


def what_would_fit(w: Workload, limit: int, world_size: int, machines: str = "machines") -> str:
    """What would fit ``limit``, as the one sentence the memory check and the simulator both print."""
    how, changes = fixes(w, limit, world_size)
    if not changes:
        return f"nothing the mesh or the batch can change fits it: use larger {machines} or a smaller `model.flavor`"
    if how == "any":
        return "any one of these would fit: " + "; or ".join(changes)
    return "these together would fit: " + ", ".join(changes)


def fixes(w: Workload, limit: int, world_size: int) -> tuple[str, list[str]]:
    """Changes that would bring the estimate under ``limit``, as the user would type them.

    Returns ``("any", changes)`` when each change alone fits, else ``("all", changes)`` for one
    combination that fits, else ``("all", [])``.
    """
    single = []
    shards = _fitting_shards(w, limit)
    if shards is not None:
        single.append(_shard_text(w, shards, world_size // w.dp_shard * shards))
    for ep in _ep_degrees(w):
        if estimate(_with_ep(w, ep)).total <= limit:
            single.append(f"`--parallelism.expert_parallel_degree {ep}`")
            break
    for tp in _tp_degrees(w):
        if estimate(replace(w, tp=tp)).total <= limit:
            single.append(f"`--parallelism.tensor_parallel_degree {tp}` (with {world_size // w.tp * tp} processes)")
            break
    if w.ac_mode != "full" and estimate(replace(w, ac_mode="full")).total <= limit:
        single.append("`--activation_checkpoint.mode full`")
    for batch in range(w.local_batch_size - 1, 0, -1):
        if estimate(_with_microbatch(w, batch)).total <= limit:
            single.append(_microbatch_text(w, batch))
            break
    for pp in _pp_degrees(w) if w.experts is None else []:
        if estimate(replace(w, pp=pp)).total <= limit:
            single.append(f"`--parallelism.pipeline_parallel_degree {pp}` (with {world_size // w.pp * pp} processes)")
            break
    if single:
        return "any", single
    smallest = replace(_with_microbatch(w, 1), ac_mode="full")
    ep = ([w.experts.ep] + _ep_degrees(w))[-1] if w.experts else 1
    smallest = _with_ep(smallest, ep)
    for tp in (w.tp, *_tp_degrees(w)):
        shards = _fitting_shards(replace(smallest, tp=tp), limit)
        if shards is not None:
            processes = world_size // (w.dp_shard * w.tp) * shards * tp
            return "all", [
                "`--activation_checkpoint.mode full`",
                _microbatch_text(w, 1).split(" (")[0],
                *([f"`--parallelism.tensor_parallel_degree {tp}`"] if tp != w.tp else []),
                *([f"`--parallelism.expert_parallel_degree {ep}`"] if w.experts and ep != w.experts.ep else []),
                _shard_text(w, shards, processes),
            ]
    return "all", []


def _with_microbatch(w: Workload, batch: int) -> Workload:
    """``w`` with micro-batches of ``batch`` sequences; under pipelining the step's batch stays,
    so the pipeline's micro-batches are more."""
    microbatches = w.pp_microbatches * w.local_batch_size // batch if w.pp > 1 else w.pp_microbatches
    return replace(w, local_batch_size=batch, pp_microbatches=microbatches)


def _microbatch_text(w: Workload, batch: int) -> str:
    if w.pp > 1:
        return f"`--parallelism.pipeline_parallel_microbatch_size {batch}`"
    return (
        f"`--training.local_batch_size {batch}` (with `training.global_batch_size` set, the global "
        "batch stays and the micro-batches are more)"
    )


def _pp_degrees(w: Workload) -> list[int]:
    """Under pipelining, larger degrees that the schedule can run with the step's micro-batches
    and that the blocks can be split into."""
    degrees = []
    for pp in (2, 4, 8, 16):
        if w.pp == 1 or pp <= w.pp or (w.pp_schedule != "GPipe" and w.pp_microbatches < pp):
            continue
        try:
            plan_split(w.n_layers, pp, w.pp_schedule, w.pp_layers_per_stage, w.pp_first_less, w.pp_last_less)
        except ParallelismError:
            continue
        degrees.append(pp)
    return degrees


def _tp_degrees(w: Workload) -> list[int]:
    if w.experts is not None:
        return []  # Mixture-of-Experts models shard by EP x FSDP (parallelize.py refuses TP, PP)
    return [tp for tp in (2, 4, 8) if tp > w.tp and w.n_heads % tp == 0 and w.kv_heads % tp == 0]


def _ep_degrees(w: Workload) -> list[int]:
    """Larger expert-parallel degrees: dividing the experts and the shard ranks they come from."""
    if w.experts is None:
        return []
    n, ep = w.experts.n_experts, w.experts.ep
    return [d for d in range(ep + 1, w.dp_shard + 1) if n % d == 0 and w.dp_shard % d == 0]


def _with_ep(w: Workload, ep: int) -> Workload:
    return replace(w, experts=replace(w.experts, ep=ep)) if w.experts else w


def _fitting_shards(w: Workload, limit: int) -> int | None:
    for shards in (w.dp_shard, *(2**k for k in range(1, 14))):
        if shards >= w.dp_shard and estimate(replace(w, dp_shard=shards)).total <= limit:
            return shards
    return None


def _shard_text(w: Workload, shards: int, processes: int) -> str:
    # A CPU machine's ranks share its memory: more shards fit only on more machines.
    where = " on more machines" if w.device != "cuda" else ""
    return f"dp_shard {shards} ({processes} processes in all{where}: NGPU x NNODES)"
