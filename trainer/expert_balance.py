"""Balancing a Mixture-of-Experts over the whole step, exactly, on every mesh.

Two mechanisms, both defined on the step's *global* batch so that, like the loss, they do not
depend on the mesh or the accumulation count:

- **aux-loss-free bias** (DeepSeek-V3): after the optimizer step, the tokens every MoE layer
  routed to each expert, summed over the step's micro-batches and the routing mesh (data-parallel
  ranks, context-parallel shards and tensor-parallel ranks, which route their own sequence
  shards: ``Meshes.routing``), move each expert's routing bias by ``bias_update_rate``
  towards the mean load (``sign``, centred). Counts are integers summed exactly, and each token
  is counted once: the layers skip the recomputation of activation checkpointing.
- **balancing loss** ``E x sum_i f_i P_i`` per layer, in one of three scopes. For
  ``global_batch`` the frequencies ``f`` must be those of the whole step before the first
  backward: a forward-only **counting pre-pass** runs the step's micro-batches through the
  model without autograd and sums the routing over the routing mesh (one all-reduce of layers x
  experts counts). It costs one extra forward per micro-batch, about a third of a step's compute
  (measured in ``benchmarks/moe.py``); the alternative, holding every micro-batch's graph until
  the counts are known, would cost the accumulation's memory saving. The loss's gradient is
  scaled by ``weight x N`` (the step's valid tokens) so that the accumulator's single ``1 / N``
  leaves it at ``weight``.

The step's statistics (:class:`BalanceStats`): the balancing loss (mean over MoE layers, summed
over the routing mesh) and each layer's max / mean expert load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.model.moe import Balancing, MoE, moe_layers


@dataclass(frozen=True)
class BalanceStats:
    balance_loss: float | None
    """Mean over MoE layers of ``E x sum_i f_i P_i`` over the step (None when the loss is off)."""
    max_load: list[float]
    """Per MoE layer: the busiest expert's tokens over the mean tokens per expert."""
    tokens_per_expert: torch.Tensor
    """``(layers, experts)`` global counts of the step."""
    expert_bias: torch.Tensor
    """``(layers, experts)`` routing biases after the update."""


class ExpertBalance:
    """Per step: ``begin_step`` before the first forward, ``finish_step`` after the optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        loss_group: dist.ProcessGroup | None,
        *,
        bias_update_rate: float,
        loss_weight: float,
        loss_scope: str,
        global_batch: int,
        seq_len: int,
        global_microbatches: int,
    ):
        self.layers: list[MoE] = moe_layers(model)
        self.loss_group = loss_group
        self.bias_update_rate = bias_update_rate
        self.balancing = Balancing(
            weight=loss_weight,
            scope=loss_scope,
            global_tokens=global_batch * seq_len,
            global_sequences=global_batch,
            global_microbatches=global_microbatches,
        )
        for layer in self.layers:
            layer.balancing = self.balancing

    @property
    def counting_prepass(self) -> bool:
        return self.balancing.weight > 0 and self.balancing.scope == "global_batch"

    def begin_step(self, prepass: Callable[[], None], n_valid_tokens: Callable[[], int]) -> None:
        """Clear the step's counters; for the balancing loss, learn the step's N and (global scope)
        run ``prepass`` (every micro-batch's forward) to count the global routing."""
        for layer in self.layers:
            layer.reset_counters()
        if self.balancing.weight == 0:
            return
        self.balancing.grad_scale = self.balancing.weight * n_valid_tokens()
        if self.counting_prepass:
            self.balancing.prepass = True
            try:
                with torch.no_grad():
                    prepass()
            finally:
                self.balancing.prepass = False
            counts = torch.stack([layer.global_counts for layer in self.layers])
            self._sum(counts)
            for layer, row in zip(self.layers, counts):
                layer.global_counts.copy_(row)

    def finish_step(self, skipped: bool) -> BalanceStats:
        """Sum the step's counts and balancing loss over the routing mesh; move the biases unless
        the optimizer step was skipped."""
        counts = torch.stack([layer.tokens_per_expert for layer in self.layers])
        losses = torch.stack([layer.balance_sum for layer in self.layers])
        summed = torch.cat([counts.flatten(), losses])
        self._sum(summed)
        counts, losses = summed[: counts.numel()].view_as(counts), summed[counts.numel() :]
        if not skipped and self.bias_update_rate > 0:
            for layer, load in zip(self.layers, counts):
                step = self.bias_update_rate * torch.sign(load.mean() - load)
                layer.expert_bias += step - step.mean()
        max_load = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        return BalanceStats(
            balance_loss=losses.mean().item() if self.balancing.weight > 0 else None,
            max_load=max_load,
            tokens_per_expert=counts,
            expert_bias=torch.stack([layer.expert_bias for layer in self.layers]).detach().clone(),
        )

    def _sum(self, t: torch.Tensor) -> None:
        if self.loss_group is not None:
            dist.all_reduce(t, group=self.loss_group)
