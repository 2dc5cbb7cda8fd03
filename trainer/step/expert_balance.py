"""Balancing a Mixture-of-Experts over the whole step, exactly, on every mesh.

Two mechanisms, both defined on the step's *global* batch so that, like the loss, they do not
depend on the mesh or the accumulation count:

- **aux-loss-free bias** (DeepSeek-V3): after the step's backward, the tokens every MoE layer
  routed to each expert, summed over the step's micro-batches and the routing mesh (data-parallel
  ranks, context-parallel shards and tensor-parallel ranks, which route their own sequence
  shards: ``Meshes.routing``), move each expert's routing bias by ``bias_update_rate``
  towards the mean load (``sign``, centred). Counts are integers summed exactly, and each token
  is counted once: the layers skip the recomputation of activation checkpointing. A move that
  would leave a bias non-finite is not made, and the optimizer step is skipped as for a
  non-finite gradient.
- **balancing loss** ``E x sum_i f_i P_i`` per layer, in one of three scopes. For
  ``global_batch`` the frequencies ``f`` must be those of the whole step before the first
  backward, summed over the routing mesh (one all-reduce of layers x experts counts). The
  forward's values do not depend on ``f`` (only the loss's gradient does), so where the step can
  run every micro-batch's forward before any backward, its own forwards count them
  (``hold_forwards``): under full activation checkpointing, whose forwards keep only each block's
  input, ``trainer/step/train_step.py`` runs the step's forwards, this sums their counts, then every
  micro-batch's backward recomputes its blocks with the step's ``f``: no extra compute, and the
  step holds every micro-batch's block inputs until its backwards (the memory plan counts them;
  where they would not fit on a GPU they wait in host memory, ``trainer/step/host_offload.py``, and
  where that would not fit either the pre-pass counts: ``Workload.holds_forwards`` and ``fitted``
  in ``trainer/planning/held_for_speed.py``, ``moe.held_forwards``). Elsewhere (no or selective checkpointing,
  whose held forwards would keep every micro-batch's activations; pipeline parallelism, whose
  schedules interleave forwards and backwards; the loss unchunked, whose logits would be held) a
  forward-only
  **counting pre-pass** runs the step's micro-batches through the model without autograd first:
  one extra forward per micro-batch, about a quarter to a third of a step's compute (measured in
  ``benchmarks/moe_balance.py``). The loss's gradient is scaled by ``weight x N`` (the step's
  valid tokens) so that the accumulator's single ``1 / N`` leaves it at ``weight``.

**Layers pooled** (``balance_loss_layers = "pooled"``, transformers' ``output_router_logits``
aux loss): one ``E x sum_i f_i P_i`` over every MoE layer's tokens together, ``f_i`` the choices
of expert ``i`` per token-layer (summing to k), ``P_i`` its mean probability over token-layers.
In the ``global_batch`` scope each layer's part uses the counts of all layers summed, so the
parts add up to the pooled loss; the step's counts are therefore summed over the pipeline
stages too.

**Pipeline parallelism.** A rank holds only its stages' MoE layers. The pre-pass runs the
step's micro-batches forward-only through the pipeline (``Pipeline.forward_only``) and each stage
counts its own layers; per layer, those counts are summed over the routing mesh alone. The step's
statistics, and the pooled loss's counts, are whole-model tables ``(MoE layers, experts)``, a
rank filling the rows of its layers and leaving zeros elsewhere, so one sum over the pipeline
ranks and the routing mesh gives every rank the whole model's.

**Fault-tolerant replica groups** (``trainer/replica_groups.py``): a step is one process's step
over the micro-batches of the groups that took part in it. Each sum above, once done over the
routing mesh, is done again over the participating groups (:class:`AcrossGroups`), and the
step's global sizes (``Balancing.global_tokens`` and the others) are the group's times the
participants, set after the step's quorum and before its first forward. Every group then
decides and makes the same bias move, or refuses the same non-finite one, from the same sums;
a group that was left out receives its peers' biases when it heals (they are model buffers).
A move made in a step that does not commit is taken back (:meth:`ExpertBalance.undo_bias_move`).

The step's statistics (:class:`BalanceStats`): the balancing loss (mean over MoE layers, or the
pooled loss, summed over the routing mesh) and each layer's max / mean expert load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from parallelisms.model_parts import blocks
from trainer.model.moe import Balancing, MoE, global_balance, moe_layers


@dataclass(frozen=True)
class BalanceStats:
    balance_loss: float | None
    """Mean over MoE layers of ``E x sum_i f_i P_i`` over the step, or the layers' pooled loss
    (None when the loss is off)."""
    max_load: list[float]
    """Per MoE layer: the busiest expert's tokens over the mean tokens per expert."""
    tokens_per_expert: torch.Tensor
    """``(layers, experts)`` global counts of the step."""
    expert_bias: torch.Tensor
    """``(layers, experts)`` routing biases after the update."""


class AcrossGroups(Protocol):
    """The fault-tolerant replica groups of the step, as the balancing sees them."""

    def participants(self) -> int:
        """How many groups take part in the step (known once its quorum is agreed)."""
        ...

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor in place over the groups that take part in the step."""
        ...


class ExpertBalance:
    """Per step: ``begin_step`` before the first forward, ``finish_step`` after the last backward,
    before the optimizer step (which it may skip: ``bias_skipped``)."""

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
        loss_layers: str = "per_layer",
        moe_layer_ids: Sequence[int] | None = None,
        n_experts: int = 0,
        stats_group: dist.ProcessGroup | None = None,
        pp_group: dist.ProcessGroup | None = None,
        hold_forwards: bool = False,
    ):
        """``moe_layer_ids``: the block index of every MoE layer of the whole model (default:
        those ``model`` holds); under pipeline parallelism ``stats_group`` is the routing mesh times
        the pipeline ranks and ``pp_group`` the pipeline ranks alone (a stage may hold no MoE
        layer; ``n_experts`` then sizes its rows). ``hold_forwards``: the step runs every forward
        before any backward and calls ``count_forwards`` in between, instead of the pre-pass
        (``Workload.holds_forwards`` in ``trainer/planning/memory_plan.py`` decides)."""
        held = [(int(name), layer) for name, block in blocks(model).items() for layer in moe_layers(block)]
        ids = list(moe_layer_ids) if moe_layer_ids is not None else [i for i, _ in held]
        self.layers: list[MoE] = [layer for _, layer in held]
        self.rows = [ids.index(i) for i, _ in held]
        """The whole model's row of each of this rank's MoE layers."""
        self.n_rows = len(ids)
        self.n_experts = self.layers[0].n_experts if self.layers else n_experts
        self.device = self.layers[0].expert_bias.device if self.layers else next(model.parameters()).device
        self.loss_group = loss_group
        self.stats_group = stats_group or loss_group
        self.pp_group = pp_group
        self.bias_update_rate = bias_update_rate
        self.bias_skipped = False
        """Whether the last ``finish_step`` refused a bias move that was not finite."""
        self.hold_forwards = hold_forwards and loss_weight > 0 and loss_scope == "global_batch"
        self.pooled = loss_layers == "pooled"
        self.group_sizes = (global_batch * seq_len, global_batch, global_microbatches)
        """This job's tokens, sequences and micro-batches per step: the step's, times the
        participating replica groups under fault tolerance."""
        self.groups: AcrossGroups | None = None
        """Fault-tolerant replica groups, set with them (``trainer/build.py``), else None."""
        self._bias_before: list[torch.Tensor] = []
        """This rank's biases before the last step's move, which ``undo_bias_move`` restores."""
        tokens, sequences, microbatches = self.group_sizes
        self.balancing = Balancing(
            weight=loss_weight,
            scope=loss_scope,
            global_tokens=tokens,
            global_sequences=sequences,
            global_microbatches=microbatches,
            pooled_layers=self.n_rows if self.pooled else 0,
            grad_scale=torch.zeros((), device=self.device),
        )
        for layer in self.layers:
            layer.balancing = self.balancing

    @property
    def counting_prepass(self) -> bool:
        return self.balancing.weight > 0 and self.balancing.scope == "global_batch" and not self.hold_forwards

    def begin_step(self, prepass: Callable[[], None], n_valid_tokens: Callable[[], int]) -> None:
        """Clear the step's counters; for the balancing loss, learn the step's N and (global scope,
        unless the step holds its forwards) run ``prepass`` (every micro-batch's forward) to count
        the global routing."""
        for layer in self.layers:
            layer.reset_counters()
        self._bias_before = []
        participants = self.groups.participants() if self.groups is not None else 1
        tokens, sequences, microbatches = self.group_sizes
        self.balancing.global_tokens = participants * tokens
        self.balancing.global_sequences = participants * sequences
        self.balancing.global_microbatches = participants * microbatches
        if self.balancing.weight == 0:
            return
        self.balancing.grad_scale.fill_(self.balancing.weight * n_valid_tokens())
        if not self.counting_prepass:
            return
        self.balancing.prepass = True
        try:
            with torch.no_grad():
                prepass()
        finally:
            self.balancing.prepass = False
        self._share([layer.global_counts for layer in self.layers])

    def count_forwards(self) -> None:
        """With ``hold_forwards``, after the step's forwards and before its first backward: the
        step's global counts from what the forwards counted, for the recomputations to read."""
        self._share([layer.tokens_per_expert for layer in self.layers])

    def _share(self, local: list[torch.Tensor]) -> None:
        """Set every layer's ``global_counts`` to the step's: ``local`` (a row per layer) summed
        over the routing mesh (then the participating replica groups), and for pooled layers
        over the layers and pipeline stages too.

        Written through ``.data``: under compile a checkpointed block's graph may keep the
        buffer itself for its recomputation, which must read the new counts, and an in-place
        write autograd sees would make that backward refuse a modified saved tensor."""
        if self.pooled:
            # Every layer's part needs all layers' counts, those of the other stages included.
            counts = self._whole(local)
            self._sum(counts, self.stats_group)
            self._sum_groups(counts)
            for layer in self.layers:
                layer.global_counts.data.copy_(counts.sum(0))
            return
        if not self.layers:  # nor do the routing mesh's other ranks: they run the same stages
            return
        counts = torch.stack([row.detach() for row in local])
        self._sum(counts, self.loss_group)
        self._sum_groups(counts)
        for layer, row in zip(self.layers, counts):
            layer.global_counts.data.copy_(row)

    def finish_step(self, skipped: bool) -> BalanceStats:
        """Sum the step's counts and balancing loss over the routing mesh and the pipeline stages
        (then the participating replica groups); move the biases unless the optimizer step is
        skipped, or the move would leave a bias non-finite: then ``bias_skipped`` is set and the
        caller skips the optimizer step too, as for a non-finite gradient (a NaN bias would route
        every later token by garbage). Every group decides alike: it moves from the same biases
        by the same sums."""
        if self.balancing.weight > 0 and self.balancing.scope == "global_batch":
            for layer in self.layers:
                layer.balance_sum.copy_(
                    global_balance(layer.prob_sum, layer.global_counts, layer.top_k, self.balancing)
                )
        counts = self._whole([layer.tokens_per_expert for layer in self.layers])
        losses = self._whole([layer.balance_sum.reshape(1) for layer in self.layers], 1)[:, 0]
        summed = torch.cat([counts.flatten(), losses])
        self._sum(summed, self.stats_group)
        self._sum_groups(summed)
        counts, losses = summed[: counts.numel()].view_as(counts), summed[counts.numel() :]
        moving = not skipped and self.bias_update_rate > 0
        moved = [layer.expert_bias for layer in self.layers]
        if moving:
            moved = [layer.expert_bias + self._bias_step(counts[row]) for layer, row in zip(self.layers, self.rows)]
        # Now and moved, whole-model, in one sum over the stages: every rank decides alike.
        biases = torch.stack([self._whole([layer.expert_bias for layer in self.layers]), self._whole(moved)])
        self._sum(biases, self.pp_group)
        self.bias_skipped = moving and not bool(torch.isfinite(biases[1]).all())
        if moving and not self.bias_skipped:
            self._bias_before = [biases[0, row] for row in self.rows]  # the table above already copied them
            for layer, bias in zip(self.layers, moved):
                layer.expert_bias.copy_(bias)
        max_load = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        balance_loss = None
        if self.balancing.weight > 0:
            balance_loss = (losses.sum() if self.pooled else losses.mean()).item()
        return BalanceStats(
            balance_loss=balance_loss,
            max_load=max_load,
            tokens_per_expert=counts,
            expert_bias=biases[int(not self.bias_skipped)],
        )

    def undo_bias_move(self) -> None:
        """The step did not commit (its replica groups' quorum broke): its bias move is taken
        back with the rest of it, so that the step run again moves from the same biases."""
        for layer, bias in zip(self.layers, self._bias_before):
            layer.expert_bias.copy_(bias)
        self._bias_before = []

    def _bias_step(self, load: torch.Tensor) -> torch.Tensor:
        """Each expert's bias move: ``bias_update_rate`` towards the mean load, centred."""
        step = self.bias_update_rate * torch.sign(load.mean() - load)
        return step - step.mean()

    def _whole(self, rows: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
        """The whole model's ``(MoE layers, width)`` table (width: experts by default) with this
        rank's ``rows`` filled in."""
        table = torch.zeros((self.n_rows, width or self.n_experts), device=self.device)
        for row, values in zip(self.rows, rows):
            table[row] = values.detach()
        return table

    def _sum_groups(self, t: torch.Tensor) -> None:
        if self.groups is not None:
            self.groups.sum_([t])

    @staticmethod
    def _sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        if group is not None:
            dist.all_reduce(t, group=group)
