"""The training loss: summed, float32 cross-entropy over the valid labels of a micro-batch.

A *sum*, not a mean: ``GradAccumulator`` divides by the number of valid tokens of the whole
global batch, which no single micro-batch knows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value of a token that is not trained on (prompt, padding); PyTorch's default."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies, in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
