"""The prepared-folder format, shared by its writer (``trainer.data.prepare``) and its reader
(``trainer.data.prepared``), so that neither needs the other.

Folder layout (``FORMAT_VERSION`` 1)::

    manifest.json          written last: its presence means the folder is complete
    shards/000000.bin      the unit's tokens, uint16 (vocabulary <= 65536) or uint32, little-endian
    shards/000000.idx      uint64 little-endian document offsets into the shard, documents + 1 of them
    shards/000000.json     the done-record: the unit's source range and its sha256, the tokenizer's
                           sha256, the shard's counts and sha256

There is no header: a shard's size and sha256 live in the manifest, so a ``.bin`` file is a bare
token array that ``numpy.memmap`` maps as it is.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.tokenizer import Tokenizer
from trainer.runtime.errors import DataError

FORMAT = "meshtrain.prepared"
FORMAT_VERSION = 1
"""Bump with any change to the layout or to how a unit's tokens are made (which also changes
what the in-memory path makes: see ``trainer.data.cache.FORMAT_VERSION``)."""
MANIFEST = "manifest.json"
SHARDS = "shards"
TOKEN_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""The shard element types by the name the manifest records, little-endian whatever the host."""
OFFSET_DTYPE: np.dtype[Any] = np.dtype("<u8")

MANIFEST_KEYS: dict[str, type] = {
    "format": str,
    "format_version": int,
    "tokenizer": dict,
    "dtype": str,
    "byte_order": str,
    "sources": list,
    "shards": list,
    "total_tokens": int,
    "total_documents": int,
    "max_token_id": int,
}
TOKENIZER_KEYS: dict[str, type] = {
    "file": str,
    "sha256": str,
    "vocab_size": int,
    "bos_id": int,
    "eos_id": int,
}
SHARD_KEYS: dict[str, type] = {
    "file": str,
    "index": str,
    "tokens": int,
    "documents": int,
    "sha256": str,
    "max_token_id": int,
    "source": str,
    "source_range": list,
    "source_sha256": str,
}


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard element type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_paths(out: Path, index: int) -> tuple[Path, Path, Path]:
    """The tokens, document offsets and done-record of unit ``index``."""
    stem = out / SHARDS / f"{index:06d}"
    return stem.with_suffix(".bin"), stem.with_suffix(".idx"), stem.with_suffix(".json")


def file_sizes(dtype: str, tokens: int, documents: int) -> tuple[int, int]:
    """The byte sizes of a shard's ``.bin`` and ``.idx`` files."""
    return tokens * TOKEN_DTYPES[dtype].itemsize, (documents + 1) * OFFSET_DTYPE.itemsize


def token_array(dtype: str) -> array:
    """An empty array of the shard element type (in the host's byte order), to collect tokens in:
    two or four bytes a token, and ``fromlist`` raises ``OverflowError`` on an id it cannot hold."""
    return array(TOKEN_DTYPES[dtype].char)


def encode_shard(tokens: array, offsets: array, dtype: str) -> tuple[bytes, bytes]:
    """The little-endian ``.bin`` and ``.idx`` bytes of a shard's tokens and document offsets."""
    return (
        np.asarray(tokens, dtype=TOKEN_DTYPES[dtype]).tobytes(),
        np.asarray(offsets, dtype=OFFSET_DTYPE).tobytes(),
    )


def map_tokens(file: Path | str, dtype: str) -> np.memmap:
    """The tokens of a shard, mapped read-only: pages are read when touched, never copied whole."""
    return np.memmap(file, dtype=TOKEN_DTYPES[dtype], mode="r")


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_entry(record: Mapping[str, Any]) -> dict[str, Any]:
    """A shard's line in the manifest, from its done-record."""
    identity = record["identity"]
    return {
        "file": record["file"],
        "index": record["index"],
        "tokens": record["tokens"],
        "documents": record["documents"],
        "sha256": record["sha256"],
        "max_token_id": record["max_token_id"],
        "source": identity["source"],
        "source_range": [identity["start"], identity["end"]],
        "source_sha256": identity["sha256"],
    }


def build_manifest(
    tokenizer: Tokenizer, dtype: str, sources: Mapping[str, int], shards: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest of the shards ``shards`` (manifest entries), tokenized by ``tokenizer`` from
    ``sources`` (path -> size in bytes)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            "file": Path(str(tokenizer.path)).name,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": dtype,
        "byte_order": "little",
        "sources": [{"path": path, "size": size} for path, size in sources.items()],
        "shards": shards,
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_documents": sum(s["documents"] for s in shards),
        "max_token_id": max((s["max_token_id"] for s in shards), default=-1),
    }


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the prepared folder ``root``, its format and keys checked."""
    if not root.is_dir():
        raise DataError(f"{str(root)!r} is not a folder; name a folder made by scripts/prepare_data.py.")
    file = root / MANIFEST
    if not file.is_file():
        raise DataError(
            f"{str(root)!r} is a prepared folder whose preparation did not finish (no {MANIFEST}); "
            "rerun scripts/prepare_data.py with the same arguments: it keeps the finished shards."
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{file}: unreadable manifest ({exc}); re-prepare the folder with scripts/prepare_data.py."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{file} is not a meshtrain prepared-data manifest; point `training.dataset_path` elsewhere.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{file} has format version {manifest.get('format_version')!r}; this meshtrain reads version "
            f"{FORMAT_VERSION}. Re-prepare the data with this version's scripts/prepare_data.py."
        )
    _check_keys(file, "", manifest, MANIFEST_KEYS)
    _check_keys(file, "tokenizer.", manifest["tokenizer"], TOKENIZER_KEYS)
    for number, shard in enumerate(manifest["shards"]):
        _check_keys(file, f"shards[{number}].", shard, SHARD_KEYS)
    if manifest["dtype"] not in TOKEN_DTYPES or manifest["byte_order"] != "little":
        raise DataError(
            f"{file}: dtype {manifest['dtype']!r}, byte order {manifest['byte_order']!r}; shards are little-endian "
            f"{' or '.join(TOKEN_DTYPES)}. The manifest is damaged: re-prepare the folder with scripts/prepare_data.py."
        )
    return manifest


def _check_keys(file: Path, where: str, value: Any, keys: Mapping[str, type]) -> None:
    if not isinstance(value, dict):
        raise DataError(
            f"{file}: {where.rstrip('.') or 'the manifest'} is not a JSON object; the manifest is damaged: "
            "re-prepare the folder with scripts/prepare_data.py."
        )
    for key, kind in keys.items():
        # bool is an int to isinstance, never a count or an id here.
        if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
            raise DataError(
                f"{file}: {where}{key} is missing or not a {kind.__name__}; the manifest is "
                "damaged: re-prepare the folder with scripts/prepare_data.py."
            )


def verify(folder: str) -> list[str]:
    """Every problem a full check of a prepared folder finds: the manifest, each shard's size and
    sha256 and each index's size (an empty list: the folder is sound)."""
    root = Path(folder)
    manifest = read_manifest(root)
    problems = []
    for shard in manifest["shards"]:
        bin_file, idx_file = root / shard["file"], root / shard["index"]
        bin_size, idx_size = file_sizes(manifest["dtype"], shard["tokens"], shard["documents"])
        try:
            digest = sha256_file(bin_file)
            size_ok = bin_file.stat().st_size == bin_size
            idx_ok = idx_file.stat().st_size == idx_size
        except OSError as exc:
            problems.append(f"{bin_file}: cannot be read ({exc})")
            continue
        if not size_ok or digest != shard["sha256"]:
            problems.append(f"{bin_file}: its bytes differ from the manifest's size or sha256")
        if not idx_ok:
            problems.append(f"{idx_file}: its size does not match {shard['documents']} documents")
    return problems
