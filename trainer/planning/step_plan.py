"""How a job's training step runs, decided with its plan before any process group exists: the
schedule of its forwards and backwards and its parts in the order they take part.

``--dry-run`` and the start report print it; ``trainer/build.py`` builds the step from it, part
by part in this order (``trainer/step/``). Where the memory plan decided for speed (exact MoE
balancing's held forwards, on the device or in host memory), the decision is read here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import ParallelSettings
from trainer.config import JobConfig
from trainer.model.llama3 import ModelArgs
from trainer.model.moe import MoEArgs
from trainer.planning.workload import Workload
from trainer.step.loss_terms import LossTerm, loss_terms


@dataclass(frozen=True)
class StepPlan:
    schedule: str
    """``interleaved`` (each forward then its backward), ``held forwards`` (every forward, then
    every backward) or ``pipelined`` (the pipeline schedule's)."""
    prepass: bool
    """A forward-only pre-pass of the step first: exact MoE balancing counts the step's routing."""
    offload: bool
    """Held forwards keep what they save in pinned host memory."""
    loss_gradients_in_forward: bool
    """Held forwards compute their loss's gradients as the loss (the output weight a plain tensor),
    so that only those wait for the backward, not the logits."""
    parts: tuple[str, ...]
    """The kinds of part the step has, in order: ``accumulator``, ``reduction``, ``loss terms``,
    ``balance``, ``group commit``, ``optimizer step``, ``float8 scales`` (the simulator adds two
    that watch the step when it builds one)."""
    terms: tuple[LossTerm, ...]
    """The terms added to the cross-entropy (``trainer/step/loss_terms.py``)."""
    lines: tuple[str, ...]
    """What the schedule and each part do, for ``--dry-run``."""


def step_plan(
    config: JobConfig, dims: ParallelDims, settings: ParallelSettings, workload: Workload, args: ModelArgs
) -> StepPlan:
    moe, training = config.moe, config.training
    exact = isinstance(args, MoEArgs) and moe.balance_loss_weight > 0 and moe.balance_loss_scope == "global_batch"
    held = exact and workload.holds_forwards
    schedule = "pipelined" if dims.pp > 1 else "held forwards" if held else "interleaved"
    prepass = exact and not held
    terms = loss_terms(config)
    float8 = settings.float8 is not None and settings.float8.precompute_scales
    kinds = ["accumulator", "reduction", *(["loss terms"] if terms else [])]
    kinds += ["balance"] if isinstance(args, MoEArgs) else []
    kinds += ["group commit"] if config.fault_tolerance.enable else []
    kinds += ["optimizer step", *(["float8 scales"] if float8 else [])]
    clip = f", clipped at a norm of {training.max_norm:g}" if training.max_norm > 0 else ""
    said = {
        "accumulator": f"gradient accumulator: the valid tokens N counted as the step begins; every gradient x "
        f"clip / N in one pass{clip}",
        "reduction": reduction_line(config, dims),
        "loss terms": "loss terms: " + ", ".join(f"{t.total.name} x {t.weight:g}" for t in terms),
        "balance": balance_line(config, isinstance(args, MoEArgs) and exact, prepass),
        "group commit": f"replica groups' commit: {config.fault_tolerance.group_count} groups; a step whose quorum "
        "broke is run again",
        "optimizer step": f"optimizer step, then the LR schedule: {optimizer_line(config, args)}",
        "float8 scales": "float8: every gathered weight's scale in one all-reduce after a step that moved them",
    }
    lines = [f"the step: {schedule_line(schedule, prepass, workload.offloads_forwards, dims)}"]
    lines += [f"  {i}. {said[kind]}" for i, kind in enumerate(kinds, 1)]
    return StepPlan(
        schedule,
        prepass,
        held and workload.offloads_forwards,
        held and workload.holds_loss_gradients,
        tuple(kinds),
        terms,
        tuple(lines),
    )


def optimizer_line(config: JobConfig, args: ModelArgs) -> str:
    """Which update each parameter takes (``trainer/muon.py``'s choice, said in words)."""
    if config.optimizer.name != "Muon":
        return "AdamW"
    o = config.optimizer
    experts = ", every routed and shared expert's" if isinstance(args, MoEArgs) else ""
    router = ", the router" if isinstance(args, MoEArgs) else ""
    return (
        f"Muon (momentum {o.momentum:g}{', Nesterov' if o.nesterov else ''}, {o.ns_steps} Newton–Schulz steps, "
        f"lr adjusted by {o.adjust_lr_fn}; each matrix orthogonalised whole) for every block's attention wq wk wv "
        f"wo and feed-forward w1 w2 w3{experts}; AdamW for the embedding, the output, the norms{router}"
    )


def schedule_line(schedule: str, prepass: bool, offload: bool, dims: ParallelDims) -> str:
    first = "a forward-only pre-pass of the step (exact MoE balancing counts its routing), then " if prepass else ""
    if schedule == "pipelined":
        return f"{first}the pipeline schedule runs every micro-batch's forward and backward over {dims.pp} stages"
    if schedule == "held forwards":
        where = " (what they save waits in pinned host memory)" if offload else ""
        return f"every micro-batch's forward held{where}, counting the routing, then every backward"
    return f"{first}each micro-batch's forward then its backward"


def reduction_line(config: JobConfig, dims: ParallelDims) -> str:
    if config.debug.layout_invariant:
        return "layout-invariant reduction: each micro-batch's gradient sent to its owners, summed in global order"
    when = "the last micro-batch" if config.training.defer_gradient_reduction else "each micro-batch"
    hsdp = "; HSDP's all-reduce on the last" if dims.hsdp else ""
    return f"FSDP reduces the gradients by sum, reduce-scatter on {when}{hsdp}"


def balance_line(config: JobConfig, exact: bool, prepass: bool) -> str:
    moe = config.moe
    loss = ""
    if moe.balance_loss_weight > 0:
        counted = (" (counted by the pre-pass)" if prepass else " (counted by the held forwards)") if exact else ""
        loss = f"; balancing loss x {moe.balance_loss_weight:g} over each {moe.balance_loss_scope}{counted}"
    return f"MoE balancing: routing bias moves by {moe.bias_update_rate:g} a step{loss}"
