"""The memory of a Mixture-of-Experts block, for the per-rank estimate (``memory_plan.py``).

What differs from a dense block, per rank:

* **parameters**: the router and the shared experts are dense layers in the block's FSDP unit;
  the routed experts are split over ``ep`` ranks (taken from ``dp_shard x cp``) and sharded
  again over the ``dp_shard x cp / ep`` ranks outside the EP group, so their float32 state is
  spread over ``dp_shard x cp`` ranks like the rest, but FSDP gathers only a rank's own
  ``n_experts / ep`` experts of a block: more ``ep`` shrinks the gathered weights and their
  unsharded gradients, not the optimizer state. Tensor parallelism does not split a MoE's
  weights: the router and shared experts are replicated over TP and the experts split by EP, but
  FSDP shards both over ``tp`` too (``replicated_fsdp``, ``expert_shard``), so their state per
  rank is ``1 / (dp_shard x cp x tp)`` of it like a dense layer's, while what a rank gathers
  of them is whole (``memory_plan.py`` divides only the dense layers' by ``tp``);
* **activations**, per token the MoE routes: the rank's sequence shard (``tokens / tp`` under
  sequence-parallel TP, of its ``tokens / cp`` under CP; ``memory_plan.py`` counts them so, and
  under TP the norm's shard as the MoE's input instead of the dense feed-forward's all-gathered
  one). The routed tokens are ``top_k`` rows per token, and the rank holding the
  busiest experts receives more than its share, ``imbalance`` times it
  (``--target.routing_imbalance``: dropless routing sends every token where the router says).
  Kept for backward per MoE block: the router's float32 probabilities, the received rows sorted
  by expert (input of two grouped matmuls), the four ``hidden``-wide SwiGLU intermediates of each
  received row, the experts' output rows and the rows combined back (``index_copy`` keeps its
  source), the combined rows before their weighting, the shared experts' intermediates, and the
  routing's int64 orders. The token exchange's dispatch and combine buffers (the received
  rows and their gradients) live while a block is computed or recomputed;
* **selective ``op`` checkpointing** keeps the matmuls' outputs (router logits, shared experts)
  and recomputes the grouped matmuls and the exchange;
* **exact balancing's held forwards**: with the ``global_batch`` balancing loss under full
  checkpointing the step runs every micro-batch's forward before any backward
  (``Workload.holds_forwards``), so every micro-batch's block inputs and final hidden states
  are held at once until its backward;
* **under pipeline parallelism** a stage holds its own MoE blocks only, but their gathered
  experts and unsharded expert gradients stay for the whole step (``PipelineStage`` defers
  FSDP's reshard and reduce: ``Workload.unsharded`` in ``memory_plan.py``), and the routed
  tokens' activations are those of each micro-batch the schedule keeps in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.model.llama3 import ModelArgs
from trainer.model.moe import MoEArgs


@dataclass(frozen=True)
class RoutedExperts:
    """A Mixture-of-Experts model's routed experts, as the estimate needs them."""

    n_experts: int
    top_k: int
    hidden: int
    """Hidden units of each routed expert."""
    shared_hidden: int
    """Hidden units of the shared experts together (0: none)."""
    dense_layers: int
    """The first blocks, which keep the dense feed-forward."""
    ep: int = 1
    imbalance: float = 1.0
    """The routed tokens the busiest EP rank receives, over the average."""
    whole_sequences: bool = False
    """The balancing loss needs whole sequences on a rank (``moe.balance_loss_scope`` =
    "sequence"): TP and CP, which split them, are refused (``expert_checks.check_experts``)."""
    exact_balance: bool = False
    """The balancing loss counts its frequencies over the whole step (``moe.balance_loss_scope`` =
    "global_batch"): before the first backward, by a pre-pass or the held forwards
    (``Workload.holds_forwards``)."""

    def feed_forward_params(self, dim: int) -> int:
        """A MoE block's router, shared experts and every routed expert."""
        return dim * self.n_experts + 3 * dim * self.shared_hidden + 3 * dim * self.hidden * self.n_experts

    def gathered_params(self, dim: int) -> int:
        """What FSDP gathers of a MoE block's feed-forward on one rank: its own experts only."""
        return dim * self.n_experts + 3 * dim * self.shared_hidden + self.routed_params(dim)

    def routed_params(self, dim: int) -> int:
        """A MoE block's routed experts on one rank: its own ``n_experts / ep``."""
        return 3 * dim * self.hidden * self.n_experts // self.ep

    def received_rows(self) -> float:
        """Routed rows per local token the busiest rank computes (its own ``top_k`` when alone)."""
        return self.top_k * (self.imbalance if self.ep > 1 else 1.0)

    def kept(self, dim: int, compute_bytes: int) -> float:
        """Bytes per local token one MoE block's feed-forward keeps for backward (no checkpointing)."""
        rows, b = self.received_rows(), compute_bytes
        router = self.n_experts * 4 + self.top_k * (8 + 4 + b) + 4
        orders = 8 * (2 * self.top_k + rows)
        # index_copy keeps its source for backward: the experts' output rows (sent back under
        # EP), and the rows combined back on this rank.
        outputs = rows * dim if self.ep > 1 else 0
        routed = rows * (dim + 4 * self.hidden) + outputs + 2 * self.top_k * dim
        return router + orders + routed * b + 4 * self.shared_hidden * b

    def exchange(self, dim: int, compute_bytes: int) -> float:
        """Bytes per local token of the dispatch and combine buffers while a block runs."""
        return 2 * (self.received_rows() + self.top_k) * dim * compute_bytes

    def kept_op(self, dim: int, compute_bytes: int) -> float:
        """Bytes per local token kept under selective ``op`` checkpointing: the matmuls' outputs
        (the router's, the routed experts' three, the shared experts') and, under EP, the token
        all-to-alls' (``parallelisms/activation_checkpoint.py``)."""
        rows = self.received_rows()
        routed = rows * (2 * self.hidden + dim)
        exchanged = (rows + self.top_k) * dim if self.ep > 1 else 0
        shared = 2 * self.shared_hidden + dim if self.shared_hidden else 0
        return (self.n_experts + routed + exchanged + shared) * compute_bytes


def routed_experts(args: ModelArgs, ep: int, imbalance: float, whole=False, exact=False) -> RoutedExperts | None:
    """The routed experts of ``args``'s MoE blocks over ``ep`` ranks; None for a dense model.
    ``whole``: a sequence-scoped balancing loss; ``exact``: the global-batch one."""
    if not isinstance(args, MoEArgs):
        return None
    shared = args.n_shared_experts * args.moe_hidden_dim
    experts = args.n_experts, args.top_k, args.moe_hidden_dim, shared, args.n_dense_layers
    return RoutedExperts(*experts, ep, imbalance, whole, exact)
