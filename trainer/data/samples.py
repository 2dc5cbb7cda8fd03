"""Tokenized samples: the dataset kinds (``training.dataset``) and the layout they share.

* ``shakespeare``: packed pre-training. Every document becomes ``[bos] + tokens + [eos]``; the
  documents are concatenated and cut into samples of ``seq_len + 1`` tokens (the incomplete tail
  is dropped), so no sample is padded and every label is valid.
* ``shakespeare_dialogue``: prompt/response fine-tuning. A sample is
  ``[bos] + prompt + TURN_SEPARATOR + response + [eos]``, truncated and padded to
  ``seq_len + 1``; labels that predict the prompt and labels of padding are ``IGNORE_INDEX``, so
  the number of valid labels varies from sample to sample.
* ``chat``: multi-turn chat fine-tuning (``trainer.data.chat``). A sample is one conversation,
  rendered with the tokenizer's chat format, cut on the right at ``seq_len + 1`` tokens and
  padded; only the assistant's tokens are labels.

A change here that alters the samples made from the same text must bump
``trainer.data.cache.FORMAT_VERSION``, or runs would keep the samples cached by the old code.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data import cache
from trainer.data.chat import ChatStats, render
from trainer.data.prepared import PreparedDataset, is_prepared, packed_identity
from trainer.data.shards import TOKEN_DTYPES, token_dtype
from trainer.data.sources import Sources, read_sources
from trainer.data.tokenizer import Tokenizer
from trainer.loss import IGNORE_INDEX
from trainer.runtime.errors import DataError

TURN_SEPARATOR = "\n\n"
"""Put between prompt and response: the blank line that separates speeches in the documents of
the pre-training kind, so fine-tuning continues the layout the model was pre-trained on."""


@dataclass(frozen=True)
class TokenArrays:
    """Samples as token ranges: sample i is ``tokens[offsets[i]:offsets[i + 1]]`` (at most
    ``seq_len + 1`` tokens, padded on access), of which the first ``num_masked[i]`` labels are
    ignored. Kinds whose masked tokens are not a prefix (chat) also give ``targets``: one byte per
    token, 1 where the token is a label; ``stats`` holds what the kind counted while building
    (for chat, :class:`~trainer.data.chat.ChatStats`). Both are empty for the other kinds, which
    leaves their data fingerprint as it was before the two arrays existed.

    Both dataset kinds are stored this way: compact, cheap to send to loader workers, and
    written to disk as-is by the token cache. Plain ``array.array``s rather than tensors:
    building appends token lists to them with no per-sample tensor op (hundreds of thousands of
    tiny ops are slow when the ranks of a job share a few cores), and they expose raw bytes to
    hash and write for the cache.
    """

    TYPECODES: ClassVar[tuple[str, ...]] = ("i", "q", "i", "B", "q")
    """The arrays' element types, in :meth:`parts` order: int32, int64, int32, uint8, int64."""

    tokens: array  # "i": int32
    offsets: array  # "q": int64, n + 1 entries
    num_masked: array  # "i": int32, n entries
    targets: array = field(default_factory=lambda: array("B"))  # "B": one per token, or empty
    stats: array = field(default_factory=lambda: array("q"))  # "q": the kind's counters, or empty

    def parts(self) -> tuple[array, ...]:
        return self.tokens, self.offsets, self.num_masked, self.targets, self.stats


def _packed(kind: str, sources: Sources, tokenizer: Tokenizer, seq_len: int) -> TokenArrays:
    tokens = array("i")
    for document in sources.documents(kind):
        tokens.extend(tokenizer.encode(document, bos=True, eos=True))
    n = len(tokens) // (seq_len + 1)
    # The tail past the last sample stays: the whole stream is what the data identity hashes.
    return TokenArrays(tokens, array("q", range(0, n * (seq_len + 1) + 1, seq_len + 1)), array("i", [0]) * n)


def _truncate(prompt: list[int], response: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Fit prompt + response into ``budget`` tokens, preferring the response.

    The prompt loses its oldest tokens first, down to a quarter of the budget (context the
    response needs); past that the response is cut on the right (losing its EOS, since the
    speech did not end there). The response therefore always keeps at least 3/4 of the budget,
    and, EOS being part of it, a pair never ends up with zero valid labels.
    """
    if len(prompt) + len(response) <= budget:
        return prompt, response
    keep_response = min(len(response), budget - min(len(prompt), budget // 4))
    keep_prompt = budget - keep_response
    return prompt[len(prompt) - keep_prompt :], response[:keep_response]


def _dialogue(kind: str, sources: Sources, tokenizer: Tokenizer, seq_len: int) -> TokenArrays:
    arrays = TokenArrays(array("i"), array("q", [0]), array("i"))
    for prompt_text, response_text in sources.pairs(kind):
        prompt = tokenizer.encode(prompt_text + TURN_SEPARATOR, bos=False, eos=False)
        response = tokenizer.encode(response_text, bos=False, eos=True)
        prompt, response = _truncate(prompt, response, seq_len)  # BOS takes the last slot
        arrays.tokens.append(tokenizer.bos_id)
        arrays.tokens.extend(prompt)
        arrays.tokens.extend(response)
        arrays.offsets.append(len(arrays.tokens))
        # Label j predicts token j + 1: labels 0 .. len(prompt) - 1 predict the prompt.
        arrays.num_masked.append(len(prompt))
    return arrays


def _chat(kind: str, sources: Sources, tokenizer: Tokenizer, seq_len: int) -> TokenArrays:
    arrays = TokenArrays(array("i"), array("q", [0]), array("i"))
    stats = ChatStats()
    for conversation in sources.conversations(kind):
        tokens, targets = render(conversation.messages, tokenizer)
        stats.conversations += 1
        if not any(targets):
            stats.without_assistant += 1
            continue
        if len(tokens) > seq_len + 1:
            stats.truncated += 1
            tokens, targets = tokens[: seq_len + 1], targets[: seq_len + 1]
            if not any(targets[1:]):  # the first token is never a label
                stats.dropped_by_truncation += 1
                continue
        arrays.tokens.extend(tokens)
        arrays.targets.extend(targets)
        arrays.offsets.append(len(arrays.tokens))
        arrays.num_masked.append(0)
    arrays.stats.extend(stats.as_tuple())
    return arrays


@dataclass(frozen=True)
class _Kind:
    build: Callable[[str, Sources, Tokenizer, int], TokenArrays]
    sample_needs: str
    """Appended to the error for sources that yield no sample."""
    packed: bool
    """A sample packs several documents, each opened by BOS, which ``training.document_mask``
    can keep apart (``trainer/data/documents.py``); false for one example per sample."""


_KINDS: dict[str, _Kind] = {
    "shakespeare": _Kind(_packed, "", packed=True),
    "shakespeare_dialogue": _Kind(_dialogue, " (a pair needs a prompt and a response)", packed=False),
    "chat": _Kind(_chat, " (a conversation needs an assistant turn within the first seq_len tokens)", packed=False),
}
DATASET_KINDS: tuple[str, ...] = tuple(_KINDS)
"""The values ``training.dataset`` accepts."""
PACKED_KINDS: tuple[str, ...] = tuple(kind for kind, spec in _KINDS.items() if spec.packed)
"""The kinds whose samples hold several documents (``training.document_mask`` applies)."""


class SampleDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of ``(input_ids, labels)``, both ``LongTensor[seq_len]``.

    Padding and masking happen on access, so storage holds each sample's real tokens only.
    ``identity`` fingerprints what the samples are (:func:`samples_identity`): a checkpoint
    records it, so a resume on other data is noticed.
    """

    def __init__(self, arrays: TokenArrays, seq_len: int, pad_id: int, identity: dict[str, str]) -> None:
        self._tokens = torch.frombuffer(arrays.tokens, dtype=torch.int32)  # shares the array's memory
        self._offsets = arrays.offsets
        self._num_masked = arrays.num_masked
        self._targets = torch.frombuffer(arrays.targets, dtype=torch.uint8) if arrays.targets else None
        self.chat_stats = ChatStats(*arrays.stats) if arrays.stats else None
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.identity = identity

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)} samples")
        start, end = self._offsets[index], self._offsets[index + 1]
        sequence = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.int64)
        sequence[: end - start] = self._tokens[start:end]
        labels = sequence[1:].clone()
        labels[: self._num_masked[index]] = IGNORE_INDEX
        if self._targets is not None:
            labels[: end - start - 1][self._targets[start + 1 : end] == 0] = IGNORE_INDEX
        labels[end - start - 1 :] = IGNORE_INDEX  # the labels of padding
        return sequence[:-1], labels


def _build_arrays(kind: str, sources: Sources, tokenizer: Tokenizer, seq_len: int) -> TokenArrays:
    arrays = _KINDS[kind].build(kind, sources, tokenizer, seq_len)
    if not arrays.num_masked:
        key = f"{'validation' if sources.split == 'validation' else 'training'}.seq_len"
        stats = ChatStats(*arrays.stats) if arrays.stats else None
        if stats is not None and stats.conversations and stats.without_assistant == stats.conversations:
            raise DataError(
                f"{sources.describe()}: none of its {stats.conversations:,} conversations has a message with the "
                f'role "assistant", the only one learned; name the answering role "assistant" in the data.'
            )
        raise DataError(
            f"{sources.describe()} yields no {kind} samples of `{key}` = {seq_len} tokens"
            f"{_KINDS[kind].sample_needs}; add data or {'raise' if kind == 'chat' else 'lower'} `{key}`."
        )
    return arrays


def build_dataset(
    kind: str, path: str | None, tokenizer: Tokenizer, seq_len: int, split: str = "train"
) -> SampleDataset:
    """The dataset of kind ``kind`` (``training.dataset``) from the bundled plays or from ``path``.

    ``path`` (``training.dataset_path``; ``None`` or empty for the bundled plays) is a file or a
    folder whose ``*.txt``/``*.jsonl``/``*.parquet`` files, found recursively, are read in sorted
    order (a Parquet row holds what a ``.jsonl`` line does, as columns):

    * ``shakespeare``: a ``.txt`` file is one document; a ``.jsonl`` line is a document
      ``{"text": ...}``.
    * ``shakespeare_dialogue``: a ``.jsonl`` line is a pair ``{"prompt": ..., "response": ...}``;
      a ``.txt`` file holds turns separated by blank lines, each turn answering the previous one.
    * ``chat``: a ``.jsonl`` line is ``{"messages": [{"role": ..., "content": ...}, ...]}``; the
      bundled plays give conversations of consecutive speeches of a scene.

    ``split`` (``train`` or ``validation``) picks the bundled plays (the validation split is
    ``sources.HELD_OUT_PLAYS``, which training never sees) and the key that messages name.

    The result depends only on these inputs, never on rank or world size, so every process
    builds the same samples; tokenized arrays are cached under ``MESHTRAIN_CACHE_DIR`` (default
    ``~/.cache/meshtrain``).
    """
    sources = read_sources(path, split)
    parts = cache.load_or_build(
        kind,
        seq_len,
        tokenizer.sha256,
        tokenizer.library,
        sources.files,
        TokenArrays.TYPECODES,
        lambda: _build_arrays(kind, sources, tokenizer, seq_len).parts(),
    )
    arrays = TokenArrays(*parts)
    return SampleDataset(arrays, seq_len, tokenizer.pad_id, samples_identity(kind, arrays, seq_len, tokenizer))


def samples_identity(kind: str, arrays: TokenArrays, seq_len: int, tokenizer: Tokenizer) -> dict[str, str]:
    """What the samples are. Packed kinds: the token stream as a prepared folder would hold it
    (:func:`~trainer.data.prepared.packed_identity`, equal for both forms of the same files);
    the others: every array the samples are read from."""
    if _KINDS[kind].packed:
        dtype = token_dtype(tokenizer.vocab_size)
        stream = hashlib.sha256(np.asarray(arrays.tokens, dtype=TOKEN_DTYPES[dtype]).tobytes()).hexdigest()
        return packed_identity(seq_len, dtype, stream, tokenizer.sha256)
    data = hashlib.sha256(f"{kind}\0{seq_len}\0".encode())
    for part in arrays.parts():
        data.update(part)
    return {"samples_sha256": data.hexdigest(), "tokenizer_sha256": tokenizer.sha256}


def open_dataset(
    kind: str, path: str | None, tokenizer: Tokenizer, seq_len: int, split: str = "train"
) -> SampleDataset | PreparedDataset:
    """The dataset ``training.dataset`` = ``kind`` and ``training.dataset_path`` = ``path`` name
    (the ``validation.*`` keys for ``split = "validation"``): a prepared folder
    (``scripts/prepare_data.py``) is memory-mapped; files are tokenized (:func:`build_dataset`)."""
    if path and is_prepared(path):
        section = "validation" if split == "validation" else "training"
        if kind not in PACKED_KINDS:
            raise DataError(
                f"`{section}.dataset_path` = {path!r} is a prepared folder of packed documents, which "
                f"`{section}.dataset` = {kind!r} cannot read; set `{section}.dataset` to 'shakespeare', or point "
                f"`{section}.dataset_path` at .txt/.jsonl files."
            )
        return PreparedDataset(path, seq_len, tokenizer)
    return build_dataset(kind, path, tokenizer, seq_len, split)
