"""What would make a job fit: the changes the memory check, ``--dry-run`` and ``--simulate``
propose when the per-rank estimate (``memory_plan.py``) exceeds the target's memory, each one
checked against the same estimate, written as the user would type them, and only layouts the
job's checks accept (degrees that divide what they split, a global batch that stays whole).

For a Mixture-of-Experts model TP is proposed like for a dense one: it does not split the MoE's
weights (its experts are split by EP), but it splits attention's and the activations, the MoE's
routed tokens included (each TP rank routes its sequence shard). CP, which also shrinks the
activations, is proposed for no model: its kernels and sequence constraints are the user's
choice. More PP is proposed for a pipelined job, MoE or dense (an unpipelined one is left its
layout): a stage holds its own blocks' experts gathered, with their gradients unsharded, for the
whole step (PipelineStage defers FSDP's reshard and reduce), which more stages shrink and more
``dp_shard`` does not (``tests/test_moe_memory_fixes.py``: Qwen3-235B-A22B in two stages on 32
GPUs fits only in eight)."""

from __future__ import annotations

from dataclasses import replace

from parallelisms.parallel_dims import ParallelismError
from parallelisms.pipeline_split import plan_split
from trainer.planning.held_for_speed import fitted
from trainer.planning.memory_plan import estimate
from trainer.planning.workload import Workload


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
        if _fits(_with_ep(w, ep), limit):
            single.append(f"`--parallelism.expert_parallel_degree {ep}`")
            break
    for tp in _tp_degrees(w):
        if _fits(replace(w, tp=tp), limit):
            single.append(f"`--parallelism.tensor_parallel_degree {tp}` (with {world_size // w.tp * tp} processes)")
            break
    if w.ac_mode != "full" and _fits(replace(w, ac_mode="full"), limit):
        single.append("`--activation_checkpoint.mode full`")
    for batch in _microbatch_sizes(w):
        if _fits(_with_microbatch(w, batch), limit):
            single.append(_microbatch_text(w, batch))
            break
    for pp in _pp_degrees(w):
        if _fits(replace(w, pp=pp), limit):
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


def _fits(w: Workload, limit: int) -> bool:
    """Whether ``w`` fits ``limit`` as the job would run it: exact balancing's held forwards, and
    their loss gradients, given up first where they would not fit (``held_for_speed.fitted``)."""
    return estimate(fitted(w, limit)).total <= limit


def _microbatch_sizes(w: Workload) -> list[int]:
    """Smaller micro-batches, largest first, that cut a rank's share of the step evenly (the
    global batch must stay divisible by the micro-batch times the data-parallel degree)."""
    share = w.local_batch_size * (w.pp_microbatches if w.pp > 1 else w.accumulation)
    return [b for b in range(w.local_batch_size - 1, 0, -1) if share % b == 0]


def _with_microbatch(w: Workload, batch: int) -> Workload:
    """``w`` with micro-batches of ``batch`` sequences; the step's batch stays, so the
    micro-batches (accumulated, or the pipeline's) are more."""
    if w.pp > 1:
        return replace(w, local_batch_size=batch, pp_microbatches=w.pp_microbatches * w.local_batch_size // batch)
    return replace(w, local_batch_size=batch, accumulation=w.accumulation * w.local_batch_size // batch)


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
    """Larger TP degrees that the job's checks accept: dividing the heads, the sequence (in
    ``2 cp`` chunks under CP), the vocabulary, and with Ulysses CP the heads ``cp`` ways again;
    none where a sequence-scoped balancing loss needs whole sequences."""
    if w.experts is not None and w.experts.whole_sequences:
        return []
    sequence = 2 * w.cp if w.cp > 1 else 1
    heads = w.cp if w.cp_ulysses else 1
    return [
        tp
        for tp in (2, 4, 8)
        if tp > w.tp
        and w.n_heads % (tp * heads) == 0
        and w.kv_heads % tp == 0
        and w.seq_len % (sequence * tp) == 0
        and w.vocab_size % tp == 0
    ]


def _ep_degrees(w: Workload) -> list[int]:
    """Larger expert-parallel degrees: dividing the experts and the ranks they come from
    (``dp_shard x cp``)."""
    if w.experts is None:
        return []
    n, ep, ranks = w.experts.n_experts, w.experts.ep, w.dp_shard * w.cp
    return [d for d in range(ep + 1, ranks + 1) if n % d == 0 and ranks % d == 0]


def _with_ep(w: Workload, ep: int) -> Workload:
    return replace(w, experts=replace(w.experts, ep=ep)) if w.experts else w


def _fitting_shards(w: Workload, limit: int) -> int | None:
    """The fewest shard ranks that fit; with a fixed global batch, ranks that divide it (each
    takes a whole number of micro-batches: fewer to accumulate), and that EP's ranks divide."""
    ep = w.experts.ep if w.experts else 1
    for shards in (w.dp_shard, *(2**k for k in range(1, 14))):
        if shards < w.dp_shard or (shards * w.cp) % ep:
            continue
        wider = replace(w, dp_shard=shards)
        if w.fixed_global_batch:
            microbatches = w.dp_shard * (w.pp_microbatches if w.pp > 1 else w.accumulation)
            fewer = microbatches // shards
            if microbatches % shards or (w.pp > 1 and w.pp_schedule != "GPipe" and fewer < w.pp):
                continue
            wider = replace(wider, pp_microbatches=fewer) if w.pp > 1 else replace(wider, accumulation=fewer)
        if _fits(wider, limit):
            return shards
    return None


def _shard_text(w: Workload, shards: int, processes: int) -> str:
    # A CPU machine's ranks share its memory: more shards fit only on more machines.
    where = " on more machines" if w.device != "cuda" else ""
    return f"dp_shard {shards} ({processes} processes in all{where}: NGPU x NNODES)"
