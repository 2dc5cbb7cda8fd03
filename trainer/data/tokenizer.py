"""SentencePiece tokenizer used by the data pipeline and for decoding samples.

The trainer only needs ids, not pieces, so this wrapper exposes a deliberately small surface:
it works with any SentencePiece ``.model`` (the bundled Shakespeare model, Llama 2, Mistral, ...)
as long as the model defines BOS and EOS, which every packed or prompt/response sample needs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm


class Tokenizer:
    """Text <-> token ids through a SentencePiece model file.

    The model is loaded from bytes read here (rather than letting SentencePiece open the path)
    so the same bytes can be fingerprinted: the dataset cache must be invalidated when the
    tokenizer file changes, even if its path does not.
    """

    def __init__(self, path: str) -> None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(
                f"Tokenizer file {str(file)!r} does not exist or is not a file; set "
                "`model.tokenizer_path` to a SentencePiece .model file (the bundled one is "
                "assets/tokenizer/shakespeare.model, rebuilt by scripts/train_tokenizer.py)."
            )
        data = file.read_bytes()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except RuntimeError as exc:
            raise FileNotFoundError(
                f"Tokenizer file {str(file)!r} is not a SentencePiece model ({exc}); set "
                "`model.tokenizer_path` to a SentencePiece .model file (tokenizer.json files of "
                "Hugging Face fast tokenizers are not supported)."
            ) from exc
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise ValueError(
                f"Tokenizer {str(file)!r} defines no BOS or EOS token, which every training "
                "sample needs; set `model.tokenizer_path` to a model trained with bos_id and eos_id."
            )
        self.sha256 = hashlib.sha256(data).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        """The model's pad id, or EOS for models without one (Llama 2, Mistral).

        Reusing EOS is safe because padded positions are excluded from the loss; only the
        embedding lookup sees them, and any valid id works there.
        """
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self.eos_id

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = self._sp.encode(text, out_type=int)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        # int() accepts 0-d tensors too, so a row of a LongTensor decodes without .tolist().
        return self._sp.decode([int(i) for i in ids])
