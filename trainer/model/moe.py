"""Mixture-of-Experts: Llama 3's attention, norms and embeddings around routed SwiGLU experts.

Each MoE block replaces the dense feed-forward by a router (softmax or sigmoid scores, top-k,
optionally within the best groups of experts as DeepSeek-V3 limits it, optional renormalisation
of the chosen weights, a routed scaling factor), ``n_experts`` SwiGLU
experts stacked in three 3-D parameters, and optional shared experts that every token passes;
the first ``n_dense_layers`` blocks stay dense (DeepSeek). Routing is **dropless**: every token
reaches its k experts, there is no capacity factor, so the loss cannot depend on how experts
are laid out over ranks.

The balancing (``trainer/step/expert_balance.py``) is the step's: each MoE layer hands what it
routed to the routing hooks the step registers (:meth:`MoE.register_routing_hook`), which count
it and may attach the load-balancing loss ``E * sum_i f_i P_i`` (``f_i``: share of the k x T
choices that went to expert i, ``P_i``: mean router probability of expert i), whose definition in
each scope is here (:func:`balance_part`). The aux-loss-free bias (DeepSeek-V3) is a buffer of
the layer, added to the scores for the top-k choice only, never to the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import nn

from parallelisms.moe_split import SPLIT
from parallelisms.token_permutation import expand_tokens, inverse_permutation, permute_rows
from trainer.model.llama3 import FeedForward, ModelArgs, TransformerBlock
from trainer.model.routed_experts import GroupedExperts


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    n_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 256
    """Hidden units of each routed expert (and of each shared one)."""
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    """The first blocks keep the dense feed-forward."""
    score_func: str = "softmax"
    """``softmax`` or ``sigmoid`` router scores."""
    route_norm: bool = True
    """Renormalise the k chosen weights to sum to one (Qwen3's ``norm_topk_prob``)."""
    route_scale: float = 1.0
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3's ``n_group``): the experts in this many equal groups, a
    token's k chosen among the ``topk_groups`` groups whose two best scores (bias included) sum
    highest. 1: every expert is a candidate."""
    topk_groups: int = 1

    def make_block(self, layer_id: int) -> nn.Module:
        if layer_id < self.n_dense_layers:
            return TransformerBlock(layer_id, self)
        return TransformerBlock(layer_id, self, MoE(self))


DEBUG_MOE = MoEArgs(
    dim=256,
    n_layers=4,
    n_heads=16,
    n_kv_heads=8,
    vocab_size=2048,
    rope_scaling=False,
    vocab_from_tokenizer=True,
    qk_norm=True,
    n_experts=8,
    top_k=2,
    moe_hidden_dim=256,
    n_shared_experts=1,
    n_dense_layers=1,
)


FLAVORS: dict[str, MoEArgs] = {
    "debugmoe": DEBUG_MOE,
    # The debug MoE as a Qwen3-MoE can hold it (no shared expert, no dense first block), so that a
    # run exports to a Qwen3MoeForCausalLM (train_configs/tiny_qwen3_moe.toml, docs/hf.md).
    "qwen3_moe_debug": replace(DEBUG_MOE, n_shared_experts=0, n_dense_layers=0),
    # Hugging Face's Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json; the output projection is
    # not tied to the embedding there either.
    "qwen3_30b_a3b": MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_size=128,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=False,
        qk_norm=True,
        n_experts=128,
        top_k=8,
        moe_hidden_dim=768,
    ),
    "qwen3_235b_a22b": MoEArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_size=128,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=False,
        qk_norm=True,
        n_experts=128,
        top_k=8,
        moe_hidden_dim=1536,
    ),
}


def out_of_range(args: MoEArgs, key: Callable[[str], str] = lambda name: f"`{name}`") -> str | None:
    """Why no model can be built of ``args`` (the first field out of its range, named by
    ``key``: a Hugging Face adapter names its config keys), or None."""
    heads, kv = args.n_heads, args.kv_heads
    rules = (
        ("n_layers", args.n_layers >= 1, ">= 1"),
        ("dim", args.dim >= 1, ">= 1"),
        ("n_heads", heads >= 1, ">= 1"),
        ("n_kv_heads", 1 <= kv <= heads and heads % kv == 0, f"a divisor of {key('n_heads')} = {heads}"),
        ("vocab_size", args.vocab_size >= 1, ">= 1"),
        ("n_experts", args.n_experts >= 1, ">= 1"),
        ("top_k", 1 <= args.top_k <= args.n_experts, f"in [1, {key('n_experts')} = {args.n_experts}]"),
        ("moe_hidden_dim", args.moe_hidden_dim >= 1, ">= 1"),
        ("n_shared_experts", args.n_shared_experts >= 0, ">= 0"),
        ("n_dense_layers", 0 <= args.n_dense_layers < args.n_layers, f"in [0, {key('n_layers')} = {args.n_layers})"),
        ("n_groups", args.n_groups >= 1 and args.n_experts % args.n_groups == 0, f"a divisor of {key('n_experts')}"),
        ("topk_groups", 1 <= args.topk_groups <= args.n_groups, f"in [1, {key('n_groups')} = {args.n_groups}]"),
        (
            "top_k",
            args.n_groups == 1 or args.top_k <= args.topk_groups * (args.n_experts // max(args.n_groups, 1)),
            f"at most the experts of {key('topk_groups')} groups",
        ),
        ("n_groups", args.n_groups == 1 or args.n_experts // args.n_groups >= 2, "such that a group holds 2 experts"),
    )
    for name, holds, wanted in rules:
        if not holds:
            return f"{key(name)} = {getattr(args, name)} must be {wanted}"
    return None


def active_params(args: MoEArgs, total: int) -> int:
    """Parameters a token passes through: ``total`` less the experts it is not routed to."""
    per_expert = 3 * args.dim * args.moe_hidden_dim
    return total - (args.n_layers - args.n_dense_layers) * (args.n_experts - args.top_k) * per_expert


@dataclass
class Balancing:
    """What the MoE layers need to know about the step, shared by all of them and set by
    ``trainer/step/expert_balance.py``: the balancing loss's weight and scope, and the global sizes
    its parts are divided by."""

    weight: float = 0.0
    scope: str = "global_batch"
    grad_scale: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """``weight x N`` of the step: the loss's gradient in the summed cross-entropy's units. A
    tensor set in place, so a compiled block reads it rather than being traced again for each N."""
    global_tokens: int = 1
    global_sequences: int = 1
    global_microbatches: int = 1
    pooled_layers: int = 0
    """transformers' definition: the number of MoE layers whose tokens form one loss (0: per layer)."""


class Routed(NamedTuple):
    """What an MoE layer routed in one forward, for its routing hooks."""

    probs: torch.Tensor
    """``(tokens, experts)`` float32 router probabilities, summing to one per token."""
    chosen: torch.Tensor
    """``(tokens, k)`` the experts each token went to."""
    counts: torch.Tensor
    """``(experts,)`` tokens routed to each expert."""
    sequences: int
    """The micro-batch's sequences (``tokens / sequences`` tokens each)."""


RoutingHook = Callable[["MoE", Routed, torch.Tensor], torch.Tensor]
"""``hook(layer, routed, out) -> out``: may count ``routed`` and return ``out`` with a loss attached."""


def _chunks(n: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` cut into ``n`` parts along their first dimension (one part: themselves, not
    a view whose gradient would be copied)."""
    if n == 1:
        return [tensors]
    return list(zip(*(t.tensor_split(n) for t in tensors), strict=True))


class Router(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.score_func, self.top_k = args.score_func, args.top_k
        self.route_norm, self.route_scale = args.route_norm, args.route_scale
        self.n_groups, self.topk_groups = args.n_groups, args.topk_groups

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs, chosen, weights)``: each token's probability per expert (float32, summing
        to one), its k experts, and their weights. ``bias`` moves the choice, not the weights."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = self._candidates(scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, chosen, weights * self.route_scale

    def _candidates(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``topk_groups`` best groups at -inf."""
        if self.n_groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.n_groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
        outside = torch.ones(best.shape[0], self.n_groups, dtype=torch.bool, device=choice.device)
        return grouped.masked_fill(outside.scatter(1, best, False)[..., None], float("-inf")).flatten(1)


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert. A scatter, not ``bincount``, whose output size depends on
    the values: ``--simulate`` traces this on fake tensors, which have none."""
    flat = chosen.flatten()
    return flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))


class AddBalanceLoss(torch.autograd.Function):
    """The identity on ``out``, whose backward also gives ``loss`` the gradient ``scale``: the
    balancing loss joins the backward without changing what the model returns."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(device=grad.device, dtype=torch.float32), None


class MoE(nn.Module):
    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    global_counts: torch.Tensor
    balance_sum: torch.Tensor
    prob_sum: torch.Tensor

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.moe_hidden_dim)
        hidden = args.n_shared_experts * args.moe_hidden_dim
        self.shared_experts = FeedForward(args, hidden) if hidden else None
        self.exchange_chunks = 1
        """Parts of the tokens the dispatch exchanges one after another, each sorted by expert on
        its own (``parallelisms/expert_parallel.py`` overlaps one's exchange with another's experts)."""
        self._routing_hooks: list[RoutingHook] = []
        self.fused_combine = False
        """The combine's weighted sum over each token's k rows as elementwise ops and a reduction,
        which compile fuses with the gather into one kernel (``parallelize`` sets it for compiled
        blocks); otherwise one batched matmul, which in eager reads each routed row once and
        writes no tokens x k x dim product to read back, forward or backward."""
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("global_counts", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("balance_sum", torch.zeros(()), persistent=False)
        self.register_buffer("prob_sum", torch.zeros(args.n_experts), persistent=False)

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.reset_counters()

    def register_routing_hook(self, hook: RoutingHook) -> None:
        """Call ``hook`` with what every forward routed, in the forward (a recomputation's too).
        A list, not a handle-keyed dict: compile guards on dict keys, which differ per layer."""
        self._routing_hooks.append(hook)

    def reset_counters(self) -> None:
        """Clear what a step counts (at its start)."""
        for buffer in (self.tokens_per_expert, self.global_counts, self.balance_sum, self.prob_sum):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        with SPLIT.part("router"):
            probs, chosen, weights = self.router(flat, self.expert_bias)
            counts = expert_counts(chosen, self.n_experts)
        # Where the dispatch overlaps chunks of the tokens, each chunk is sorted, sent and
        # combined on its own, so that no routed row is copied to join or split the chunks.
        parts = _chunks(self.exchange_chunks, flat, chosen, weights)
        with SPLIT.part("dispatch"):
            # One sort by expert and its inverse serve the dispatch, the combine and both backwards.
            orders = [chosen_part.flatten().argsort(stable=True) for _, chosen_part, _ in parts]
            inverses = [inverse_permutation(order) for order in orders]
            rows = [
                expand_tokens(tokens, order, inverse, self.top_k)
                for (tokens, _, _), order, inverse in zip(parts, orders, inverses, strict=True)
            ]
            part_counts = [counts] if len(parts) == 1 else [expert_counts(c, self.n_experts) for _, c, _ in parts]
        expert_rows = self.experts(rows, part_counts)
        with SPLIT.part("combine"):
            outs = [
                self._combine(*args)
                for args in zip(expert_rows, inverses, orders, [w for _, _, w in parts], strict=True)
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        routed = Routed(probs, chosen, counts, bsz)
        for hook in self._routing_hooks:
            out = hook(self, routed, out)
        return out.view(bsz, seq, dim)

    def _combine(
        self, routed: torch.Tensor, inverse: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Each token's output: its k routed rows, back in token order, weighted."""
        unsorted = permute_rows(routed, inverse, order).view(-1, self.top_k, routed.shape[-1])
        scale = weights.unsqueeze(1).to(unsorted.dtype)
        if self.fused_combine:
            return (scale.transpose(1, 2) * unsorted).sum(1)
        return torch.bmm(scale, unsorted).squeeze(1)


def balance_part(
    probs: torch.Tensor,
    chosen: torch.Tensor,
    counts: torch.Tensor,
    global_counts: torch.Tensor,
    bsz: int,
    balancing: Balancing,
) -> torch.Tensor:
    """This micro-batch's share of ``E * sum_i f_i P_i`` in the chosen scope.

    ``global_batch``: ``f`` over the whole step (known before its first backward), ``P`` summed over these
    tokens and divided by the step's tokens, so the parts of every micro-batch and rank add up to
    the global loss; with ``pooled_layers`` (transformers' aux loss), ``f`` and ``P`` over the
    token-layers of all MoE layers, so the parts of every layer add up to the pooled loss.
    ``sequence`` and ``micro_batch``: the loss of each sequence or micro-batch on its own,
    averaged over the step's sequences or (rank-local) micro-batches.
    """
    n_experts, k = probs.shape[1], chosen.shape[1]
    if balancing.scope == "global_batch":
        return global_balance(probs.sum(0), global_counts, k, balancing)
    if balancing.scope == "micro_batch":
        f = counts / (k * probs.shape[0])
        return n_experts * (f * probs.mean(0)).sum() / balancing.global_microbatches
    seq_probs = probs.view(bsz, -1, n_experts)
    seq_counts = torch.zeros(bsz, n_experts, device=probs.device).scatter_add_(
        1, chosen.view(bsz, -1), torch.ones(chosen.numel(), device=probs.device).view(bsz, -1)
    )
    f = seq_counts / (k * seq_probs.shape[1])
    return n_experts * (f * seq_probs.mean(1)).sum() / balancing.global_sequences


def global_balance(prob_sum: torch.Tensor, global_counts: torch.Tensor, k: int, balancing: Balancing) -> torch.Tensor:
    """The ``global_batch`` part of tokens whose probabilities sum to ``prob_sum`` per expert:
    ``f`` over the whole step, ``P`` divided by the step's tokens; with ``pooled_layers``
    (transformers' aux loss), ``f`` and ``P`` over the token-layers of all MoE layers
    (``global_counts`` then every layer's counts summed, ``f`` per token-layer summing to k)."""
    n_experts = prob_sum.shape[0]
    if balancing.pooled_layers:
        token_layers = balancing.pooled_layers * balancing.global_tokens
        return n_experts * (global_counts / token_layers * prob_sum).sum() / token_layers
    f = global_counts / (k * balancing.global_tokens)
    return n_experts * (f * prob_sum).sum() / balancing.global_tokens


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
