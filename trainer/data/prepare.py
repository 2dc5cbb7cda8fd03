"""Prepared datasets: a corpus tokenized once, by several processes, into memory-mappable shards.

Training from raw text tokenizes the whole corpus in memory at start-up: right for the bundled
plays, wrong for gigabytes. :func:`prepare` does the tokenizing ahead of time; training then
maps the shards (``trainer.data.prepared``) instead of reading them.

The corpus is cut into *units*, one shard each: a ``.txt`` or ``.jsonl.gz`` file, a
line-aligned byte range of a big ``.jsonl`` file, or a run of whole row groups of a Parquet file
(so one huge file still keeps every worker busy, and a worker holds one unit's text, not the
file's). Units follow the inputs' sorted order, and a shard's tokens depend on its unit only, so
the folder is the same whatever ``--workers`` is. Documents are framed ``[bos] + tokens +
[eos]`` from the text ``trainer.data.sources`` reads: the shards hold exactly the token stream
the in-memory ``shakespeare`` dataset packs, and give the same samples. The folder's layout
is ``trainer.data.shards``.

**Nothing good is destroyed before the new output is complete.** A unit's files are written
under temporary names and renamed, its done-record last, so an interrupted run leaves finished
units whole; shard files are named by their content (``trainer.data.shards``), so a rerun writes
beside the shards the current manifest names, never over them. The new manifest replaces the old
in one rename at the very end; only then are the files no manifest names any more removed. A
failure at any point before leaves the previous folder exactly as it was. The rerun reuses a unit
whose done-record matches its source bytes (a Parquet unit's: its row groups' and the footer's)
and tokenizer and whose shard still has the sha256 the
record says (re-hashed: sizes prove nothing), and redoes the others.

One run at a time: the folder is locked (``.meshtrain.lock``, the dump folder's lock, taken over
when its owner is gone), and worker processes die with the run, even on ``kill -9``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from trainer.data import parquet
from trainer.data.progress import Counters, Progress
from trainer.data.records import PREPARE_INPUT, parquet_records
from trainer.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SHARDS,
    build_manifest,
    done_record_of,
    done_records,
    encode_shard,
    file_sizes,
    manifest_entry,
    sha256_file,
    shard_paths,
    stream_sha256,
    token_array,
    token_dtype,
)
from trainer.data.sources import decode, file_documents, unique_files
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.runtime.dump_folder import LOCK_FILE, DumpFolderLock, describe_holder, read_lock
from trainer.runtime.errors import BusyFolderError, DataError

UNIT_BYTES = 64 << 20
"""Target size of the byte ranges a big uncompressed ``.jsonl`` file is cut into, and of the
decoded data of a Parquet file's runs of row groups."""


@dataclass(frozen=True)
class Unit:
    """Bytes ``[start, end)`` of ``source`` (a file of ``file_size`` bytes), starting at a line."""

    source: str
    start: int
    end: int
    file_size: int


def plan_units(inputs: Sequence[str], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of ``inputs`` (files or folders searched recursively, each in sorted order)."""
    units: list[Unit] = []
    for file in unique_files(inputs, PREPARE_INPUT):
        size = file.stat().st_size
        if file.name.lower().endswith(".jsonl") and size > unit_bytes:
            units.extend(Unit(str(file), start, end, size) for start, end in _line_ranges(file, size, unit_bytes))
        elif parquet.is_parquet(file):
            units.extend(Unit(str(file), start, end, size) for start, end in parquet.unit_ranges(file, unit_bytes))
        else:
            units.append(Unit(str(file), 0, size, size))
    return units


def _line_ranges(file: Path, size: int, unit_bytes: int) -> Iterable[tuple[int, int]]:
    with open(file, "rb") as fh:
        start = 0
        while start < size:
            fh.seek(min(start + unit_bytes, size))
            fh.readline()  # to the start of the next line
            end = min(fh.tell(), size)
            yield start, end
            start = end


# --------------------------------------------------------------------------------------------
# Workers: one unit in, one shard out
# --------------------------------------------------------------------------------------------


_worker: dict[str, Any] = {}
"""The process's tokenizer, counters and (in-process only) progress callback, set once."""


def _init_worker(
    tokenizer_path: str, counters: Counters, tick: Callable[[], None] | None = None, parent: int | None = None
) -> None:
    if parent is not None:
        _die_with(parent)
    _worker.update(tokenizer=load_tokenizer(tokenizer_path), counters=counters, tick=tick)


def _die_with(parent: int) -> None:
    """End this pool worker when the run that started it is gone: a run killed with ``kill -9``
    never shuts its pool down, and its workers would wait for work forever."""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG (Linux)
            raise OSError
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # died before the request took effect
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@dataclass(frozen=True)
class _Task:
    index: int
    unit: Unit
    out: str
    dtype: str


def _read_range(unit: Unit) -> bytes:
    with open(unit.source, "rb") as fh:
        fh.seek(unit.start)
        return fh.read(unit.end - unit.start)


def _reusable(out: Path, index: int, identity: dict[str, Any]) -> dict | None:
    """The done-record of a shard of unit ``index`` that an earlier run finished from the same
    source bytes and tokenizer and whose bytes still hash to what the record says, or None."""
    for record_file in done_records(out, index):
        try:
            record = json.loads(record_file.read_text())
            if record.get("identity") != identity:
                continue
            bin_file, idx_file = out / record["file"], out / record["index"]
            sizes = file_sizes(identity["dtype"], record["tokens"], record["documents"])
            if (bin_file.stat().st_size, idx_file.stat().st_size) == sizes and sha256_file(bin_file) == record[
                "sha256"
            ]:
                return record
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def _unit_documents(unit: Unit, data: bytes, sha256: str) -> list[str]:
    """The unit's documents: from ``data``, its bytes, or read from a Parquet file's row groups,
    whose bytes must still be the ones hashed (``sha256``)."""
    file = Path(unit.source)
    if parquet.is_parquet(file):
        return [text for (text,) in parquet_records(file, ("text",), PREPARE_INPUT, unit.start, unit.end, sha256)]
    text = decode(file, data)
    try:
        return file_documents(file, text, PREPARE_INPUT)
    except DataError:
        if unit.start == 0:
            raise
        # Only now count the lines before the range, to name the file's own line number.
        with open(file, "rb") as fh:
            first_line = 1 + fh.read(unit.start).count(b"\n")
        return file_documents(file, text, PREPARE_INPUT, first_line)


def _run_unit(task: _Task) -> tuple[dict[str, Any], bool]:
    """Tokenize one unit into its shard, or reuse the shard a previous run finished.

    Returns the done-record and whether it was reused.
    """
    tokenizer: Tokenizer = _worker["tokenizer"]
    counters: Counters = _worker["counters"]
    tick = _worker["tick"]
    out, unit = Path(task.out), task.unit
    in_parquet = parquet.is_parquet(Path(unit.source))
    data = b"" if in_parquet else _read_range(unit)
    identity = {
        **asdict(unit),
        "sha256": (
            parquet.identity(Path(unit.source), unit.start, unit.end)
            if in_parquet
            else hashlib.sha256(data).hexdigest()
        ),
        "tokenizer_sha256": tokenizer.sha256,
        "dtype": task.dtype,
        "format_version": FORMAT_VERSION,
    }
    record = _reusable(out, task.index, identity)
    if record is not None:
        return record, True

    documents = _unit_documents(unit, data, identity["sha256"])
    tokens = token_array(task.dtype)
    offsets = array("Q", [0])
    reported = [0, 0, 0]  # documents, tokens, bytes already added to the counters

    def report(done: int) -> None:
        size = unit.end - unit.start
        nbytes = size * done // len(documents) if documents else size
        counters.add(done - reported[0], len(tokens) - reported[1], nbytes - reported[2])
        reported[:] = [done, len(tokens), nbytes]
        if tick is not None:
            tick()

    last = time.monotonic()
    for done, document in enumerate(documents, start=1):
        ids = tokenizer.encode(document, bos=True, eos=True)
        try:
            tokens.fromlist(ids)
        except OverflowError:
            raise DataError(
                f"{tokenizer.path} produced the id {max(ids)}, beyond its vocabulary of {tokenizer.vocab_size} "
                f"({task.dtype} shards); the tokenizer file is inconsistent: use another --tokenizer."
            ) from None
        offsets.append(len(tokens))
        if time.monotonic() - last > 0.25:
            report(done)
            last = time.monotonic()
    report(len(documents))

    max_token_id = max(tokens) if tokens else -1
    token_bytes, offset_bytes = encode_shard(tokens, offsets, task.dtype)
    digest = hashlib.sha256(token_bytes).hexdigest()
    bin_file, idx_file, record_file = shard_paths(out, task.index, digest)
    _write_atomic(bin_file, token_bytes)
    _write_atomic(idx_file, offset_bytes)
    record = {
        "identity": identity,
        "file": bin_file.relative_to(out).as_posix(),
        "index": idx_file.relative_to(out).as_posix(),
        "tokens": len(tokens),
        "documents": len(documents),
        "sha256": digest,
        "max_token_id": max_token_id,
    }
    _write_atomic(record_file, json.dumps(record, indent=1).encode())
    return record, False


def _write_atomic(file: Path, data: bytes) -> None:
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, file)
    except OSError as exc:
        raise DataError(
            f"{file}: cannot be written ({exc.strerror or exc}); free space or give another --out. What --out held "
            "before this run is intact."
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# The run: units to workers, progress, manifest
# --------------------------------------------------------------------------------------------


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; give a folder (new, empty or prepared before).")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (MANIFEST, SHARDS, LOCK_FILE))
        if foreign:
            raise DataError(
                f"--out {str(out)!r} holds other things ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
                "prepare_data writes into a new or empty folder, or one it prepared before: choose another --out."
            )


class BusyOutError(BusyFolderError):
    """``--out`` is being written by another prepare_data run."""

    label = "busy --out folder"


def _lock(out: Path) -> DumpFolderLock:
    """Hold ``out`` for this run: two runs writing one folder would tear each other's files."""
    lock = DumpFolderLock(out)
    try:
        lock.acquire()
    except BusyFolderError:
        found = read_lock(out)
        holder = describe_holder(*found) if found else "another run"
        raise BusyOutError(
            f"--out {str(out)!r} is being prepared by another prepare_data run: {holder}. Wait for it or stop it, "
            f"or give another --out. A lock left by a run that died ({out / LOCK_FILE}) is taken over automatically."
        ) from None
    return lock


def prepare(
    inputs: Sequence[str],
    tokenizer_path: str,
    out: str,
    workers: int = 1,
    unit_bytes: int = UNIT_BYTES,
    progress: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into the prepared folder ``out`` with ``workers`` processes; return the
    manifest. Rerunning after an interruption redoes only the units not finished (or changed)."""
    if workers < 1:
        raise DataError(f"--workers = {workers}: at least one worker is needed; give --workers 1 or more.")
    if unit_bytes < 1:
        raise DataError(f"--unit-mb = {unit_bytes >> 20}: units need at least 1 MB; give --unit-mb 1 or more.")
    if not inputs:
        raise DataError("no inputs: name .txt, .jsonl, .jsonl.gz or .parquet files, or folders of them.")
    tokenizer = load_tokenizer(tokenizer_path)
    out_dir = Path(out)
    _check_out(out_dir)
    units = plan_units(inputs, unit_bytes)
    dtype = token_dtype(tokenizer.vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock(out_dir)
    try:
        (out_dir / SHARDS).mkdir(exist_ok=True)
        records, reused = _run_units(out_dir, units, tokenizer_path, dtype, workers, progress)
        entries = [manifest_entry(record) for record in records]
        manifest = _manifest(tokenizer, dtype, units, entries, stream_sha256(out_dir, entries))
        if manifest["total_tokens"] == 0:
            raise DataError(
                f"{', '.join(inputs)}: no documents (blank .txt files, .jsonl files without lines, Parquet files "
                "without rows); nothing to prepare: name files that hold text."
            )
        _write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
        _remove_unnamed(out_dir, entries)
    finally:
        lock.release()
    return {**manifest, "reused_units": reused}  # how this run went; not part of the data's identity


def _run_units(
    out: Path, units: list[Unit], tokenizer_path: str, dtype: str, workers: int, progress: TextIO | None
) -> tuple[list[dict[str, Any]], int]:
    """Every unit's done-record, in order, and how many were reused."""
    # fork: workers need no re-import of the caller's main module (a script, a notebook, stdin).
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counters = Counters(context)
    meter = Progress(counters, sum(u.end - u.start for u in units), progress)
    tasks = [_Task(i, unit, str(out), dtype) for i, unit in enumerate(units)]
    records: list[dict[str, Any]] = [{}] * len(tasks)
    reused = 0

    def collect(task: _Task, record: dict[str, Any], was_reused: bool) -> None:
        nonlocal reused
        records[task.index] = record
        if was_reused:
            reused += 1
            meter.reused_bytes += task.unit.end - task.unit.start

    if workers == 1:
        _init_worker(tokenizer_path, counters, meter.tick)
        for task in tasks:
            collect(task, *_run_unit(task))
            meter.tick()
    else:
        init_args = (tokenizer_path, counters, None, os.getpid())
        with ProcessPoolExecutor(workers, context, _init_worker, init_args) as pool:
            pending = {pool.submit(_run_unit, task): task for task in tasks}
            try:
                while pending:
                    finished, _ = wait(pending, timeout=meter.interval, return_when=FIRST_COMPLETED)
                    for future in finished:
                        collect(pending.pop(future), *future.result())
                    meter.tick()
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
    meter.finish()
    return records, reused


def _remove_unnamed(out: Path, entries: list[dict[str, Any]]) -> None:
    """Remove the shard files the new manifest does not name (the previous run's, superseded)."""
    named = {name for entry in entries for name in (entry["file"], entry["index"])}
    named |= {done_record_of(Path(entry["file"])).as_posix() for entry in entries}
    for file in (out / SHARDS).iterdir():
        if f"{SHARDS}/{file.name}" not in named and file.is_file():
            file.unlink(missing_ok=True)


def _manifest(
    tokenizer: Tokenizer, dtype: str, units: list[Unit], entries: list[dict[str, Any]], stream: str
) -> dict[str, Any]:
    sources: dict[str, int] = {}
    for unit in units:
        sources.setdefault(unit.source, unit.file_size)
    return build_manifest(tokenizer, dtype, sources, entries, stream)


def write_manifest(out: Path, tokenizer: Tokenizer, dtype: str, shards: list[dict[str, Any]]) -> None:
    """A manifest (and the done-records) for shards written by other means (``benchmarks/data.py``
    synthesises them)."""
    identity = {"source": "", "start": 0, "end": 0, "sha256": ""}
    records = [{**shard, "identity": identity} for shard in shards]
    for record in records:
        _write_atomic(out / done_record_of(Path(record["file"])), json.dumps(record, indent=1).encode())
    entries = [manifest_entry(record) for record in records]
    _write_atomic(
        out / MANIFEST,
        json.dumps(_manifest(tokenizer, dtype, [], entries, stream_sha256(out, entries)), indent=1).encode(),
    )
