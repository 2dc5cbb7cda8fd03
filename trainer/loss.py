"""The training loss: summed, float32 cross-entropy over the valid labels of a micro-batch.

A *sum*, not a mean: ``GradAccumulator`` divides by the number of valid tokens of the whole
global batch, which no single micro-batch knows.

The output projection and the loss are computed together, over chunks of tokens
(``training.loss_chunk_tokens``): each chunk's logits, their float32 copy and the log-softmax
live only while that chunk's loss is computed, and are recomputed from the chunk's hidden
states in backward (``torch.utils.checkpoint``), so a rank never holds the logits of the whole
micro-batch (8B at seq 8192: 4.2 GB a float32 copy, several copies). The summed loss and every
gradient are those of the unchunked computation up to float32 round-off: the loss is a sum over
tokens and each token's term depends only on its own logits. Under loss parallel the logits of a
chunk are a vocabulary-sharded DTensor and its cross-entropy runs inside ``loss_parallel()``, as
for whole logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value of a token that is not trained on (prompt, padding); PyTorch's default."""

CrossEntropy = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies, in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cross_entropy: CrossEntropy
) -> torch.Tensor:
    return cross_entropy(F.linear(hidden, weight), labels)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    cross_entropy: CrossEntropy = cross_entropy_sum,
    gradients_in_forward: bool = False,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` over chunks of ``chunk_tokens`` tokens, each
    chunk's logits recomputed in backward; one chunk (no recomputation) when ``chunk_tokens`` is 0
    or covers every token. ``gradients_in_forward``: see :func:`linear_cross_entropy_sum_with_gradients`."""
    if gradients_in_forward:
        return linear_cross_entropy_sum_with_gradients(hidden, weight, labels, chunk_tokens, cross_entropy)
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    if chunk_tokens <= 0 or hidden.shape[0] <= chunk_tokens:
        return _chunk_loss(hidden, weight, labels, cross_entropy)
    losses = [
        checkpoint(_chunk_loss, hidden_chunk, weight, labels_chunk, cross_entropy, use_reentrant=False)
        for hidden_chunk, labels_chunk in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens))
    ]
    return sum(losses[1:], losses[0])


class _GradientsInForward(torch.autograd.Function):
    """The summed loss whose forward also computes its gradients, chunk by chunk, and whose
    backward only scales them: nothing is recomputed, and between the two only the gradients
    of the hidden states and of the weight are kept, not the logits. Each chunk's gradients
    come from its logits' gradient by two matmuls, the weight's accumulated by the second
    (``addmm``), not by a pass of its own over the ``vocab x dim`` gradient."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        cross_entropy: CrossEntropy,
    ) -> torch.Tensor:
        step = chunk_tokens if chunk_tokens > 0 else max(hidden.shape[0], 1)
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], step):
            chunk = hidden[start : start + step]
            logits = F.linear(chunk, weight).requires_grad_()
            # This graph is used at once: what it saves stays where it is, whatever an outer hook
            # does with the forward's saved tensors (held forwards in host memory).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                loss = cross_entropy(logits, labels[start : start + step])
                (grad_logits,) = torch.autograd.grad(loss, logits)
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + step])
            if start:
                torch.addmm(grad_weight, grad_logits.t(), chunk, out=grad_weight)
            else:  # the first chunk's product is the sum so far: no zero-filled weight to add it to
                torch.mm(grad_logits.t(), chunk, out=grad_weight)
            total += loss.detach()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad_output.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale.to(grad_weight.dtype), None, None, None


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def linear_cross_entropy_sum_with_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    cross_entropy: CrossEntropy = cross_entropy_sum,
) -> torch.Tensor:
    """:func:`linear_cross_entropy_sum` with its gradients computed in the forward, for a forward
    whose backward runs much later (exact MoE balancing's held forwards): the checkpointed
    chunks would recompute every chunk's projection in backward, a third more of the output
    projection's work, while this keeps the gradients of the hidden states and of the whole
    weight (``vocab x dim``) per forward instead (docs/performance.md: the exact scope's cost
    on an H200). The gradients are the chunked computation's: each chunk's, summed in the order
    of the chunks. The weight must be a plain tensor: under tensor parallelism it is a DTensor
    and the loss runs chunked."""
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    return _GradientsInForward.apply(hidden, weight, labels, chunk_tokens, cross_entropy)


@dataclass(frozen=True)
class ModelLoss:
    """The summed loss of one micro-batch through ``model``, however the trainer computes it.

    ``in_model``: the labels go into the model, whose output projection computes the loss over
    chunks (``training.loss_chunk_tokens``, set on the model when it is built). Otherwise the
    model returns the whole logits for ``cross_entropy``: tensor parallelism without loss
    parallel, whose logits are gathered to every rank by the projection's output hook.
    """

    in_model: bool
    cross_entropy: CrossEntropy = cross_entropy_sum

    def __call__(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        if self.in_model:
            return model(inputs, positions, document_ids, labels=labels)
        return self.cross_entropy(model(inputs, positions, document_ids), labels)
