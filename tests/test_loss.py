"""The chunked output projection and loss: the unchunked sum and gradients, without the whole logits."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model.llama3 import FLAVORS, Transformer

ARGS = replace(FLAVORS["debugmodel"], max_seq_len=64)
BATCH, SEQ = 3, 40


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=gen)
    labels[0, :30] = IGNORE_INDEX  # a whole chunk of ignored labels, and a chunk partly ignored
    labels[2, 5:9] = IGNORE_INDEX
    return inputs, labels


def _loss_and_grads(
    model: Transformer, chunk: int | None, in_forward: bool = False, scale: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss and the gradients of ``scale`` times it: of the whole logits (``chunk``
    None), or computed by the output projection in chunks, with its gradients ``in_forward``."""
    inputs, labels = _batch()
    model.zero_grad()
    if chunk is None:
        loss = cross_entropy_sum(model(inputs), labels)
    else:
        assert model.output is not None
        model.output.chunk_tokens, model.output.gradients_in_forward = chunk, in_forward
        loss = model(inputs, labels=labels)
        model.output.gradients_in_forward = False
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(3)
    return model


@pytest.mark.parametrize("in_forward", [False, True], ids=["recomputed", "gradients in forward"])
@pytest.mark.parametrize("chunk", [0, 7, 32, 40, 119, 120, 4096])
def test_chunked_loss_equals_whole_logits(model: Transformer, chunk: int, in_forward: bool):
    """Chunks cutting sequences and samples unevenly, one chunk, and none, recomputed in backward
    or with the gradients computed in the forward (exact balancing's held forwards), and a
    backward that scales the loss: the same summed loss and gradients as cross-entropy on the
    whole logits, to float32 round-off."""
    want_loss, want_grads = _loss_and_grads(model, None, scale=2.5)
    loss, grads = _loss_and_grads(model, chunk, in_forward, scale=2.5)
    assert grads.keys() == want_grads.keys()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    for name, grad in grads.items():
        scale = want_grads[name].abs().max().item()
        assert (grad - want_grads[name]).abs().max().item() <= 1e-5 * scale, name


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor over the vocabulary (last dimension) that an op returns:
    logits, their float32 copy, log-softmax and their gradients (not the output matrix's
    transposed gradient, ``dim x vocab``)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == ARGS.vocab_size and t.shape[0] != ARGS.dim:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 16])
def test_no_tensor_holds_more_than_a_chunk_of_logits(model: Transformer, chunk: int):
    """Forward and backward make no tensor over the vocabulary larger than one chunk's tokens;
    unchunked (the control), the whole micro-batch's."""
    with _LargestLogits() as probe:
        _loss_and_grads(model, chunk)
    assert probe.largest == (chunk or BATCH * SEQ) * ARGS.vocab_size


def test_gradients_in_forward_keep_no_logits_for_backward(model: Transformer):
    """With the gradients computed in the forward, what the loss keeps for backward is the
    gradients of the hidden states and of the output weight: nothing over the vocabulary per
    token is alive between forward and backward (the held forwards would keep it for every
    micro-batch), and the backward makes none."""
    assert model.output is not None
    inputs, labels = _batch()
    model.output.chunk_tokens, model.output.gradients_in_forward = 16, True
    saved: list[weakref.ref[torch.Tensor]] = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
            loss = model(inputs, labels=labels)
    finally:
        model.output.gradients_in_forward = False
    kept = [t for t in (ref() for ref in saved) if t is not None]
    assert not [t.shape for t in kept if t.ndim and t.shape[-1] == ARGS.vocab_size]
    assert any(t.shape == model.output.weight.shape and t is not model.output.weight for t in kept)
    with _LargestLogits() as probe:
        loss.backward()
    assert probe.largest == 0
