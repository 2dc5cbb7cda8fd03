"""A compiled MoE block on the path a GPU takes (the experts' grouped matmul) is one graph: no
graph break splits the router, dispatch, experts and combine, so compile can fuse across them.
Without the breaks, activation checkpointing's recomputation runs inside the compiled backward,
and the routing counts and balancing loss's log still count each real forward once.

The CPU has no backward for ``torch._grouped_mm``, so the experts here run a traceable stand-in
with the same result (each row times its expert's weight); the graph around it is the GPU's.
``aot_eager`` runs the graph through AOTAutograd (functionalisation, the partitioner's
recomputation) without Inductor's code generation, which only changes the kernels. Each scope's
log (``prob_sum``, ``balance_sum``) and each recomputation mode appear at least once; marked slow
for the compile time (about 10 s a case)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo
from moe_helpers import balance_alone, begin_alone

from parallelisms.activation_checkpoint import apply_activation_checkpointing, blocks
from parallelisms.torch_private import kernels
from trainer.loss import cross_entropy_sum
from trainer.metrics.reports import compile_line
from trainer.model import routed_experts
from trainer.model.llama3 import Transformer
from trainer.model.moe import FLAVORS, moe_layers

TINY = replace(FLAVORS["qwen3_moe_debug"], dim=64, vocab_size=256, n_layers=2)
MICRO_BATCHES = 2


def gathered_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)`` as each row times its own expert's matrix."""
    expert = torch.searchsorted(offsets, torch.arange(a.shape[0]), right=True)
    return torch.bmm(a.unsqueeze(1), b[expert]).squeeze(1)


def _train(scope: str, ac_mode: str, compiled: bool) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """Two micro-batches of uneven routing through the grouped path; the model and each
    micro-batch's loss."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights(1)
    # N = 64 (the balancing loss's gradient scale 0.01 x 64); the step's global counts as a
    # pre-pass would have set them.
    begin_alone(balance_alone(model, weight=0.01, scope=scope, sizes=(64, 1, 1)), n_valid_tokens=64)
    for moe in moe_layers(model):
        moe.experts.grouped_mm = gathered_grouped_mm
        moe.global_counts.fill_(TINY.top_k * 64 / TINY.n_experts)
        moe.fused_combine = compiled
    apply_activation_checkpointing(model, ac_mode, "op")
    if compiled:
        for block in blocks(model).values():
            block.compile(backend="aot_eager")
    losses = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, TINY.vocab_size, (2, 16))
        loss = cross_entropy_sum(model(tokens), tokens)
        loss.backward()
        losses.append(loss.detach())
    return model, losses


@pytest.fixture(autouse=True)
def grouped_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(routed_experts, "has_grouped_mm", lambda x: True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scope", "ac_mode"), [("global_batch", "full"), ("micro_batch", "selective"), ("micro_batch", "none")]
)
def test_a_compiled_moe_block_is_one_graph_and_counts_each_forward_once(scope, ac_mode):
    reference, ref_losses = _train(scope, "none", compiled=False)
    model, losses = _train(scope, ac_mode, compiled=True)
    # One graph for every block (the same code), as the start report tells it.
    assert kernels.compiled_graphs() == (1, {})
    assert compile_line(*kernels.compiled_graphs()).endswith("1 graph(s) traced in the first step, 0 graph break(s)")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for moe, ref in zip(moe_layers(model), moe_layers(reference), strict=True):
        assert torch.equal(moe.tokens_per_expert, ref.tokens_per_expert)
        assert moe.tokens_per_expert.sum() == MICRO_BATCHES * 32 * TINY.top_k
        torch.testing.assert_close(moe.prob_sum, ref.prob_sum)
        torch.testing.assert_close(moe.balance_sum, ref.balance_sum)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_the_start_report_names_a_graph_break_and_its_reason(monkeypatch: pytest.MonkeyPatch):
    """The control of the graph count: a break (the MoE parts' profiler check, as it was) is
    counted, with its reason, in the line the start report prints."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)  # the parts ask the profiler again
    _train("micro_batch", "none", compiled=True)
    graphs, breaks = kernels.compiled_graphs()
    assert graphs > 1 and sum(breaks.values()) >= 4, breaks
    assert "graph break(s): " in compile_line(graphs, breaks)


def test_counting_inside_a_recomputation_would_count_twice(monkeypatch: pytest.MonkeyPatch):
    """The control: were the op to count inside backward too, eager full recomputation doubles
    the counts, which the comparison above would catch."""
    reference, _ = _train("micro_batch", "none", compiled=False)
    monkeypatch.setattr(kernels, "in_backward", lambda: False)
    model, _ = _train("micro_batch", "full", compiled=False)
    for moe, ref in zip(moe_layers(model), moe_layers(reference), strict=True):
        assert torch.equal(moe.tokens_per_expert, 2 * ref.tokens_per_expert)
