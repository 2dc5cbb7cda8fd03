"""A prepared folder's shards, checked against its manifest's hashes before they are trained on.

A shard's size says little: a shard rewritten in place (same size, other ids) or damaged on disk
would train without a word. So before a run uses a prepared folder, every shard must have its
done-record (the proof that a worker finished it) and bytes whose sha256 is the manifest's.

Hashing costs about a second per gigabyte, paid once per file version: a *verified record*
remembers, for each shard, the ``(size, mtime_ns, inode)`` its hash was checked at and the hash
it was checked against, so later starts only ``stat`` the files. Writing to a shard changes its
mtime, replacing it changes its inode, and a manifest that names other bytes names another hash:
each sends the shard back to hashing. Records live under the token cache's folder
(``MESHTRAIN_CACHE_DIR``), one per prepared folder keyed by its real path, so read-only data is
verified too; the processes of a job starting together take turns, so one hashes and the others
read its record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.cache import cache_dir, locked
from trainer.data.shards import RERUN, done_record_of, done_record_problem, file_sizes, map_tokens, sha256_file
from trainer.runtime.errors import DataError

logger = logging.getLogger("meshtrain")

RECORDS = "verified"
"""The folder, under the cache folder, of the verified records."""


def record_file(root: Path) -> Path:
    """Where the verified record of the prepared folder ``root`` is kept."""
    return cache_dir() / RECORDS / f"{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]}.json"


def check_shards(root: Path, manifest: dict[str, Any], vocab_size: int) -> int:
    """Raise :class:`DataError` naming the first shard of ``root`` that is missing, of another size,
    without its done-record, or whose bytes are not the manifest's; return how many were hashed."""
    shards = manifest["shards"]
    for shard in shards:
        if not done_record_of(root / shard["file"]).is_file():
            raise DataError(
                f"{done_record_of(root / shard['file'])}: missing, so nothing proves that prepare_data finished "
                f"{shard['file']} although the manifest names it; {RERUN}."
            )
    file = record_file(root)
    with locked(file.with_suffix(".lock")):
        record = _load(file)
        fresh: dict[str, list[Any]] = {}
        hashed = 0
        for shard in shards:
            bin_file = root / shard["file"]
            stamp = _stamp(bin_file, file_sizes(manifest["dtype"], shard["tokens"], shard["documents"])[0])
            stamp.append(shard["sha256"])
            if record.get(shard["file"]) != stamp:
                _check_bytes(bin_file, shard, manifest["dtype"], vocab_size)
                hashed += 1
            fresh[shard["file"]] = stamp
        if fresh != record:
            _save(file, fresh)
    return hashed


def _stamp(file: Path, expected_size: int) -> list[Any]:
    try:
        stat = file.stat()
    except OSError:
        raise DataError(f"{file}: a shard of the prepared folder is missing; {RERUN}.") from None
    if stat.st_size != expected_size:
        raise DataError(
            f"{file}: {stat.st_size} bytes, the manifest says {expected_size}; the shard is truncated or damaged: "
            f"{RERUN} (scripts/prepare_data.py --verify FOLDER checks every shard)."
        )
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _check_bytes(file: Path, shard: dict[str, Any], dtype: str, vocab_size: int) -> None:
    problem = done_record_problem(file, shard["sha256"])
    if problem:
        raise DataError(f"{problem}; {RERUN}.")
    if sha256_file(file) == shard["sha256"]:
        return
    tokens = map_tokens(file, dtype)
    top = int(np.max(tokens)) if len(tokens) else -1
    beyond = f"holds the token id {top}, beyond the vocabulary of {vocab_size}, and " if top >= vocab_size else ""
    raise DataError(
        f"{file}: {beyond}its bytes are not the ones prepared (sha256 differs from the manifest's; rewritten or "
        f"damaged in place); {RERUN}."
    )


def _load(file: Path) -> dict[str, list[Any]]:
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _save(file: Path, record: dict[str, list[Any]]) -> None:
    """Atomically; a cache folder that cannot be written costs the next start a rehash, no more."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, file)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        logger.warning(
            "Cannot write the shard verification record %s (%s); the next start hashes the shards again. Set "
            "MESHTRAIN_CACHE_DIR to a writable folder.",
            file,
            exc,
        )
