"""Balancing a Mixture-of-Experts over the whole step, exactly, on every mesh.

Both mechanisms are defined on the step's *global* batch, so that, like the loss, they do not
depend on the mesh or the accumulation count:

- **aux-loss-free bias** (DeepSeek-V3): after the step's backward, the tokens each MoE layer routed
  to each expert, summed over the micro-batches and the routing mesh (``sums.Ranks.ROUTING``),
  move each expert's bias by ``bias_update_rate`` towards the mean load (``sign``, centred). A
  move that would leave a bias non-finite is not made, and the step is skipped.
- **balancing loss** ``E x sum_i f_i P_i`` in a scope. For ``global_batch`` the frequencies ``f``
  are those of the whole step, known before the first backward: the schedule counts them first
  (``schedules.py``), in a forward-only pre-pass, or in the step's own forwards when they are held
  until the backwards (full activation checkpointing: the backwards' recomputations then read
  ``f``). Its gradient enters the summed loss's backward scaled by ``weight x N``, so the
  accumulator's one ``1 / N`` leaves it at ``weight``. With ``pooled`` layers (transformers' aux
  loss) one loss over every MoE layer's tokens, whose counts are summed over the stages too.

Every layer hands what it routed to :meth:`ExpertBalance.routed`, which decides: a forward inside
backward (a recomputation) or a pipeline stage learning its shapes counts nothing, a validation
forward (between steps) neither counts nor carries the loss. Under pipeline parallelism a rank
holds only its stages' layers; the step's statistics are whole-model tables ``(MoE layers,
experts)``, each rank filling its rows, summed over the stages and the routing mesh. With replica
groups every sum goes on over the participating groups (``sums.py``), so every group moves the
same biases; a move in a step that did not commit is taken back (:meth:`ExpertBalance.undo`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from parallelisms.model_parts import blocks
from parallelisms.torch_private import kernels, pipelining
from trainer.model.moe import AddBalanceLoss, Balancing, MoE, Routed, balance_part, global_balance, moe_layers
from trainer.step.part import StepPart, StepResult
from trainer.step.sums import Logged, Ranks, StepSums

logger = logging.getLogger("meshtrain")

BALANCE_LOSS = Logged("moe/balance_loss", "balance loss", "moe/balancing loss")
LOAD_CHART = "moe/expert load max/mean per layer"

COUNTING = ("prepass", "forwards", "none")
"""How the step learns the routing before its first backward: a forward-only pre-pass, its own
held forwards, or not at all (no ``global_batch`` balancing loss)."""


@dataclass(frozen=True)
class BalanceSettings:
    """The balancing as the plan resolves it (``moe.*``), with the step's global sizes."""

    bias_update_rate: float
    loss_weight: float
    loss_scope: str
    loss_layers: str
    global_sizes: tuple[int, int, int]
    """One replica group's tokens, sequences and micro-batches per step."""
    moe_layer_ids: tuple[int, ...]
    """The block index of every MoE layer of the whole model."""
    n_experts: int
    counting: str = "none"


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


class ExpertBalance(StepPart):
    """Resets the layers' counters as the step begins, shares the counting forwards' routing,
    and after the step sums the tables and moves the biases (or skips the step)."""

    def __init__(self, model: nn.Module, sums: StepSums, settings: BalanceSettings):
        held = [(int(name), layer) for name, block in blocks(model).items() for layer in moe_layers(block)]
        ids = list(settings.moe_layer_ids)
        self.layers: list[MoE] = [layer for _, layer in held]
        self.rows = [ids.index(i) for i, _ in held]
        """The whole model's row of each of this rank's MoE layers."""
        self.n_rows = len(ids)
        self.n_experts = settings.n_experts
        self.device = self.layers[0].expert_bias.device if self.layers else next(model.parameters()).device
        self.sums = sums
        self.settings = settings
        self.pooled = settings.loss_layers == "pooled"
        exact = settings.loss_weight > 0 and settings.loss_scope == "global_batch"
        self.counting = settings.counting if exact else "none"
        self.last: BalanceStats | None = None
        """The statistics of the last step that finished."""
        self._bias_before: list[torch.Tensor] = []
        self._phase = "between steps"
        tokens, sequences, microbatches = settings.global_sizes
        self.balancing = Balancing(
            weight=settings.loss_weight,
            scope=settings.loss_scope,
            global_tokens=tokens,
            global_sequences=sequences,
            global_microbatches=microbatches,
            pooled_layers=self.n_rows if self.pooled else 0,
            grad_scale=torch.zeros((), device=self.device),
        )
        hook = self.routed  # one bound method for every layer: compile guards on its identity
        for layer in self.layers:
            layer.register_routing_hook(hook)

    def begin(self, batch: list) -> None:
        """Clear the step's counters and set its global sizes (times the participating replica
        groups); for the balancing loss, its gradient's scale ``weight x N``."""
        for layer in self.layers:
            layer.reset_counters()
        self._bias_before = []
        participants = self.sums.participants()
        tokens, sequences, microbatches = self.settings.global_sizes
        self.balancing.global_tokens = participants * tokens
        self.balancing.global_sequences = participants * sequences
        self.balancing.global_microbatches = participants * microbatches
        if self.balancing.weight > 0:
            self.balancing.grad_scale.fill_(self.balancing.weight * int(self.sums.count().item()))
        self._phase = "pre-pass" if self.counting == "prepass" else "step"

    def forwards_done(self) -> None:
        """The counting forwards have run: every layer's ``global_counts`` becomes the step's."""
        if self.counting == "prepass":
            self._share([layer.global_counts for layer in self.layers])
        elif self.counting == "forwards":
            self._share([layer.tokens_per_expert for layer in self.layers])
        self._phase = "step"

    def routed(self, layer: MoE, routed: Routed, out: torch.Tensor) -> torch.Tensor:
        """A layer's routing hook: count what a training forward routed (once: not in a
        recomputation, which the op itself skips, nor in a stage's shape-learning pass) and attach
        the layer's part of the balancing loss to its output."""
        if self._phase == "between steps" or pipelining.in_metadata_inference():
            return out
        if self._phase == "pre-pass":
            layer.global_counts += routed.counts
            return out
        if not torch.is_grad_enabled():
            return out
        kernels.add_unless_in_backward([layer.tokens_per_expert], [routed.counts])
        balancing = self.balancing
        if balancing.weight == 0:
            return out
        probs, chosen, counts, sequences = routed
        part = balance_part(probs, chosen, counts, layer.global_counts, sequences, balancing)
        # The logged loss: in the global scope made from the summed probabilities at the step's end.
        if balancing.scope == "global_batch":
            kernels.add_unless_in_backward([layer.prob_sum], [probs.detach().sum(0)])
        else:
            kernels.add_unless_in_backward([layer.balance_sum], [part.detach()])
        return AddBalanceLoss.apply(out, part, balancing.grad_scale)

    def _share(self, local: list[torch.Tensor]) -> None:
        """Set every layer's ``global_counts`` to the step's: ``local`` (a row per layer) summed
        over the routing mesh, and for pooled layers over the layers and stages too.

        Written through ``.data``: under compile a checkpointed block's graph may keep the
        buffer itself for its recomputation, which must read the new counts, and an in-place
        write autograd sees would make that backward refuse a modified saved tensor."""
        if self.pooled:  # every layer's part needs all layers' counts, the other stages' included
            counts = self._whole(local)
            self.sums.sum_([counts], Ranks.MODEL)
            for layer in self.layers:
                layer.global_counts.data.copy_(counts.sum(0))
            return
        if not self.layers:  # nor do the routing mesh's other ranks: they run the same stages
            return
        counts = torch.stack([row.detach() for row in local])
        self.sums.sum_([counts], Ranks.ROUTING)
        for layer, row in zip(self.layers, counts):
            layer.global_counts.data.copy_(row)

    def finish(self, result: StepResult) -> None:
        """Sum the step's counts and balancing loss over the model's ranks; move the biases unless
        the step is skipped, or the move would leave a bias non-finite: then the step is skipped,
        as for a non-finite gradient (a NaN bias would route every later token by garbage). Every
        rank and group decides alike: it moves from the same biases by the same sums."""
        self._phase = "between steps"
        if self.balancing.weight > 0 and self.balancing.scope == "global_batch":
            for layer in self.layers:
                layer.balance_sum.copy_(
                    global_balance(layer.prob_sum, layer.global_counts, layer.top_k, self.balancing)
                )
        counts = self._whole([layer.tokens_per_expert for layer in self.layers])
        losses = self._whole([layer.balance_sum.reshape(1) for layer in self.layers], 1)[:, 0]
        summed = torch.cat([counts.flatten(), losses])
        self.sums.sum_([summed], Ranks.MODEL)
        counts, losses = summed[: counts.numel()].view_as(counts), summed[counts.numel() :]
        rate = self.settings.bias_update_rate
        moving = not result.skipped and rate > 0
        moved = [layer.expert_bias for layer in self.layers]
        if moving:
            moved = [layer.expert_bias + self._bias_step(counts[row]) for layer, row in zip(self.layers, self.rows)]
        # Now and moved, whole-model, in one sum over the stages: every rank decides alike.
        biases = torch.stack([self._whole([layer.expert_bias for layer in self.layers]), self._whole(moved)])
        self.sums.sum_([biases], Ranks.PIPELINE)
        refused = moving and not bool(torch.isfinite(biases[1]).all())
        if refused:
            reason = f"non-finite routing bias after its move by `moe.bias_update_rate` = {rate:g}"
            logger.warning("skipping the optimizer step: %s", reason)
            result.skip(reason)
        elif moving:
            self._bias_before = [biases[0, row] for row in self.rows]  # the table above already copied them
            for layer, bias in zip(self.layers, moved):
                layer.expert_bias.copy_(bias)
        max_load = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
        balance_loss = None
        if self.balancing.weight > 0:
            balance_loss = (losses.sum() if self.pooled else losses.mean()).item()
        self.last = BalanceStats(balance_loss, max_load, counts, biases[int(not refused)])
        reported = ([] if balance_loss is None else [balance_loss]) + max_load
        result.values.update({logged.tag: value for logged, value in zip(self.logged(), reported)})

    def logged(self) -> tuple[Logged, ...]:
        """The balancing loss (when it is on), then each MoE layer's busiest expert over the mean."""
        loads = tuple(
            Logged(f"moe/load_max_over_mean/layer_{i}", "expert load max/mean per layer", LOAD_CHART, digits=2)
            for i in self.settings.moe_layer_ids
        )
        return (BALANCE_LOSS,) + loads if self.balancing.weight > 0 else loads

    def undo(self) -> None:
        """The step did not commit (its replica groups' quorum broke): its bias move is taken
        back with the rest of it, so that the step run again moves from the same biases."""
        for layer, bias in zip(self.layers, self._bias_before):
            layer.expert_bias.copy_(bias)
        self._bias_before = []

    def _bias_step(self, load: torch.Tensor) -> torch.Tensor:
        """Each expert's bias move: ``bias_update_rate`` towards the mean load, centred."""
        step = self.settings.bias_update_rate * torch.sign(load.mean() - load)
        return step - step.mean()

    def _whole(self, rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
        """The whole model's ``(MoE layers, width)`` table (width: experts by default) with this
        rank's ``rows`` filled in."""
        table = torch.zeros((self.n_rows, width or self.n_experts), device=self.device)
        for row, values in zip(self.rows, rows):
            table[row] = values.detach()
        return table
