"""Parquet input, the format of most public pre-training corpora, read one row group at a time.

A Parquet file gives the same records as a ``.jsonl`` file: a string column ``text`` (packed
documents), ``prompt`` and ``response`` (pairs), or ``messages``, a list of
``{role, content}`` structs (chat). Only the columns needed are read, one row group at a time,
so memory holds one row group's columns at a time, however big the file: the bound is the row
group size its writer chose (``row_group_size``), not the file's.

Identity is by content, as for ``.jsonl``: the in-memory path keys its token cache on the
file's sha256, and ``prepare_data`` cuts a file into units of whole row groups, each identified
by the sha256 of its bytes and of the footer that says how to decode them. Text is read after
hashing, not from the hashed bytes, so every read is followed by a second hash: a file rewritten
in between is an error, never tokens cached under the identity of other bytes.

``pyarrow`` is an optional dependency, imported when the first Parquet file is met.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.runtime.errors import DataError

SUFFIX = ".parquet"
INSTALL = 'pip install -e ".[parquet]"'
_FOOTER_TAIL = 8
"""A Parquet file ends with the footer's length (4 bytes, little-endian) and ``PAR1``."""
_CHUNK = 1 << 24


def is_parquet(file: Path) -> bool:
    return file.name.lower().endswith(SUFFIX)


def _pq(file: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{file}: a Parquet file, which needs the pyarrow package: run {INSTALL} (or pip install pyarrow), "
            "or move it out of the inputs."
        ) from None
    return pq


def _problem(exc: BaseException) -> str:
    """pyarrow's message on one line (thrift errors span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _open(file: Path) -> Any:
    pq = _pq(file)
    try:
        # Pages written with CRCs (pyarrow's write_page_checksum) are checked as they are read.
        return pq.ParquetFile(file, page_checksum_verification=True)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{file}: not a readable Parquet file ({_problem(exc)}); write it again (a copy cut short loses the "
            "footer), or move it out of the inputs."
        ) from None


# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


def _sha256(file: Path, ranges: Sequence[tuple[int, int]]) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as fh:
        for start, end in ranges:
            fh.seek(start)
            while start < end and (chunk := fh.read(min(_CHUNK, end - start))):
                digest.update(chunk)
                start += len(chunk)
    return digest.hexdigest()


def identity(file: Path, start: int = 0, end: int | None = None) -> str:
    """What the bytes of ``file`` are, as a sha256 read in chunks: of the whole file (``end``
    None; the token cache's key), or of the row groups in bytes ``[start, end)`` and the footer
    that says how to decode them (a ``prepare_data`` unit)."""
    if end is None:
        return _sha256(file, [(0, file.stat().st_size)])
    return _sha256(file, [(start, end), _footer(file)])


def _footer(file: Path) -> tuple[int, int]:
    """The byte range of the footer (the file's metadata: schema, row groups, encodings)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        fh.seek(max(size - _FOOTER_TAIL, 0))
        tail = fh.read(_FOOTER_TAIL)
    length = struct.unpack("<I", tail[:4])[0] if len(tail) == _FOOTER_TAIL else 0
    return max(size - _FOOTER_TAIL - length, 0), size


# --------------------------------------------------------------------------------------------
# Row groups and units
# --------------------------------------------------------------------------------------------


def _row_group_range(meta: Any) -> tuple[int, int]:
    """The bytes of a row group: from its first column chunk's first page (the dictionary page,
    if any) to its last chunk's end."""
    starts, ends = [], []
    for c in range(meta.num_columns):
        column = meta.column(c)
        start = column.data_page_offset
        if column.has_dictionary_page and column.dictionary_page_offset:
            start = min(start, column.dictionary_page_offset)
        starts.append(start)
        ends.append(start + column.total_compressed_size)
    return (min(starts), max(ends)) if starts else (0, 0)


def unit_ranges(file: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of runs of whole row groups holding about ``unit_bytes`` of decoded data each
    (a bigger row group is a unit of its own): ``prepare_data``'s units of ``file``. A file
    without row groups is one empty unit, so that it is still named in the manifest."""
    with _open(file) as parquet_file:
        meta = parquet_file.metadata
    ranges: list[tuple[int, int]] = []
    size = 0
    for g in range(meta.num_row_groups):
        start, end = _row_group_range(meta.row_group(g))
        if ranges and size < unit_bytes:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
            size = 0
        size += meta.row_group(g).total_byte_size
    return ranges or [(0, 0)]


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def _is_any(pa: Any, kind: Any, *tests: str) -> bool:
    """Whether ``kind`` passes one of the ``pa.types`` tests named (view types came in pyarrow 16)."""
    return any(getattr(pa.types, test, lambda _: False)(kind) for test in tests)


def _is_string(pa: Any, kind: Any) -> bool:
    return _is_any(pa, kind, "is_string", "is_large_string", "is_string_view")


def _type_problem(pa: Any, key: str, kind: Any) -> str | None:
    if key != "messages":
        return None if _is_string(pa, kind) else f"of type {kind}, not string"
    if _is_any(pa, kind, "is_list", "is_large_list", "is_list_view", "is_large_list_view"):
        item = kind.value_type
        if pa.types.is_struct(item):
            names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
            if all(name in names and _is_string(pa, names[name]) for name in ("role", "content")):
                return None
    return f"of type {kind}, not a list of structs {{role: string, content: string}}"


def _check_columns(file: Path, parquet_file: Any, keys: tuple[str, ...], need: str) -> None:
    import pyarrow as pa

    schema = parquet_file.schema_arrow
    for key in keys:
        if key not in schema.names:
            columns = ", ".join(f'"{n}"' for n in schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
            raise DataError(
                f'{file}: no column "{key}" (its columns: {columns or "none"}); {need}: rename the column that '
                "holds it, or convert the file."
            )
        problem = _type_problem(pa, key, schema.field(key).type)
        if problem:
            raise DataError(f'{file}: the column "{key}" is {problem}; {need}.')


def rows(
    file: Path, keys: tuple[str, ...], need: str, start: int = 0, end: int | None = None, expected: str | None = None
) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """``(where, values of keys)`` of each row of ``file`` (of its row groups whose bytes begin
    in ``[start, end)``, all by default), reading one row group's columns ``keys`` at a time.

    Types and nulls are checked, ``need`` saying what the data needs in errors; ``where`` names
    the file and the row, counted from 0 as pyarrow and pandas count them. ``expected`` is the
    :func:`identity` of what is read, checked again after the last row."""
    with _open(file) as parquet_file:
        _check_columns(file, parquet_file, keys, need)
        meta = parquet_file.metadata
        first_row = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            if end is None or start <= _row_group_range(group)[0] < end:
                yield from _group_rows(file, parquet_file, g, keys, first_row, need)
            first_row += group.num_rows
    if expected is not None and identity(file, start, end) != expected:
        raise DataError(
            f"{file}: changed while it was read; rerun once whatever writes it has finished (nothing was kept "
            "from this read)."
        )


def _group_rows(
    file: Path, parquet_file: Any, g: int, keys: tuple[str, ...], first_row: int, need: str
) -> Iterator[tuple[str, tuple[Any, ...]]]:
    try:
        table = parquet_file.read_row_group(g, columns=list(keys))
        columns = [table.column(key).to_pylist() for key in keys]
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{file}: row group {g} cannot be read ({_problem(exc)}); the file is damaged: write it again, or move "
            "it out of the inputs."
        ) from None
    del table  # the row group's Arrow buffers: only the Python values stay while its rows are used
    for offset, values in enumerate(zip(*columns)):
        where = f"{file}: row {first_row + offset} (row group {g})"
        for key, value in zip(keys, values):
            if value is None:
                raise DataError(f'{where}: "{key}" is null; {need}: drop the row or fill it.')
        yield where, values
