"""FSDP's gradient reduction over a step: when it reduces, and the norm of what it reduced.

FSDP reduces the micro-batches' gradients by sum (``parallelisms/fsdp.py``). Under HSDP the
cross-replica all-reduce runs only on the last micro-batch; with
``training.defer_gradient_reduction`` the reduce-scatter waits for it too, the unsharded gradients
accumulating locally. After the step's last backward the gradients are FSDP's shards, summed over
the replica groups that took part (``sums.py``), and their norm counts every element once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate

from parallelisms.expert_parallel import expert_params, gathered_experts
from parallelisms.torch_private import kernels
from trainer.step.part import StepPart
from trainer.step.sums import StepSums


class GradSync(StepPart):
    """Tells FSDP before each backward whether it is the step's last; after the step, the summed
    gradients and their norm (:meth:`reduced`)."""

    def __init__(
        self,
        model: nn.Module,
        sums: StepSums,
        *,
        microbatches: int,
        hsdp: bool = False,
        defer: bool = False,
        keep_gathered: bool = False,
        experts_stay_gathered: bool = False,
        degrees: tuple[int, int] = (1, 1),
    ):
        """``keep_gathered``: FSDP over one rank, whose parameters stay gathered and gradients
        unsharded until the last backward (nothing is exchanged, so nothing but copies is
        deferred); ``experts_stay_gathered``: the routed experts' units over one rank likewise;
        ``degrees``: ``(pp, ep)``, whose ranks hold other parameters (see :func:`total_norm`)."""
        self.model = model
        self.fsdp = model if isinstance(model, FSDPModule) else None
        self.sums = sums
        self.microbatches = microbatches
        self.hsdp = hsdp
        self.keep_gathered = keep_gathered
        self.defer = defer or keep_gathered
        self.gathered_experts = gathered_experts(model) if experts_stay_gathered else []
        self.pp, self.ep = degrees
        self._expert_ids = {id(p) for p in expert_params(model)}

    def before_backward(self, microbatch: int) -> None:
        if self.fsdp is None:
            return
        is_last = microbatch == self.microbatches - 1
        self.fsdp.set_is_last_backward(is_last)
        if self.hsdp:
            self.fsdp.set_requires_all_reduce(is_last)
        if self.defer:
            self.fsdp.set_requires_gradient_sync(is_last)
        if self.keep_gathered:
            self.fsdp.set_reshard_after_backward(is_last)
        for experts in self.gathered_experts:
            experts.set_requires_gradient_sync(is_last, recurse=False)
            experts.set_reshard_after_backward(is_last, recurse=False)

    def reduced(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The step's summed gradients (over the replica groups too) and their norm, ``(1,)``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [g for p in params if (g := p.grad) is not None]
        self.sums.sum_groups_([g.to_local() if isinstance(g, DTensor) else g for g in grads])
        spread = [self.ep if id(p) in self._expert_ids else 1 for p in params]
        return grads, total_norm(grads, self.pp, spread).reshape(1)


def total_norm(grads: list[torch.Tensor], pp_degree: int = 1, spread: list[int] | None = None) -> torch.Tensor:
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
