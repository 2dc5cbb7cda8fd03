"""The prepared-folder format, shared by its writer (``trainer.data.prepare``) and its reader
(``trainer.data.prepared``), so that neither needs the other.

Folder layout (``FORMAT_VERSION`` 1)::

    manifest.json               written last: its presence means the folder is complete
    shards/000000-<sha>.bin     unit 0's tokens, uint16 (vocabulary <= 65536) or uint32, little-endian
    shards/000000-<sha>.idx     uint64 little-endian document offsets into the shard, documents + 1 of them
    shards/000000-<sha>.json    the done-record: the unit's source range and its sha256, the tokenizer's
                                sha256, the shard's counts and sha256

``<sha>`` is the first 16 hex digits of the ``.bin`` file's sha256 (folders written before had
none: ``shards/000000.bin``; the manifest names each file). Naming shards by content lets a rerun
write its new shards beside the ones the current manifest names, so the folder stays whole until
the new manifest replaces the old in one rename.

There is no header: a shard's size and sha256 live in the manifest, so a ``.bin`` file is a bare
token array that ``numpy.memmap`` maps as it is. The manifest also holds ``stream_sha256``, the
sha256 of all shards' bytes in order (the token stream, whatever its cut into units: what the
in-memory path hashes to tell the same samples), and ``manifest_sha256``, the sha256 of its own
other keys (:func:`manifest_checksum`), so an edited shard list or total is noticed.
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
    "stream_sha256": str,
    "manifest_sha256": str,
}
PROOF_KEYS = ("stream_sha256", "manifest_sha256")
"""Manifest keys written by prepare_data since it names shards by content; a rerun adds them."""
RERUN = (
    "rerun scripts/prepare_data.py with the same arguments: it keeps the shards whose bytes verify by hash, "
    "redoes the others and rewrites the manifest"
)
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


def shard_paths(out: Path, index: int, sha256: str) -> tuple[Path, Path, Path]:
    """The tokens, document offsets and done-record of unit ``index``, whose tokens hash to ``sha256``."""
    stem = out / SHARDS / f"{index:06d}-{sha256[:16]}"
    return stem.with_suffix(".bin"), stem.with_suffix(".idx"), stem.with_suffix(".json")


def done_records(out: Path, index: int) -> list[Path]:
    """The done-records of unit ``index`` in ``out``: the current one, and those of earlier runs."""
    return sorted((out / SHARDS).glob(f"{index:06d}*.json"))


def done_record_of(bin_file: Path) -> Path:
    """The done-record beside a shard: the proof that a worker finished writing it."""
    return bin_file.with_suffix(".json")


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


def stream_sha256(root: Path, shards: list[dict[str, Any]]) -> str:
    """The sha256 of the shards' bytes, read in order: the token stream's fingerprint."""
    digest = hashlib.sha256()
    for shard in shards:
        with open(root / shard["file"], "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def manifest_checksum(manifest: Mapping[str, Any]) -> str:
    """The sha256 of a manifest's keys other than ``manifest_sha256``, in a canonical form."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(
    tokenizer: Tokenizer, dtype: str, sources: Mapping[str, int], shards: list[dict[str, Any]], stream: str
) -> dict[str, Any]:
    """The manifest of the shards ``shards`` (manifest entries), tokenized by ``tokenizer`` from
    ``sources`` (path -> size in bytes), whose bytes in order hash to ``stream``."""
    manifest = {
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
        "stream_sha256": stream,
    }
    return {**manifest, "manifest_sha256": manifest_checksum(manifest)}


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the prepared folder ``root``, its format and keys checked."""
    if not root.exists():
        raise DataError(f"{str(root)!r} does not exist; name a folder made by scripts/prepare_data.py.")
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
    if manifest_checksum(manifest) != manifest["manifest_sha256"]:
        raise DataError(
            f"{file}: its contents do not match its manifest_sha256, so it was edited or damaged (shards added, "
            f"dropped or changed); {RERUN}."
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
            fix = RERUN if key in PROOF_KEYS and not where else "re-prepare the folder with scripts/prepare_data.py"
            raise DataError(
                f"{file}: {where}{key} is missing or not a {kind.__name__}; the manifest is damaged or "
                f"incomplete: {fix}."
            )


def verify(folder: str) -> list[str]:
    """Every problem a full check of a prepared folder finds: the manifest, each shard's size,
    sha256 and done-record and each index's size (an empty list: the folder is sound)."""
    root = Path(folder)
    manifest = read_manifest(root)
    problems = []
    for shard in manifest["shards"]:
        bin_file, idx_file = root / shard["file"], root / shard["index"]
        problem = done_record_problem(bin_file, shard["sha256"])
        if problem:
            problems.append(problem)
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


def done_record_problem(bin_file: Path, sha256: str) -> str | None:
    """What is wrong with a shard's done-record (missing, unreadable, of other bytes), or None."""
    record_file = done_record_of(bin_file)
    try:
        record = json.loads(record_file.read_text())
    except FileNotFoundError:
        return f"{record_file}: missing; a shard without its done-record was never finished by prepare_data"
    except (OSError, ValueError) as exc:
        return f"{record_file}: unreadable done-record ({exc})"
    if not isinstance(record, dict) or record.get("sha256") != sha256:
        return f"{record_file}: its sha256 is not the manifest's for {bin_file.name}"
    return None
