"""What the MoE exactness tests share: the debug MoE's argv, a skewed routing bias that leaves
some experts without tokens on some ranks, the trainer's own steps on any mesh with what each
rank reports, and the comparison with the 1-process reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import argv_for, run_by_world, trainer_for
from step_helpers import fetch_step, forward_backward, optimizer_step, part_of, sums_of

from parallelisms import parallel_dims, parallelize
from parallelisms.parallel_dims import ParallelDims
from parallelisms.torch_private import kernels, pipelining
from trainer.model.moe import moe_layers
from trainer.step.batches import MicroBatch
from trainer.step.expert_balance import BalanceSettings, ExpertBalance
from trainer.step.schedules import HeldForwards
from trainer.step.sums import AcrossGroups, Ranks, StepSums
from trainer.training import Training

STEPS = 3
TOLERANCE = 5e-5
DEBUG_MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]
MOE = [
    *DEBUG_MOE,
    "--moe.balance_loss_weight",
    "0.1",
    "--moe.bias_update_rate",
    "0.01",
    "--optimizer.lr",
    "0.003",
    "--lr_scheduler.warmup_steps",
    "0",
]
# A routing bias that makes the last experts rare, so some get no token from some ranks.
SKEW = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.05, -0.1, -0.2])


def moe_argv(local_batch: int, extra: list[str], model: list[str] = DEBUG_MOE) -> list[str]:
    """The MoE tests' job (``model``: its ``--model.*`` keys, 8 experts) with ``extra``."""
    return argv_for(local_batch, [*MOE, *model, *extra])


def experts_replicated_over(dim: str) -> Callable:
    """A wrong expert mesh: ``ep`` from ``dp_shard`` alone and the experts' FSDP ranks missing
    ``dim`` (``cp`` or ``tp``), so their gradients are not summed over it."""

    def grid(ranks: torch.Tensor, dims: ParallelDims) -> tuple[torch.Tensor, tuple[str, ...]]:
        outside = dims.dp_shard // dims.ep
        grid = ranks.reshape(dims.pp, dims.dp_replicate, outside, dims.ep, dims.cp, dims.tp)
        if dim == "cp":
            grid = grid.permute(0, 1, 4, 3, 2, 5).reshape(dims.pp, dims.dp_replicate, dims.cp, dims.ep, -1)
        else:
            grid = grid.permute(0, 1, 5, 3, 2, 4).reshape(dims.pp, dims.dp_replicate, dims.tp, dims.ep, -1)
        return grid, ("pp", "dp_replicate", dim, "ep", "expert_shard")

    return grid


def without_replicated_unit(apply_fsdp: Callable) -> Callable:
    """FSDP that leaves the MoE router and shared experts in the block's unit, summed over
    ``dp_shard x cp`` only, although every TP rank fed them other tokens."""

    def apply(*args, **kwargs):
        return apply_fsdp(*args, **{**kwargs, "replicated_mesh": None})

    return apply


def moe_steps(argv: list[str], bug: str = "", validate: bool = False, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps through the trainer's own code; what every rank reports. With
    ``validate``, after each step (as the loop validates) the step's batch is evaluated forward
    only, as validation runs it: ``evaluated``, its summed loss over every rank."""
    if bug == "tokens counted again in recompute":
        kernels.in_backward = lambda: False
    if bug == "pipeline's shape-learning pass counted":
        pipelining.in_metadata_inference = lambda: False
    if bug.startswith("expert gradients not summed over "):
        parallel_dims.expert_rank_grid = experts_replicated_over(bug.rsplit(" ", 1)[1])
    if bug == "router and shared experts not summed over tp":
        parallelize.apply_fsdp = without_replicated_unit(parallelize.apply_fsdp)
    p, training = trainer_for(argv)
    layers = moe_layers(training.model)
    for layer in layers:
        layer.expert_bias.copy_(SKEW)
    if bug == "expert gradients divided by ep":
        for layer in layers:
            layer.experts.set_gradient_divide_factor(float(p.dims.ep))
    balance, sums = part_of(training, ExpertBalance), sums_of(training)
    if bug == "counting pre-pass skipped under PP":
        assert training.pipeline is not None
        training.pipeline.forward_only = lambda *args: []  # type: ignore[method-assign]
    if bug == "statistics not gathered over the stages":
        sums.groups[Ranks.MODEL] = sums.groups[Ranks.ROUTING]
    if bug == "step's counts not summed over the routing mesh":
        sums.groups[Ranks.ROUTING] = None
    out: dict[str, list] = {"loss": [], "norm": [], "n": [], "balance": [], "bias": [], "tokens": [], "local": []}
    out["rows"] = balance.rows  # under PP, the whole model's rows of this rank's layers
    for _ in range(steps):
        microbatches = fetch_step(training)
        result = forward_backward(training, microbatches)
        local = [layer.tokens_per_expert.clone() for layer in layers]
        out["local"].append(torch.stack(local) if local else torch.zeros(0, len(SKEW)))
        optimizer_step(training, result)
        stats = balance.last
        assert stats is not None
        out["loss"].append(result.loss_avg)
        out["norm"].append(result.grad_norm)
        out["n"].append(result.n_valid_tokens)
        out["balance"].append(stats.balance_loss)
        out["bias"].append(stats.expert_bias)
        out["tokens"].append(stats.tokens_per_expert)
        if validate:
            out.setdefault("evaluated", []).append(evaluated(training, microbatches))
    schedule = training.step.schedule
    offload = schedule.offload if isinstance(schedule, HeldForwards) else None
    out["to host"] = offload.moved_bytes if offload is not None else 0
    return out


def evaluated(training: Training, microbatches: list[MicroBatch]) -> float:
    """The summed loss of ``microbatches`` on every rank, forward only (the pipeline's
    ``evaluate`` under PP, as validation calls it)."""
    with training.forward.context(), torch.no_grad():
        if training.pipeline is not None:
            inputs, labels = (
                torch.cat([mb.inputs for mb in microbatches]),
                torch.cat([mb.labels for mb in microbatches]),
            )
            total = training.pipeline.evaluate(inputs, labels)
        else:
            total = sum(training.forward(mb) for mb in microbatches)
    total = torch.as_tensor(total, dtype=torch.float32).reshape(())
    dist.all_reduce(total, group=training.meshes.loss.get_group())
    return total.item()


def differences(result: dict, ref: dict) -> dict[str, float]:
    """The largest relative difference of each reported value over the steps."""

    def rel(a, b) -> float:
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()

    return {
        key: max(rel(a, b) for a, b in zip(result[key], ref[key]))
        for key in ("loss", "norm", "balance", "bias", "tokens")
    }


def launch_moe(
    meshes: dict[str, tuple[int, int, list[str]]],
    bugs: dict[str, tuple[int, int, list[str]]],
    steps: int = STEPS,
    also: dict[str, tuple[int, tuple]] | None = None,
    model: list[str] = DEBUG_MOE,
) -> dict:
    """The 1-process reference (``reference``), every mesh and every injected bug (``bug: NAME``)
    through :func:`moe_steps` for ``steps`` steps, one launch per world size;
    ``{name: (world, local batch, argv)}``. ``also``: more cases for those launches, as
    :func:`harness.run_by_world` takes them; ``model`` as for :func:`moe_argv`."""
    cases = {"reference": (1, (moe_steps, moe_argv(8, [], model), "", False, steps)), **(also or {})}
    for name, (world, local, extra) in meshes.items():
        cases[name] = (world, (moe_steps, moe_argv(local, extra, model), "", False, steps))
    for name, (world, local, extra) in bugs.items():
        cases[f"bug: {name}"] = (world, (moe_steps, moe_argv(local, extra, model), name, False, steps))
    return run_by_world(cases)


def balance_alone(
    model: torch.nn.Module,
    *,
    rate: float = 0.0,
    weight: float = 0.0,
    scope: str = "global_batch",
    layers: str = "per_layer",
    sizes: tuple[int, int, int] = (1, 1, 1),
    counting: str = "none",
    groups: AcrossGroups | None = None,
) -> ExpertBalance:
    """The step's balancing part on one process (``groups``: replica groups standing in), for
    tests that run a model's forwards and backwards themselves: its ``begin`` needs the step's
    sums begun (``sums.begin``), as the accumulator begins them."""
    args = model.args
    settings = BalanceSettings(
        bias_update_rate=rate,
        loss_weight=weight,
        loss_scope=scope,
        loss_layers=layers,
        global_sizes=sizes,
        moe_layer_ids=tuple(range(args.n_dense_layers, args.n_layers)),
        n_experts=args.n_experts,
        counting=counting,
    )
    return ExpertBalance(model, StepSums(dict.fromkeys(Ranks), replicas=groups), settings)


def begin_alone(balance: ExpertBalance, n_valid_tokens: int = 1) -> None:
    """Begin a step of ``balance`` (and of its sums) whose N is ``n_valid_tokens``."""
    balance.sums.begin(torch.tensor([n_valid_tokens]))
    balance.begin([])
