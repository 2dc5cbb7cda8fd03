"""The on-disk token cache: a machine tokenizes a corpus once, not once per rank and run.

Files live under ``MESHTRAIN_CACHE_DIR`` (default ``~/.cache/meshtrain``), one per dataset,
keyed by what its tokens depend on (:func:`cache_key`) and by nothing else, so that editing the
loader, or any docstring, keeps every cache valid.

File layout: magic, key (64 hex chars), the arrays' lengths, sha256 of the body, body. A raw
format rather than ``torch.save``: the body is hashed as written, without numpy or copies. The
arrays are stored in native byte order, which is why the key includes ``sys.byteorder``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import sys
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger("meshtrain")

FORMAT_VERSION = 3
"""The version of the code that turns files into tokens: the cleaning in ``sources``, the
packing and dialogue pairing in ``samples``. The key sees every other input but not that code,
so bump this with any change there that alters the samples made from the same files; otherwise
runs would silently train on the samples the old code made."""

_MAGIC = b"MTCACHE1"


def _header(num_arrays: int) -> struct.Struct:
    return struct.Struct(f"<8s64s{num_arrays}Q32s")


def cache_dir() -> Path:
    return Path(os.environ.get("MESHTRAIN_CACHE_DIR") or Path.home() / ".cache" / "meshtrain")


def cache_key(
    kind: str, seq_len: int, tokenizer_sha256: str, tokenizer_library: str, files: Sequence[tuple[Path, bytes]]
) -> str:
    """Everything the tokens depend on: the code's :data:`FORMAT_VERSION`, the dataset kind,
    ``seq_len``, the tokenizer file, the library and version that runs it, the byte order the
    arrays are stored in, and each source file's name, size and bytes."""
    h = hashlib.sha256()
    for part in (str(FORMAT_VERSION), kind, str(seq_len), tokenizer_sha256, tokenizer_library, sys.byteorder):
        h.update(part.encode() + b"\0")
    for file, data in files:
        h.update(f"{file.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def load_or_build(
    kind: str,
    seq_len: int,
    tokenizer_sha256: str,
    tokenizer_library: str,
    files: Sequence[tuple[Path, bytes]],
    typecodes: Sequence[str],
    build: Callable[[], Sequence[array]],
) -> list[array]:
    """The arrays (of ``typecodes``) cached for these inputs, or ``build()``'s, then cached."""
    key = cache_key(kind, seq_len, tokenizer_sha256, tokenizer_library, files)
    file = cache_dir() / "datasets" / f"{kind}-{seq_len}-{key[:32]}.bin"
    with locked(file.with_suffix(".lock")):
        arrays = _load(file, key, typecodes)
        if arrays is None:
            arrays = list(build())
            _save(file, key, arrays)
    return arrays


@contextlib.contextmanager
def locked(lock_file: Path) -> Iterator[None]:
    """Serialize the ranks that start together: one tokenizes (or hashes) while the others wait
    and then read its cache file, instead of all of them doing the same work on the same few cores."""
    with contextlib.ExitStack() as stack:
        try:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            handle = stack.enter_context(open(lock_file, "ab"))
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or if the process dies
        except OSError as exc:
            logger.warning("Cannot lock the dataset cache %s (%s); building without it.", lock_file, exc)
        yield


def _load(file: Path, key: str, typecodes: Sequence[str]) -> list[array] | None:
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("Cannot read the dataset cache %s (%s); rebuilding it.", file, exc)
        return None
    header = _header(len(typecodes))
    if len(data) >= header.size:
        magic, file_key, *lengths, digest = header.unpack_from(data)
        arrays = [array(typecode) for typecode in typecodes]
        body = memoryview(data)[header.size :]
        sizes = [n * part.itemsize for n, part in zip(lengths, arrays)]
        if (
            magic == _MAGIC
            and file_key == key.encode()
            and len(body) == sum(sizes)
            and hashlib.sha256(body).digest() == digest
        ):
            position = 0
            for size, part in zip(sizes, arrays):
                part.frombytes(body[position : position + size])
                position += size
            return arrays
    logger.warning("Dataset cache %s is damaged; rebuilding it.", file)
    return None


def _save(file: Path, key: str, arrays: Sequence[array]) -> None:
    """Write atomically, so that a crash mid-write, or a rank that could not take the lock,
    never leaves a partial file under the final name."""
    digest = hashlib.sha256()
    for part in arrays:
        digest.update(part)
    header = _header(len(arrays)).pack(_MAGIC, key.encode(), *map(len, arrays), digest.digest())
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                for part in arrays:
                    fh.write(part)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, file)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        # The cache only saves time; a read-only home directory must not stop training.
        logger.warning(
            "Cannot write the dataset cache %s (%s); set MESHTRAIN_CACHE_DIR to a writable folder.", file, exc
        )
