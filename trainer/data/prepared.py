"""Training from a prepared folder (``scripts/prepare_data.py``): memory-mapped, packed samples.

The shards' token stream is the concatenation the in-memory ``shakespeare`` dataset packs, cut
the same way: sample i is tokens ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))`` of the stream
(windows may span shards; the incomplete tail is dropped), so every label is valid and the
samples equal the in-memory ones made from the same files.

Opening reads the manifest and checks the shards against it (``trainer.data.verification``:
hashed the first time, then only their sizes, times and inodes), so resident memory does not
grow with the corpus, nor start-up time after the first. Shards are mapped on first access in each process,
so the dataset pickles to loader workers as a few paths and numbers; the operating system pages
in the windows a batch touches and can drop them again.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.shards import MANIFEST, SHARDS, map_tokens, read_manifest
from trainer.data.tokenizer import Tokenizer
from trainer.data.verification import check_shards
from trainer.runtime.errors import DataError


def packed_identity(seq_len: int, dtype: str, stream_sha256: str, tokenizer_sha256: str) -> dict[str, str]:
    """What packed samples are: the token stream (its bytes as ``dtype`` shards, hashed), cut into
    windows of ``seq_len + 1``, of the tokenizer's ids. The same for a prepared folder and for the
    files it was prepared from, so a run may resume from either form of the same data."""
    samples = hashlib.sha256(f"packed\0{seq_len}\0{dtype}\0{stream_sha256}".encode()).hexdigest()
    return {"samples_sha256": samples, "tokenizer_sha256": tokenizer_sha256}


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder made by ``scripts/prepare_data.py`` (finished or not)."""
    root = Path(path).expanduser()
    return root.is_dir() and ((root / MANIFEST).is_file() or (root / SHARDS).is_dir())


class PreparedDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of ``(input_ids, labels)``, both ``LongTensor[seq_len]``, over the
    memory-mapped shards of a prepared folder (same interface as ``SampleDataset``)."""

    def __init__(self, folder: str, seq_len: int, tokenizer: Tokenizer) -> None:
        self.root = Path(folder).expanduser()
        manifest = read_manifest(self.root)
        _check_tokenizer(self.root, manifest, tokenizer)
        self.seq_len = seq_len
        self.pad_id = tokenizer.pad_id
        self.dtype: str = manifest["dtype"]
        self.hashed = check_shards(self.root, manifest, tokenizer.vocab_size)
        # Empty shards (blank units) hold no tokens; map only the others.
        shards = [shard for shard in manifest["shards"] if shard["tokens"] > 0]
        self._files = [str(self.root / shard["file"]) for shard in shards]
        self._starts = [0]
        for shard in shards:
            self._starts.append(self._starts[-1] + shard["tokens"])
        self._num_samples = self._starts[-1] // (seq_len + 1)
        if self._num_samples == 0:
            raise DataError(
                f"`training.dataset_path` = {folder!r} holds {self._starts[-1]} tokens, fewer than one sample of "
                f"`training.seq_len` + 1 = {seq_len + 1}; add data or lower `training.seq_len`."
            )
        self.identity = packed_identity(seq_len, self.dtype, manifest["stream_sha256"], tokenizer.sha256)
        self._views: list[np.memmap | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": None}  # each process maps the shards itself

    def __len__(self) -> int:
        return self._num_samples

    def _view(self, shard: int) -> np.memmap:
        if self._views is None:
            self._views = [None] * len(self._files)
        view = self._views[shard]
        if view is None:
            view = self._views[shard] = map_tokens(self._files[shard], self.dtype)
        return view

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a dataset of {len(self)} samples")
        start = index * (self.seq_len + 1)
        end = start + self.seq_len + 1
        shard = bisect.bisect_right(self._starts, start) - 1
        pieces = []
        while start < end:
            shard_end = self._starts[shard + 1]
            take = min(end, shard_end) - start
            offset = start - self._starts[shard]
            pieces.append(self._view(shard)[offset : offset + take])
            start += take
            shard += 1
        # The copy to int64 leaves the map's pages behind: a sample holds no reference to the shard.
        sequence = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        return sequence[:-1], sequence[1:]


def _check_tokenizer(root: Path, manifest: dict[str, Any], tokenizer: Tokenizer) -> None:
    prepared_with = manifest["tokenizer"]
    if prepared_with["sha256"] != tokenizer.sha256:
        raise DataError(
            f"{str(root)!r} was prepared with the tokenizer {prepared_with['file']!r} (sha256 "
            f"{prepared_with['sha256'][:12]}...), but `model.tokenizer_path` = {str(tokenizer.path)!r} is another "
            f"tokenizer (sha256 {tokenizer.sha256[:12]}... of its files, tokenizer_config.json included). Set `model.tokenizer_path` to the tokenizer the data was prepared "
            f"with, or re-prepare it: scripts/prepare_data.py --tokenizer {tokenizer.path} ..."
        )
    if manifest["max_token_id"] >= tokenizer.vocab_size:
        raise DataError(
            f"{str(root)!r} holds the token id {manifest['max_token_id']}, beyond the vocabulary of "
            f"{tokenizer.vocab_size} of `model.tokenizer_path` = {str(tokenizer.path)!r}; re-prepare the data "
            "with scripts/prepare_data.py."
        )
