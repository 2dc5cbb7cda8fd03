"""How the model is cut into pipeline stages, and the schedules' constraints on the cut.

**Split.** The first stage holds the token embedding, the last the final norm, the output
projection and the loss; the transformer blocks are spread over the stages. The embedding and
the output count as ``first_less`` / ``last_less`` blocks (torchtitan's
``pipeline_parallel_first_stage_less_layers`` / ``last_stage_less_layers``), so stage sizes are
``n_layers + first_less + last_less`` units cut into equal parts: exactly
(``layers_per_stage`` given: it must divide the total) or as evenly as possible (the remainder
goes one unit each to the middle stages first, which carry neither the embedding nor the output).

**Parameter names stay the whole model's.** A rank's model is the full model with the blocks of
other stages deleted from its ``layers`` ModuleDict (keyed by the original block index) and the
embedding / norm / output set to None where another stage holds them. Its ``named_parameters``
are the FQNs of the non-PP model, so DCP checkpoints reshard between pipeline degrees, and seed
checkpoints and Hugging Face export need no mapping. The stages a schedule runs are views of
that model: modules of the same class holding the same block objects, one per stage (two or
more per rank for the interleaved and zero-bubble schedules).

**Placement.** Stage ``s`` runs on ``pp`` rank ``s mod pp`` (looped); under the V-shaped
zero-bubble schedule rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from parallelisms import model_parts
from parallelisms.parallel_dims import ParallelismError
from parallelisms.torch_private import pipelining

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""What ``parallelism.pipeline_parallel_schedule`` may name."""
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
"""One stage per rank; the others run several (looped or V-shaped)."""
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""Split each backward into an input-gradient and a weight-gradient pass."""
V_SHAPED_SCHEDULES = ("ZBVZeroBubble",)

BUBBLE_FRACTION: dict[str, Callable[[int, int, int], float]] = {
    "GPipe": lambda pp, v, m: (pp - 1) / (m + pp - 1),
    "1F1B": lambda pp, v, m: (pp - 1) / (m + pp - 1),
    "Interleaved1F1B": lambda pp, v, m: (pp - 1) / (v * m + pp - 1),
    "InterleavedZeroBubble": lambda pp, v, m: (pp - 1) / (3 * v * m + pp - 1),
    "ZBVZeroBubble": lambda pp, v, m: (pp - 1) / (3 * v * m + pp - 1),
}
"""Idle fraction of a rank's step, ``(pp, stages per rank, micro-batches) -> fraction``, for
equal forward, input-gradient and weight-gradient times: (pp - 1) pipeline fill/drain slots of
one stage's forward+backward against ``v x m`` of them (Narayanan et al. 2021); zero-bubble
schedules fill those slots with deferred weight gradients, leaving a third of each (Qi et al.
2023, ZB-H1). A reference for the benchmark, not a promise: real stages are not equal."""


@dataclass(frozen=True)
class PipelineSplit:
    """The pipeline's shape: which blocks each stage holds and which stages each rank runs."""

    pp: int
    stage_blocks: tuple[tuple[int, ...], ...]
    """Transformer block indices of every stage, in pipeline order."""
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stage indices ``pp_rank`` runs, in the order the schedule expects them."""
        if self.schedule in V_SHAPED_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)]


def plan_split(
    n_layers: int, pp: int, schedule: str, layers_per_stage: int, first_less: int, last_less: int
) -> PipelineSplit:
    """Cut ``n_layers`` blocks into stages (see the module docstring); raise
    :class:`ParallelismError` when the request cannot be met."""
    if first_less < 0 or last_less < 0:
        raise ParallelismError(
            "{pp_first_stage_less_layers} and {pp_last_stage_less_layers} count blocks the "
            "embedding and the output stand for; they must be >= 0."
        )
    units = n_layers + first_less + last_less
    if layers_per_stage > 0:
        if units % layers_per_stage:
            raise ParallelismError(
                f"{{pp_layers_per_stage}} = {layers_per_stage} does not divide the model's "
                f"{n_layers} blocks + {{pp_first_stage_less_layers}} ({first_less}) + "
                f"{{pp_last_stage_less_layers}} ({last_less}) = {units} stage units; choose a "
                f"divisor of {units}, or change the less-layers settings."
            )
        num_stages = units // layers_per_stage
        if num_stages % pp:
            raise ParallelismError(
                f"{{pp_layers_per_stage}} = {layers_per_stage} makes {num_stages} stages, not a "
                f"multiple of {{pp}} = {pp}: every rank must run the same number of stages."
            )
        sizes = [layers_per_stage] * num_stages
    elif layers_per_stage in (-1, 0):
        num_stages = pp * (1 if schedule in SINGLE_STAGE_SCHEDULES else 2)
        sizes = [units // num_stages] * num_stages
        middle_first = list(range(1, num_stages - 1)) + [0, num_stages - 1]
        for stage in middle_first[: units % num_stages]:
            sizes[stage] += 1
    else:
        raise ParallelismError(f"{{pp_layers_per_stage}} must be >= 1, or -1 to split evenly; got {layers_per_stage}.")
    blocks = list(sizes)
    blocks[0] -= first_less
    blocks[-1] -= last_less
    if min(blocks) < 0:
        raise ParallelismError(
            f"{num_stages} pipeline stages of {sizes[0]} units cannot hold the embedding "
            f"({{pp_first_stage_less_layers}} = {first_less}) or the output "
            f"({{pp_last_stage_less_layers}} = {last_less}) of a {n_layers}-block model; use fewer "
            "stages ({pp}, {pp_layers_per_stage}) or smaller less-layers settings."
        )
    stage_blocks, start = [], 0
    for count in blocks:
        stage_blocks.append(tuple(range(start, start + count)))
        start += count
    return PipelineSplit(pp, tuple(stage_blocks), schedule)


def check_pipeline(
    pp: int,
    schedule: str,
    microbatch_size: int,
    rank_batch: int,
    split: PipelineSplit,
    compile_model: bool,
    per_op_checkpointing: bool = False,
) -> None:
    """Constraints of the schedule on the stage count and the micro-batch count."""
    if schedule not in SCHEDULES:
        raise ParallelismError(f"{{pp_schedule}} = {schedule!r} is not one of {', '.join(SCHEDULES)}.")
    if microbatch_size < 1:
        raise ParallelismError(f"{{pp_microbatch_size}} must be >= 1, got {microbatch_size}.")
    if rank_batch % microbatch_size:
        raise ParallelismError(
            f"{{pp_microbatch_size}} = {microbatch_size} does not divide {{pp_rank_batch}} = "
            f"{rank_batch} samples; the pipeline needs whole micro-batches."
        )
    microbatches = rank_batch // microbatch_size
    per_rank = split.stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} runs one stage per rank, but {{pp_layers_per_stage}} "
            f"makes {split.num_stages} stages for {{pp}} = {pp} ranks; use Interleaved1F1B or a "
            "zero-bubble schedule, or leave the layers per stage unset (-1)."
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and per_rank < 2:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} interleaves several stages per rank, but there is "
            f"{per_rank}; use 1F1B, or fewer {{pp_layers_per_stage}}."
        )
    if schedule in V_SHAPED_SCHEDULES and per_rank != 2:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} runs exactly 2 stages per rank (a V), not {per_rank}; "
            "set {pp_layers_per_stage} to -1 or to a value giving 2 x pp stages."
        )
    if schedule != "GPipe" and microbatches < pp:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} needs at least {{pp}} = {pp} micro-batches per step, "
            f"got {rank_batch} / {microbatch_size} = {microbatches} ({{pp_rank_batch}} / "
            "{pp_microbatch_size}); use a larger batch or a smaller micro-batch size (fewer than pp "
            "micro-batches also leaves most of every rank idle)."
        )
    rounds = max(1, microbatches // pp)
    if schedule not in SINGLE_STAGE_SCHEDULES and microbatches % rounds:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} runs the micro-batches in rounds of {{pp}}: their "
            f"number ({microbatches}) must be a multiple of {rounds}; use a multiple of {pp}."
        )
    if schedule in ZERO_BUBBLE_SCHEDULES and compile_model:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} splits each backward into input and weight gradients, "
            "which a compiled block's single backward graph cannot do; turn {compile_model} off "
            "or use 1F1B / Interleaved1F1B."
        )
    if schedule in ZERO_BUBBLE_SCHEDULES and per_op_checkpointing:
        raise ParallelismError(
            f"{{pp_schedule}} = {schedule} runs two backwards over each block (input gradients, "
            "then weight gradients), and per-op selective checkpointing allows one; use "
            "{ac_mode} = full, {ac_option} = an integer (every k-th block fully checkpointed), "
            "or 1F1B / Interleaved1F1B."
        )


def split_model(model: nn.Module, split: PipelineSplit, pp_rank: int) -> list[nn.Module]:
    """Reduce ``model`` in place to the modules of ``pp_rank``'s stages; return one view per stage.

    The views share their modules with ``model``, so whatever is applied to a view's blocks
    (TP, FSDP, compile) is what ``model`` holds; ``model`` itself never runs forward (its
    buffers move to the views), it is what the optimizer and checkpoints see.
    """
    last = split.num_stages - 1
    stages = split.rank_stages(pp_rank)
    views = [_stage_view(model, split.stage_blocks[s], s == 0, s == last) for s in stages]
    held = {str(b) for s in stages for b in split.stage_blocks[s]}
    layers = model_parts.blocks(model)
    for key in [k for k in layers if k not in held]:
        del layers[key]
    if 0 not in stages:
        model_parts.set_end(model, "tok_embeddings", None)
    if last not in stages:
        model_parts.set_end(model, "norm", None)
        model_parts.set_end(model, "output", None)
    for name, _ in list(model.named_buffers(recurse=False)):
        delattr(model, name)
    return views


def _stage_view(model: nn.Module, held: tuple[int, ...], first: bool, last: bool) -> nn.Module:
    layers = model_parts.blocks(model)
    cls = type(model)
    view = cls.__new__(cls)
    nn.Module.__init__(view)
    # Plain attributes (the model's arguments); module state is registered below.
    view.__dict__.update({k: v for k, v in vars(model).items() if not k.startswith("_") and k != "training"})
    model_parts.set_end(view, "tok_embeddings", model_parts.end(model, "tok_embeddings") if first else None)
    view.layers = nn.ModuleDict({str(b): layers[str(b)] for b in held})
    model_parts.set_end(view, "norm", model_parts.end(model, "norm") if last else None)
    model_parts.set_end(view, "output", model_parts.end(model, "output") if last else None)
    for name, buffer in model.named_buffers(recurse=False):
        view.register_buffer(name, buffer, persistent=pipelining.buffer_is_persistent(model, name))
    return view
