"""The Mixture-of-Experts model: published shapes, the grouped matmul against its exact fallback,
the routing bias, counting once under recompute, a replica group's balancing against one
process over the participating groups' batches, and the configurations refused before any
process group. The meshes against the 1-process reference are in ``test_expert_parallel.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from moe_helpers import balance_alone, begin_alone
from torch.utils.checkpoint import checkpoint

from parallelisms.token_permutation import expand_tokens, inverse_permutation, permute_rows
from parallelisms.torch_private import kernels
from trainer.config import ConfigError, load_config
from trainer.config.choices import BALANCE_SCOPES, MODEL_FLAVORS
from trainer.model.llama3 import Transformer, num_params, whole_model
from trainer.model.moe import FLAVORS, Balancing, active_params, balance_part, moe_layers
from trainer.model.routed_experts import grouped_swiglu, looped_swiglu
from trainer.planning.job_plan import resolve_job
from trainer.step.part import StepResult


@pytest.mark.parametrize(
    ("flavor", "total", "active"),
    [("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen3_235b_a22b", 235e9, 22e9)],
)
def test_published_parameter_counts(flavor, total, active):
    """Hugging Face's config values give Qwen's published total and active counts."""
    args = FLAVORS[flavor]
    counted = num_params(whole_model(args))
    assert counted == pytest.approx(total, rel=0.005)
    assert active_params(args, counted) == pytest.approx(active, rel=0.03)


def test_flavors_are_the_configs():
    assert tuple(FLAVORS) == MODEL_FLAVORS["moe"]


def test_grouped_matmul_equals_the_loop():
    """torch 2.13's CPU grouped matmul runs the forward: it must match the per-expert loop, with
    empty experts in between."""
    torch.manual_seed(0)
    x = torch.randn(20, 16)
    counts = torch.tensor([5, 0, 9, 0, 6])
    w1, w3 = torch.randn(5, 12, 16), torch.randn(5, 12, 16)
    w2 = torch.randn(5, 16, 12)
    torch.testing.assert_close(grouped_swiglu(x, counts, w1, w2, w3), looped_swiglu(x, counts, w1, w2, w3))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_permutations_are_the_index_ops_they_replace(k):
    """Dispatch and combine as gathers both ways (``token_permutation.py``): the same rows and
    the same gradients as autograd's index and scatter, for uneven routings with repeated
    experts; a wrong inverse or a token mapped to the wrong rows fails."""
    torch.manual_seed(k)
    tokens = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    chosen = torch.randint(0, 4, (11, k))
    order = chosen.flatten().argsort(stable=True)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(11 * k))
    rows = torch.randn(11 * k, 6, dtype=torch.float64, requires_grad=True)
    grad_rows, grad_tokens = torch.randn(11 * k, 6, dtype=torch.float64), torch.randn(11, 6, dtype=torch.float64)

    def both(expand, unsort):
        tokens.grad = rows.grad = None
        (expand(tokens) * grad_rows).sum().backward()
        (unsort(rows).view(11, k, 6).sum(1) * grad_tokens).sum().backward()
        return expand(tokens), unsort(rows), tokens.grad, rows.grad

    ours = both(lambda t: expand_tokens(t, order, inverse, k), lambda r: permute_rows(r, inverse, order))
    autograd = both(lambda t: t[order // k], lambda r: torch.zeros_like(r).index_copy(0, order, r))
    for mine, reference in zip(ours, autograd):
        torch.testing.assert_close(mine, reference)


def debug_moe(**changes) -> Transformer:
    args = replace(FLAVORS["debugmoe"], vocab_size=256, max_seq_len=32, **changes)
    model = Transformer(args)
    model.init_weights(3)
    return model


def test_bias_moves_the_choice_not_the_weights():
    torch.manual_seed(0)
    router = moe_layers(debug_moe())[0].router
    x = torch.randn(64, 256)
    probs, _, _ = router(x, torch.zeros(8))
    bias = torch.zeros(8)
    bias[0] = 10.0
    _, chosen_b, weights_b = router(x, bias)
    assert (chosen_b == 0).any(dim=1).all()  # every token now picks expert 0
    picked = probs.gather(1, chosen_b)
    torch.testing.assert_close(weights_b, picked / picked.sum(-1, keepdim=True))


def test_recompute_counts_each_token_once(monkeypatch):
    """Under activation checkpointing the router runs again in backward; the step's tokens per
    expert must equal those of a run without recompute. The injected bug counts twice. (With a
    balancing loss on, the recomputation runs through the routing hook, which makes the loss's
    part; without one it may stop before it.)"""
    tokens = torch.randint(0, 256, (2, 32))

    def counts(recompute: bool, weight: float = 0.01) -> torch.Tensor:
        model = debug_moe()
        begin_alone(balance_alone(model, weight=weight, scope="micro_batch"))
        if recompute:
            for block in model.layers.values():
                block.checkpoint_fn = lambda fn, *a: checkpoint(fn, *a, use_reentrant=False)
        model(tokens, labels=tokens).backward()
        return torch.stack([m.tokens_per_expert for m in moe_layers(model)])

    plain = counts(False)
    assert plain.sum() == 2 * 32 * 2 * 3  # tokens x top-2 x 3 MoE layers
    torch.testing.assert_close(counts(True), plain)
    torch.testing.assert_close(counts(True, weight=0.0), plain)
    monkeypatch.setattr(kernels, "in_backward", lambda: False)
    assert counts(True).sum() == 2 * plain.sum()


@pytest.mark.parametrize("scope", BALANCE_SCOPES)
def test_every_scope_is_one_on_a_uniform_router(scope):
    """``E x sum_i f_i P_i`` is 1 when probabilities and choices are uniform, in every scope."""
    probs = torch.full((8, 4), 0.25)
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    counts = torch.bincount(chosen.flatten(), minlength=4).float()
    balancing = Balancing(scope=scope, global_tokens=8, global_sequences=2, global_microbatches=1)
    assert balance_part(probs, chosen, counts, counts, 2, balancing).item() == pytest.approx(1.0)


MOE = ["--model.name", "moe", "--model.flavor", "debugmoe", "--training.global_batch_size", "8"]


@pytest.mark.parametrize(
    ("world", "extra", "names"),
    [
        (4, ["--mesh", "dp_shard=4,ep=3"], "`parallelism.expert_parallel_degree` = 3 must divide"),
        (2, ["--model.name", "llama3", "--model.flavor", "debugmodel", "--mesh", "dp_shard=2,ep=2"], "`model.name`"),
        (
            4,
            ["--mesh", "cp=2,tp=2,ep=4"],
            "must divide `parallelism.data_parallel_shard_degree` x `parallelism.context",
        ),
        (
            2,
            ["--moe.balance_loss_layers", "pooled", "--moe.balance_loss_scope", "sequence"],
            "`moe.balance_loss_layers` = 'pooled' counts",
        ),
        (
            2,
            ["--mesh", "cp=2", "--moe.balance_loss_weight", "0.1", "--moe.balance_loss_scope", "sequence"],
            "`moe.balance_loss_scope`",
        ),
        (
            2,
            ["--mesh", "tp=2", "--moe.balance_loss_weight", "0.1", "--moe.balance_loss_scope", "sequence"],
            "`parallelism.tensor_parallel_degree`",
        ),
        (2, ["--model.flavor", "8B"], "`model.flavor` = 8B is not of this `model.name`"),
    ],
)
def test_refused_before_any_process_group(world, extra, names):
    with pytest.raises(ConfigError, match=None) as caught:
        resolve_job(load_config(MOE + extra), world)
    message = str(caught.value)
    assert names in message and "\n" not in message


@pytest.mark.parametrize(
    ("world", "mesh", "ep"),
    [(4, "dp_shard=2,tp=2,ep=2", 2), (2, "cp=2,ep=2", 2), (4, "dp_shard=2,cp=2,ep=4", 4), (2, "tp=2", 1)],
)
def test_tensor_and_context_parallel_moe_meshes_are_accepted(world, mesh, ep):
    """``ep`` takes its ranks from ``dp_shard x cp``; TP ranks route their own sequence shards."""
    assert resolve_job(load_config([*MOE, "--mesh", mesh]), world).dims.ep == ep


@pytest.mark.parametrize(
    ("rate", "start", "moves"),
    [
        (0.01, 0.0, True),
        (1e30, 0.0, True),  # large, but a float32 move
        (1e300, 0.0, False),  # the rate itself overflows float32: the centred move is NaN
        (1e38, 3e38, False),  # finite moves that carry a bias past float32's largest
        (0.0, float("nan"), True),  # no move attempted: nothing to refuse (the save refuses the NaN)
    ],
)
def test_a_routing_bias_move_that_is_not_finite_is_refused(rate, start, moves):
    """``finish`` moves every bias or none: a move leaving any bias non-finite is refused and
    the step skipped, as for a non-finite gradient."""
    model = Transformer(replace(FLAVORS["debugmoe"], vocab_size=64, max_seq_len=8))
    balance = balance_alone(model, rate=rate, sizes=(8, 1, 1))
    layers = moe_layers(model)
    for i, layer in enumerate(layers):
        layer.expert_bias.fill_(start)
        layer.tokens_per_expert.copy_(torch.arange(layer.n_experts, dtype=torch.float32) + i)
    before = torch.stack([layer.expert_bias.clone() for layer in layers])
    result = StepResult()
    balance.finish(result)
    stats = balance.last
    assert stats is not None
    after = torch.stack([layer.expert_bias for layer in layers])
    assert result.skipped == (not moves)
    if not moves:
        assert torch.equal(after, before) and torch.equal(stats.expert_bias, before)
    elif rate > 0:
        assert torch.isfinite(after).all() and not torch.equal(after, before)


class _TwinGroup:
    """A second fault-tolerant replica group in the step that trained the same micro-batches as
    this one: every sum over the groups doubles (N excepted: both steps fix it at 1, the
    accumulator's concern)."""

    def participants(self) -> int:
        return 2

    def sum_count(self, count: torch.Tensor) -> torch.Tensor:
        return count

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            t.mul_(2)

    def max_(self, tensor: torch.Tensor) -> None:
        return None


@pytest.mark.parametrize(
    ("scope", "layers", "held"),
    [
        ("global_batch", "per_layer", False),
        ("global_batch", "per_layer", True),
        ("global_batch", "pooled", False),
        ("sequence", "per_layer", False),
        ("micro_batch", "per_layer", False),
    ],
)
def test_a_replica_groups_balancing_is_one_process_over_the_participants_batches(scope, layers, held):
    """One group of two, whose twin fed the same micro-batches, against one process fed them
    twice: the same balancing loss, expert loads and bias move, and half its gradient (the
    accumulator sums the groups' gradients). Counts left unsummed over the groups, or global
    sizes left the group's, are off by 2x to 4x. ``held``: under full checkpointing the step's
    own forwards count the routing (no pre-pass)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 32))
    microbatches = list(tokens.chunk(2))
    initial = debug_moe()

    def step(feed: list[torch.Tensor], groups: _TwinGroup | None) -> tuple:
        model = Transformer(initial.args)
        model.load_state_dict(initial.state_dict())
        if held:
            for block in model.layers.values():
                block.checkpoint_fn = lambda fn, *a: checkpoint(fn, *a, use_reentrant=False)
        sizes = (32 * sum(len(mb) for mb in feed), sum(len(mb) for mb in feed), len(feed))
        balance = balance_alone(
            model, rate=0.01, weight=1.0, scope=scope, layers=layers, sizes=sizes,
            counting="forwards" if held else "prepass", groups=groups,
        )  # fmt: skip
        begin_alone(balance)
        if balance.counting == "prepass":
            with torch.no_grad():
                for mb in feed:
                    model(mb)
        outputs = [model(mb) for mb in feed] if held else []
        balance.forwards_done()
        for i, mb in enumerate(feed):
            (outputs[i] if held else model(mb)).sum().mul(0).backward()  # only the balancing loss has a gradient
        balance.finish(StepResult())
        stats = balance.last
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return stats, grads

    group, group_grads = step(microbatches, _TwinGroup())
    one, one_grads = step(microbatches * 2, None)
    assert group.balance_loss == pytest.approx(one.balance_loss, rel=1e-6)
    assert group.max_load == pytest.approx(one.max_load, rel=1e-6)
    torch.testing.assert_close(group.tokens_per_expert, one.tokens_per_expert)
    torch.testing.assert_close(group.expert_bias, one.expert_bias)
    assert group_grads.keys() == one_grads.keys() and any("router" in name for name in one_grads)
    for name, grad in group_grads.items():
        torch.testing.assert_close(2 * grad, one_grads[name], rtol=1e-5, atol=1e-9)


def test_group_limited_routing_is_deepseek_v3_s() -> None:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): sigmoid scores, the bias
    moving the choice, the top-k within the ``topk_group`` groups whose two best biased scores sum
    highest, renormalised weights times the routed scaling factor. Ours chooses the same experts
    with the same weights, and the grouping changes the choice (the test is not vacuous)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from trainer.model.moe import MoEArgs, Router, out_of_range

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    theirs = DeepseekV3TopkRouter(config)
    args = MoEArgs(dim=32, n_experts=16, top_k=4, score_func="sigmoid", route_scale=2.5, n_groups=4, topk_groups=2)
    assert out_of_range(args) is None
    ours = Router(args)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
        theirs.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=gen))
        ours.gate.weight.copy_(theirs.weight)
    x = torch.randn(64, 32, generator=gen)
    _, chosen, weights = ours(x, theirs.e_score_correction_bias)
    _, their_weights, their_chosen = theirs(x)
    order, their_order = chosen.sort(-1), their_chosen.sort(-1)
    assert torch.equal(order.values, their_order.values)
    assert torch.allclose(weights.gather(1, order.indices), their_weights.gather(1, their_order.indices))
    ungrouped = Router(replace(args, n_groups=1, topk_groups=1))
    ungrouped.load_state_dict(ours.state_dict())
    assert not torch.equal(ungrouped(x, theirs.e_score_correction_bias)[1].sort(-1).values, order.values)
    groups_of = order.values // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups_of)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"n_groups": 3}, "`n_groups` = 3 must be a divisor of `n_experts`"),
        ({"topk_groups": 5}, "`topk_groups` = 5 must be in [1, `n_groups` = 4]"),
        ({"top_k": 9, "topk_groups": 2}, "`top_k` = 9 must be at most the experts of `topk_groups` groups"),
        ({"n_groups": 16, "topk_groups": 4}, "`n_groups` = 16 must be such that a group holds 2 experts"),
    ],
)
def test_impossible_group_limited_routing_is_named(change: dict, says: str) -> None:
    from trainer.model.moe import MoEArgs, out_of_range

    base = MoEArgs(n_experts=16, top_k=4, n_groups=4, topk_groups=2)
    assert out_of_range(replace(base, **change)) == says
