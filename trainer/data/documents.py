"""Documents inside a packed sample, for ``training.document_mask``.

A packed sample is ``[bos] doc [eos] [bos] doc [eos] ...`` cut into fixed windows, so a window
may start or end in the middle of a document. Everything the masked model needs is read off
the window's BOS tokens, on the whole sequence, before context parallelism takes its shard (a
CP rank's shard alone cannot tell which document its first token belongs to):

* document ids: ``cumsum(tokens == bos)``, so tokens before the window's first BOS (the tail
  of a document that began in an earlier window) form document 0 of their own;
* positions: restart at 0 at every BOS; the leading fragment counts from 0 too, as every token
  at the start of an unmasked window does (its true offset lies in another sample);
* labels: the label that predicts a document's BOS from the previous document's last token is
  ignored. The model attends to the previous document only, and BOS always follows EOS, so the
  label teaches nothing; ignoring it makes a masked window's loss exactly the sum of its
  documents' losses when each is run on its own, as a fine-tuning sample would be.
"""

from __future__ import annotations

import torch

from trainer.loss import IGNORE_INDEX


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``(batch, seq)``: which document of the window each token belongs to (0, 1, ...)."""
    return torch.cumsum(tokens == bos_id, dim=1)


def document_positions(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``(batch, seq)``: each token's place in its document, 0 at every BOS and at the window's start."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.where(tokens == bos_id, index, torch.zeros_like(index))
    return index - torch.cummax(starts, dim=1).values


def within_document_labels(labels: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``labels`` with every label that predicts a document's BOS ignored (a new tensor)."""
    return labels.masked_fill(labels == bos_id, IGNORE_INDEX)


def split_documents(
    tokens: torch.Tensor, labels: torch.Tensor, bos_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(labels, positions, document_ids)`` of a batch of whole (unsharded) packed windows."""
    return within_document_labels(labels, bos_id), document_positions(tokens, bos_id), document_ids(tokens, bos_id)
