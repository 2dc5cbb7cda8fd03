"""Tokenizers: SentencePiece ``.model`` files and Hugging Face ``tokenizer.json`` files.

The data pipeline needs ids, a BOS and an EOS (every packed document and every sample is framed
by them), a pad id, the ids of a few special tokens (chat templates), and a fingerprint of the
file (the token cache and the checkpoints' data identity are keyed by it). :func:`load_tokenizer`
picks the implementation from the file:

* SentencePiece (the bundled Shakespeare model, Llama 2, Mistral): BOS, EOS and pad are the
  model's own; a model without a pad piece pads with EOS.
* Hugging Face ``tokenizer.json`` (Llama 3 and most models on the Hub), through the
  ``tokenizers`` package (``pip install -e ".[hf]"``). BOS, EOS and pad come from
  ``tokenizer_config.json`` beside the file when it names them, as ``from_pretrained`` reads
  them; otherwise from the vocabulary's well-known special tokens (Llama 3's
  ``<|begin_of_text|>`` / ``<|end_of_text|>``, ``<s>`` / ``</s>``, ...). Special tokens written
  in the training text are encoded as plain text, never as the special token: a document
  containing ``<|eot_id|>`` must not end a chat turn.

Padded positions are never a label, so any valid id pads; EOS is the fallback.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.runtime.errors import DataError

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[BOS]", "<|endoftext|>")
"""Looked for in order when ``tokenizer_config.json`` names no BOS. The last is for tokenizers
without one (Qwen's, GPT-2's), whose documents are separated by ``<|endoftext|>``: it opens each."""
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>", "[EOS]")
PAD_NAMES = ("<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]")
CONFIG_FILE = "tokenizer_config.json"
"""Beside a ``tokenizer.json``: names its BOS, EOS and pad tokens, so it is part of the tokenizer."""


class Tokenizer(ABC):
    """What the data pipeline uses of a tokenizer."""

    def __init__(self, file: Path, data: bytes) -> None:
        self.path = file
        self.sha256 = hashlib.sha256(data).hexdigest()
        """Of the bytes of every file that decides the ids (the model file, and a Hugging Face
        tokenizer's ``tokenizer_config.json``): two tokenizers whose files differ are different."""

    @property
    @abstractmethod
    def library(self) -> str:
        """The library and version that runs the file: a new version may tokenize differently."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce is below this (special tokens included)."""

    @property
    @abstractmethod
    def bos_id(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abstractmethod
    def pad_id(self) -> int: ...

    @abstractmethod
    def token_id(self, piece: str) -> int | None:
        """The id of the token spelled ``piece`` (a special token such as ``<|eot_id|>``), or None."""

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self._encode(text)
        return [self.bos_id] * bos + ids + [self.eos_id] * eos


def _read(path: str) -> tuple[Path, bytes]:
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"Tokenizer file {str(file)!r} does not exist or is not a file; set `model.tokenizer_path` "
            "to a SentencePiece .model or a Hugging Face tokenizer.json (the bundled one is "
            "assets/tokenizer/shakespeare.model, rebuilt by scripts/train_tokenizer.py)."
        )
    return file, file.read_bytes()


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in ``path``: a Hugging Face ``tokenizer.json`` (a ``.json`` file) or a
    SentencePiece model (anything else)."""
    file, data = _read(path)
    return HuggingFaceTokenizer(file, data) if file.suffix == ".json" else SentencePieceTokenizer(file, data)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model, loaded from bytes read here (so that the same bytes are hashed)."""

    def __init__(self, file: Path, data: bytes) -> None:
        import sentencepiece as spm

        super().__init__(file, data)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except RuntimeError as exc:
            raise DataError(
                f"Tokenizer file {str(file)!r} is not a SentencePiece model ({exc}); set "
                "`model.tokenizer_path` to a SentencePiece .model file or a Hugging Face tokenizer.json."
            ) from exc
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise DataError(
                f"Tokenizer {str(file)!r} defines no BOS or EOS token, which every training sample "
                "needs; set `model.tokenizer_path` to a model trained with bos_id and eos_id."
            )

    @property
    def library(self) -> str:
        import sentencepiece

        return f"sentencepiece {sentencepiece.__version__}"

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
        """The model's pad id, or EOS for models without one (Llama 2, Mistral)."""
        pad = self._sp.pad_id()
        return pad if pad >= 0 else self.eos_id

    def token_id(self, piece: str) -> int | None:
        piece_id = self._sp.piece_to_id(piece)
        return piece_id if self._sp.id_to_piece(piece_id) == piece else None

    def _encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        # int() accepts 0-d tensors too, so a row of a LongTensor decodes without .tolist().
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` package."""

    def __init__(self, file: Path, data: bytes) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError as exc:
            raise ImportError(
                f"`model.tokenizer_path` = {str(file)!r} is a Hugging Face tokenizer.json, which needs the "
                '`tokenizers` package: `pip install -e ".[hf]"`.'
            ) from exc
        super().__init__(file, data)
        try:
            self._tk = RustTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust parser raises plain Exception subclasses
            raise DataError(
                f"Tokenizer file {str(file)!r} is not a Hugging Face tokenizer.json ({exc}); set "
                "`model.tokenizer_path` to a tokenizer.json or a SentencePiece .model file."
            ) from exc
        self._tk.encode_special_tokens = True  # special tokens in the text stay text
        config_file = file.with_name(CONFIG_FILE)
        named = _configured_specials(config_file)
        if config_file.is_file():
            # BOS/EOS/pad come from it: an edited EOS is another tokenizer (cache, data identity).
            self.sha256 = hashlib.sha256(
                bytes.fromhex(self.sha256) + f"\0{CONFIG_FILE}\0".encode() + config_file.read_bytes()
            ).hexdigest()
        bos = self._special(named.get("bos_token"), BOS_NAMES)
        eos = self._special(named.get("eos_token"), EOS_NAMES)
        if bos is None or eos is None:
            which = "BOS" if bos is None else "EOS"
            raise DataError(
                f"Tokenizer {str(file)!r} has no {which} token (looked for tokenizer_config.json's "
                f"bos_token/eos_token, then for {', '.join(BOS_NAMES if which == 'BOS' else EOS_NAMES)}); "
                "every training sample needs both. Add them to tokenizer_config.json beside the file."
            )
        self._bos, self._eos = bos, eos
        self._pad = self._special(named.get("pad_token"), PAD_NAMES)

    def _special(self, configured: str | None, names: tuple[str, ...]) -> int | None:
        for name in ([configured] if configured else []) + list(names):
            token = self._tk.token_to_id(name)
            if token is not None:
                return token
        return None

    @property
    def library(self) -> str:
        import tokenizers

        return f"tokenizers {tokenizers.__version__}"

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad if self._pad is not None else self._eos

    def token_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def _encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)


def _configured_specials(config_file: Path) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` of a ``tokenizer_config.json``, if there is one."""
    if not config_file.is_file():
        return {}
    try:
        config: Any = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{config_file}: unreadable tokenizer config ({exc}); it names the BOS, EOS and pad tokens of the "
            "tokenizer.json beside it: repair it (valid JSON) or remove it to use the well-known names."
        ) from None
    if not isinstance(config, dict):
        raise DataError(
            f"{config_file}: not a JSON object; it names the BOS, EOS and pad tokens of the tokenizer.json "
            "beside it: repair it or remove it to use the well-known names."
        )
    found = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[key] = value
    return found
