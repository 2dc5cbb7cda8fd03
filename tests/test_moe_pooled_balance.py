"""transformers' balancing loss as ``moe.balance_loss_layers = "pooled"``: over a step cut into
micro-batches, the logged loss and its gradients are those of ``load_balancing_loss_func`` (what
``Qwen3MoeForCausalLM`` returns as ``aux_loss`` with ``output_router_logits``) on the whole batch
in one forward. That it is the same on every mesh is in ``test_expert_parallel_pp.py``."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from moe_helpers import balance_alone, begin_alone
from torch.utils.checkpoint import checkpoint

from trainer.model.llama3 import Transformer
from trainer.model.moe import FLAVORS, moe_layers
from trainer.step.part import StepResult

transformers_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

BATCH, SEQ, MICROBATCHES = 4, 32, 2


@pytest.mark.parametrize("held", [False, True], ids=["pre-pass", "held forwards"])
def test_pooled_balancing_loss_is_transformers_aux_loss(held):
    """``held``: under full checkpointing, the step's own forwards count the routing, then every
    backward recomputes its blocks with the pooled counts (no pre-pass)."""
    torch.manual_seed(0)
    args = replace(FLAVORS["debugmoe"], vocab_size=256, max_seq_len=SEQ, n_shared_experts=0)
    model = Transformer(args)
    model.init_weights(3)
    if held:
        for block in model.layers.values():
            block.checkpoint_fn = functools.partial(checkpoint, use_reentrant=False)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ))
    balance = balance_alone(
        model,
        weight=1.0,
        scope="global_batch",
        layers="pooled",
        sizes=(BATCH * SEQ, BATCH, MICROBATCHES),
        counting="forwards" if held else "prepass",
    )
    microbatches = tokens.chunk(MICROBATCHES)
    # N = 1: the gradient the accumulator would divide by N is the loss's own.
    begin_alone(balance, n_valid_tokens=1)
    if not held:  # the counting pre-pass
        with torch.no_grad():
            for mb in microbatches:
                model(mb)
    outputs = [model(mb) for mb in microbatches] if held else []
    balance.forwards_done()
    for i, mb in enumerate(microbatches):
        out = outputs[i] if held else model(mb)
        (out.sum() * 0).backward()  # only the balancing loss has a gradient
    balance.finish(StepResult())
    assert balance.last is not None
    ours = balance.last.balance_loss
    our_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    balance.balancing.weight = 0.0  # theirs from the routers' logits alone, nothing attached to the blocks
    logits: list[torch.Tensor] = []
    for layer in moe_layers(model):
        layer.router.gate.register_forward_hook(lambda _m, _i, out: logits.append(out))
    model(tokens)
    theirs = transformers_moe.load_balancing_loss_func(tuple(logits), args.n_experts, args.top_k)
    theirs.backward()
    assert ours == pytest.approx(theirs.item(), rel=1e-6)
    routers = 0
    for name, p in model.named_parameters():
        their_grad = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(our_grads[name], their_grad, rtol=1e-5, atol=1e-8)
        routers += "router" in name and their_grad.abs().max().item() > 0
    assert routers == len(moe_layers(model))
    # Not the per-layer mean: the two definitions differ.
    assert ours != pytest.approx(args.top_k * per_layer_mean(model, tokens, logits), rel=1e-3)


def per_layer_mean(model: Transformer, tokens: torch.Tensor, logits: list[torch.Tensor]) -> float:
    """transformers' loss of each layer alone, averaged over layers, in our units (divided by k)."""
    layers = moe_layers(model)
    n_experts, k = layers[0].n_experts, layers[0].top_k
    each = [transformers_moe.load_balancing_loss_func((x,), n_experts, k) / k for x in logits]
    return torch.stack(each).mean().item()
