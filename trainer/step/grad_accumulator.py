"""Exact loss normalisation over micro-batches, data-parallel ranks and context-parallel shards.

The loss of a step is the mean over every valid label token of the global batch::

    loss = sum of per-token cross-entropies / N,    N = valid labels (!= -100) over all
                                                        micro-batches, DP ranks and CP shards

Averaging per-micro-batch means (the Hugging Face accumulation bug), or letting FSDP average
per-rank means, weighs a token by how few valid tokens share its micro-batch or rank; both are
wrong whenever valid-token counts differ, which is always the case with padding or prompt
masking. So backward runs on *sums*, FSDP reduces by *sum*, N is counted once per step with one
all-reduce launched before the first forward, and after the last backward the gradients are
scaled exactly once by ``clip_coef / N``: the clip coefficient is computed from the true norm
``||sum of grads|| / N``, so normalisation and clipping are one in-place multiply, not two
passes over every gradient.

Tensor-parallel ranks hold the same tokens, so the count runs over the *loss* mesh
(``dp_replicate x dp_shard x cp``), never over TP.

Under pipeline parallelism the schedule runs every forward and backward of the step on summed
losses (``record_pipeline_losses`` replaces the per-micro-batch calls). Every stage reads the
same labels, so every stage counts N itself over its own loss mesh (never over PP); only the
last stage has losses, so the logged loss sum and maximum are reduced over ``stats_group``
(the loss mesh times PP), where the other stages add nothing. The grad norm adds the squares of
every stage's parameters (each held by one stage), and the one ``clip_coef / N`` scale follows.

With fault-tolerant replica groups (``trainer/replica_groups.py``) N, the gradient sums and the
logged loss are summed once more, over the groups that take part in the step, before the norm:
the step is exact over whoever trained it.

With ``debug.layout_invariant`` the micro-batch gradients, the norm and the logged loss sum are
added in one order whatever the layout (``trainer/step/layout_invariant.py``) instead of by autograd
and FSDP; N, the clip coefficient and the one scale stay as they are.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate

from parallelisms.torch_private import kernels
from trainer.loss import IGNORE_INDEX
from trainer.replica_groups import ReplicaGroups
from trainer.step.layout_invariant import LayoutInvariantReduction

logger = logging.getLogger("meshtrain")


@dataclass
class StepResult:
    loss_avg: float
    """Token-weighted mean loss over the global batch."""
    loss_max: float
    """Largest per-rank mean loss (a rank's own loss sum / its own valid tokens)."""
    grad_norm: float
    """Norm of the true (normalised) gradient, before clipping."""
    n_valid_tokens: int
    skipped: bool
    skip_reason: str = ""
    """Why the optimizer step was skipped (empty when it was not)."""


@dataclass
class _StepSums:
    """What ``begin_step`` starts and the rest of the step adds to or reads."""

    local_count: torch.Tensor
    """This rank's valid label tokens, ``(1,)`` int64."""
    count: torch.Tensor
    """The same summed over the loss group (once ``count_work`` is done)."""
    count_work: dist.Work | None
    """The asynchronous all-reduce of ``count`` (None when not distributed)."""
    loss_sum: torch.Tensor
    """This rank's summed token losses so far."""
    counted: bool = False
    """Whether ``count`` is final (over the loss group and, with replica groups, over them)."""


class GradAccumulator:
    """The one object the training loop talks to about micro-batches and gradient scaling.

    Per step: ``begin_step`` with the step's labels, then for each micro-batch
    ``prepare_backward(i)`` before its backward and ``record_loss`` after, then ``finalize``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_group: dist.ProcessGroup | None,
        num_microbatches: int,
        max_norm: float,
        hsdp: bool,
        defer_gradient_reduction: bool = False,
        keep_gathered: bool = False,
        gathered_experts: list[FSDPModule] | None = None,
        stats_group: dist.ProcessGroup | None = None,
        pp_degree: int = 1,
        layout_invariant: LayoutInvariantReduction | None = None,
        expert_params: list[nn.Parameter] | None = None,
        ep_degree: int = 1,
    ):
        """``expert_params``: under expert parallelism (``ep_degree`` > 1), the parameters whose
        shards on different EP ranks hold different experts, not copies (see ``_total_norm``)."""
        self.model = model
        self.fsdp = model if isinstance(model, FSDPModule) else None
        self.loss_group = loss_group
        self.num_microbatches = num_microbatches
        self.max_norm = max_norm
        self.hsdp = hsdp
        self.keep_gathered = keep_gathered
        """FSDP over one rank (``ParallelDims.fsdp_one_rank``): the parameters stay gathered
        and the gradients unsharded until the last backward, whose reduction is then the step's
        only copy; nothing is exchanged, so nothing is deferred but copies."""
        self.defer_gradient_reduction = defer_gradient_reduction or keep_gathered
        self.gathered_experts = gathered_experts or []
        """The routed experts' units over one rank (``Workload.experts_stay_gathered``), kept
        gathered and their gradients unsharded until the last backward, as ``keep_gathered``
        does for a whole one-rank job."""
        self._distributed = loss_group is not None
        self.stats_group = stats_group or loss_group
        self.pp_degree = pp_degree
        self.layout_invariant = layout_invariant
        self._expert_ids = {id(p) for p in expert_params or []}
        self.ep_degree = ep_degree
        self._holds_loss = True
        self._sums: _StepSums | None = None
        self._next_microbatch = 0
        self.replicas: ReplicaGroups | None = None
        """Fault-tolerant replica groups (set when the run is built), over which the step's sums
        are summed once more."""

    def begin_step(self, labels: list[torch.Tensor]) -> None:
        """Count the step's valid labels and start summing the count over ranks.

        The all-reduce is asynchronous: N is needed only in ``finalize``, so the collective
        overlaps every forward and backward of the step.
        """
        if len(labels) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} micro-batches, got {len(labels)}")
        local_count = torch.stack([(lab != IGNORE_INDEX).sum() for lab in labels]).sum().to(torch.int64).reshape(1)
        count = local_count.clone()
        count_work = dist.all_reduce(count, group=self.loss_group, async_op=True) if self._distributed else None
        loss_sum = torch.zeros((), dtype=torch.float32, device=local_count.device)
        self._sums = _StepSums(local_count, count, count_work, loss_sum)
        self._next_microbatch = 0
        self._holds_loss = True
        if self.layout_invariant is not None:
            self.layout_invariant.begin_step()

    def prepare_backward(self, microbatch: int) -> None:
        """Tell FSDP whether this is the step's last backward, before running it.

        Under HSDP the cross-replica all-reduce is skipped until the last micro-batch (the
        reduce-scattered shards accumulate in between). ``defer_gradient_reduction`` also skips
        the reduce-scatter: unsharded gradients accumulate locally and are reduced once.
        """
        if microbatch != self._next_microbatch:
            raise ValueError(f"micro-batch {microbatch} out of order; expected {self._next_microbatch}")
        if self.fsdp is None or self.layout_invariant is not None:
            return
        is_last = microbatch == self.num_microbatches - 1
        self.fsdp.set_is_last_backward(is_last)
        if self.hsdp:
            self.fsdp.set_requires_all_reduce(is_last)
        if self.defer_gradient_reduction:
            self.fsdp.set_requires_gradient_sync(is_last)
        if self.keep_gathered:
            self.fsdp.set_reshard_after_backward(is_last)
        for experts in self.gathered_experts:
            experts.set_requires_gradient_sync(is_last, recurse=False)
            experts.set_reshard_after_backward(is_last, recurse=False)

    def record_loss(self, loss_sum: torch.Tensor) -> None:
        """Add a micro-batch's summed loss (after its backward) to the step's total; with
        ``debug.layout_invariant`` also take its gradient into the layout-independent sum.

        A loss-parallel loss is a replicated DTensor: every TP rank holds the same value.
        """
        if isinstance(loss_sum, DTensor):
            loss_sum = loss_sum.to_local()
        self._begun().loss_sum += loss_sum.detach().float()
        if self.layout_invariant is not None:
            self.layout_invariant.add_microbatch(loss_sum)
        self._next_microbatch += 1

    def record_pipeline_losses(self, losses: list[torch.Tensor]) -> None:
        """Under pipeline parallelism, after the schedule ran the whole step: the last stage's
        summed micro-batch losses, or nothing on the other stages (which then add 0 to the
        logged sum and -inf to the logged maximum)."""
        if self._next_microbatch != 0:
            raise ValueError("record_pipeline_losses replaces record_loss: call it once, for the whole step")
        sums = self._begun()
        for loss in losses:
            sums.loss_sum += (loss.to_local() if isinstance(loss, DTensor) else loss).detach().float()
        self._holds_loss = bool(losses)
        self._next_microbatch = self.num_microbatches

    def global_count(self) -> int:
        """The step's N, once its all-reduce is done: what the MoE balancing loss is scaled by
        before the first backward (``trainer/step/expert_balance.py``)."""
        return int(self._count().item())

    def _count(self) -> torch.Tensor:
        """The step's N, summed over the loss group and the replica groups (once)."""
        sums = self._begun()
        if sums.count_work is not None:
            sums.count_work.wait()
            sums.count_work = None
        if not sums.counted:
            if self.replicas is not None:
                sums.count = self.replicas.sum_count(sums.count)
            sums.counted = True
        return sums.count

    def _begun(self) -> _StepSums:
        if self._sums is None:
            raise RuntimeError("begin_step must come before the step's losses and finalize")
        return self._sums

    def finalize(self) -> StepResult:
        """Normalise and clip the accumulated gradient sums in one pass; decide whether to step.

        A step with no valid token, or with a non-finite gradient norm, must not move the
        weights: it is reported as skipped (the loop counts skips) and its gradients are left
        for the caller to zero.
        """
        if self._next_microbatch != self.num_microbatches:
            raise RuntimeError(f"finalize after {self._next_microbatch} of {self.num_microbatches} micro-batches")
        sums = self._begun()
        loss_sum = sums.loss_sum.clone().reshape(1)
        local_count = sums.local_count.float()
        rank_mean = torch.where(local_count > 0, loss_sum / local_count.clamp(min=1), -math.inf)
        if not self._holds_loss:
            rank_mean.fill_(-math.inf)
        loss_work = max_work = None
        if self._distributed:
            if self.layout_invariant is None:
                loss_work = dist.all_reduce(loss_sum, group=self.stats_group, async_op=True)
            max_work = dist.all_reduce(rank_mean, op=dist.ReduceOp.MAX, group=self.stats_group, async_op=True)
        if self.layout_invariant is not None:
            grads, squares, loss_sum = self.layout_invariant.finish()
            raw_norm, loss_sum = squares.sqrt().reshape(1), loss_sum.reshape(1)
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grads = [g for p in params if (g := p.grad) is not None]
            if self.replicas is not None:
                self.replicas.sum_([g.to_local() if isinstance(g, DTensor) else g for g in grads])
            spread = [self.ep_degree if id(p) in self._expert_ids else 1 for p in params]
            raw_norm = _total_norm(grads, self.pp_degree, spread).reshape(1).to(loss_sum.device)
        if self._distributed:
            for work in (loss_work, max_work):
                if work is not None:
                    work.wait()
        count = self._count()
        if self.replicas is not None:
            self.replicas.sum_([loss_sum])
            self.replicas.max_(rank_mean)
        # One host synchronisation for everything the step decision and the log need; float64
        # keeps token counts exact far beyond float32's 2**24.
        values = torch.cat([count.double(), raw_norm.double(), loss_sum.double(), rank_mean.double()])
        n, raw, total, worst = values.tolist()
        n = int(n)
        true_norm = raw / max(n, 1)
        loss_avg = total / n if n else math.nan
        loss_max = worst if n else math.nan
        if self.layout_invariant is not None and (not self._distributed or dist.get_rank() == 0):
            logger.info("exact step values: loss %s, tokens %d, grad norm %s", loss_avg.hex(), n, true_norm.hex())
        if n == 0 or not math.isfinite(true_norm):
            reason = "no valid label token in the global batch" if n == 0 else "non-finite gradient norm"
            logger.warning("skipping the optimizer step: %s", reason)
            return StepResult(loss_avg, loss_max, true_norm, n, skipped=True, skip_reason=reason)
        clip_coef = min(1.0, self.max_norm / (true_norm + 1e-6)) if self.max_norm > 0 else 1.0
        _foreach_scale_([g.to_local() if isinstance(g, DTensor) else g for g in grads], clip_coef / n)
        return StepResult(loss_avg, loss_max, true_norm, n, skipped=False)


def _total_norm(grads: list[torch.Tensor], pp_degree: int = 1, spread: list[int] | None = None) -> torch.Tensor:
    """2-norm over all gradients, each shard counted once and each replica not repeated.

    Every rank adds up the squares of its local shards, weighting a gradient by one over the
    number of ranks holding the same values (the sizes of the mesh dimensions it is replicated
    on, and the ranks outside its mesh, except the other pipeline stages, which hold other
    parameters); one all-reduce over all ranks then counts every element exactly once. The
    result is the same, to float32 round-off, whatever the sharding, which keeps the clip
    coefficient (and so every gradient) mesh-independent.

    ``spread[i]``: over how many ranks outside its mesh gradient ``i`` holds *different* values
    (the EP degree for routed experts, whose mesh leaves the EP ranks out), 1 for the others.
    """
    groups: dict[int, list[torch.Tensor]] = {}
    distributed = pp_degree > 1
    for g, ranks_apart in zip(grads, spread or [1] * len(grads)):
        copies = 1
        if isinstance(g, DTensor):
            distributed = True
            if any(isinstance(p, Partial) for p in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in g.placements])
            mesh = g.device_mesh
            copies = dist.get_world_size() // (mesh.size() * pp_degree * ranks_apart)
            for dim, placement in enumerate(g.placements):
                if isinstance(placement, Replicate):
                    copies *= mesh.size(dim)
            g = g.to_local()
        groups.setdefault(copies, []).append(g)
    total = sum((_sum_of_squares(tensors) / copies for copies, tensors in groups.items()), torch.zeros(()))
    if distributed:
        dist.all_reduce(total)
    return total.sqrt()


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Float32 sum of squares with small relative error also for tensors of millions of elements.

    CUDA's multi-tensor norm reduces as a tree and is accurate. PyTorch's CPU norm kernel
    accumulates each thread's range sequentially (about 1e-4 relative error on a 2048 x 256
    gradient, 1e-3 on larger ones), so on CPU each tensor is reduced in rows of ``_BLOCK``
    elements whose norms are then summed pairwise: one read of the data, error ~1e-7.
    """
    device = tensors[0].device
    if device.type == "cuda":
        norms = kernels.foreach_norm(tensors)
        return torch.stack(norms).square().sum()
    total = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        flat = t.reshape(-1)
        whole = flat.numel() // _BLOCK * _BLOCK
        if whole:
            rows = flat[:whole].view(-1, _BLOCK)
            total += torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square().sum()
        if whole < flat.numel():
            total += flat[whole:].float().square().sum()
    return total


_BLOCK = 1024


def _foreach_scale_(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply every tensor in place by one scalar: a single pass over the gradients."""
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_device_dtype.setdefault((t.device, t.dtype), []).append(t)
    for group in by_device_dtype.values():
        kernels.foreach_mul_(group, scale)
