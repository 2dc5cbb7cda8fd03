"""Prepared datasets: a corpus tokenized once, by several processes, into memory-mappable shards.

Training from raw text tokenizes the whole corpus in memory at start-up: right for the bundled
plays, wrong for gigabytes. :func:`prepare` does the tokenizing ahead of time; training then
maps the shards (``trainer.data.prepared``) instead of reading them.

The corpus is cut into *units*, one shard each: a ``.txt`` or ``.jsonl.gz`` file, or a
line-aligned byte range of a big ``.jsonl`` file (so one huge file still keeps every worker
busy). Units follow the inputs' sorted order, and a shard's tokens depend on its unit only, so
the folder is the same whatever ``--workers`` is. Documents are framed ``[bos] + tokens +
[eos]`` from the text ``trainer.data.sources`` reads: the shards hold exactly the token stream
the in-memory ``shakespeare`` dataset packs, and give the same samples. The folder's layout
is ``trainer.data.shards``.

A unit's files are written under temporary names and renamed, its done-record last, so an
interrupted run leaves finished units whole; the rerun reuses a unit whose done-record matches
its source bytes (re-hashed) and tokenizer, and redoes the others.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from trainer.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SHARDS,
    build_manifest,
    encode_shard,
    file_sizes,
    manifest_entry,
    shard_paths,
    token_array,
    token_dtype,
)
from trainer.data.sources import decode, file_documents, local_files
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.runtime.errors import DataError

UNIT_BYTES = 64 << 20
"""Target size of the byte ranges a big uncompressed ``.jsonl`` file is cut into."""
KIND = "shakespeare"
"""The packed dataset kind whose documents the shards hold (named in sources' error messages)."""


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
    for path in inputs:
        for file in local_files(path, key="input"):
            size = file.stat().st_size
            if file.name.lower().endswith(".jsonl") and size > unit_bytes:
                units.extend(Unit(str(file), start, end, size) for start, end in _line_ranges(file, size, unit_bytes))
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


class Counters:
    """Documents, tokens and source bytes tokenized so far, shared by the worker processes."""

    def __init__(self, context: Any) -> None:
        self.documents = context.Value("q", 0)
        self.tokens = context.Value("q", 0)
        self.bytes = context.Value("q", 0)

    def add(self, documents: int, tokens: int, nbytes: int) -> None:
        for value, amount in ((self.documents, documents), (self.tokens, tokens), (self.bytes, nbytes)):
            with value.get_lock():
                value.value += amount


_worker: dict[str, Any] = {}
"""The process's tokenizer, counters and (in-process only) progress callback, set once."""


def _init_worker(tokenizer_path: str, counters: Counters, tick: Callable[[], None] | None = None) -> None:
    _worker.update(tokenizer=load_tokenizer(tokenizer_path), counters=counters, tick=tick)


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


def _reusable(record_file: Path, bin_file: Path, idx_file: Path, identity: dict[str, Any]) -> dict | None:
    try:
        record = json.loads(record_file.read_text())
        sizes = file_sizes(identity["dtype"], record["tokens"], record["documents"])
        sizes_ok = (bin_file.stat().st_size, idx_file.stat().st_size) == sizes
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if sizes_ok and record.get("identity") == identity else None


def _unit_documents(unit: Unit, data: bytes) -> list[str]:
    file = Path(unit.source)
    text = decode(file, data)
    try:
        return file_documents(file, text, KIND)
    except DataError:
        if unit.start == 0:
            raise
        # Only now count the lines before the range, to name the file's own line number.
        with open(file, "rb") as fh:
            first_line = 1 + fh.read(unit.start).count(b"\n")
        return file_documents(file, text, KIND, first_line)


def _run_unit(task: _Task) -> tuple[dict[str, Any], bool]:
    """Tokenize one unit into its shard, or reuse the shard a previous run finished.

    Returns the done-record and whether it was reused.
    """
    tokenizer: Tokenizer = _worker["tokenizer"]
    counters: Counters = _worker["counters"]
    tick = _worker["tick"]
    out, unit = Path(task.out), task.unit
    bin_file, idx_file, record_file = shard_paths(out, task.index)
    data = _read_range(unit)
    identity = {
        **asdict(unit),
        "sha256": hashlib.sha256(data).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256,
        "dtype": task.dtype,
        "format_version": FORMAT_VERSION,
    }
    record = _reusable(record_file, bin_file, idx_file, identity)
    if record is not None:
        return record, True
    record_file.unlink(missing_ok=True)

    documents = _unit_documents(unit, data)
    tokens = token_array(task.dtype)
    offsets = array("Q", [0])
    reported = [0, 0, 0]  # documents, tokens, bytes already added to the counters

    def report(done: int) -> None:
        nbytes = len(data) * done // len(documents) if documents else len(data)
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
    _write_atomic(bin_file, token_bytes)
    _write_atomic(idx_file, offset_bytes)
    record = {
        "identity": identity,
        "file": str(bin_file.relative_to(out)),
        "index": str(idx_file.relative_to(out)),
        "tokens": len(tokens),
        "documents": len(documents),
        "sha256": hashlib.sha256(token_bytes).hexdigest(),
        "max_token_id": max_token_id,
    }
    _write_atomic(record_file, json.dumps(record, indent=1).encode())
    return record, False


def _write_atomic(file: Path, data: bytes) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)


# --------------------------------------------------------------------------------------------
# The run: units to workers, progress, manifest
# --------------------------------------------------------------------------------------------


class Progress:
    """``documents, tokens, tokens/s, % of bytes, ETA`` on one line, at most every ``interval`` s.

    A terminal gets the line rewritten in place; a log file gets one line per refresh. Units
    reused from an earlier run count as done but not toward the rate.
    """

    def __init__(self, counters: Counters, total_bytes: int, stream: TextIO | None, interval: float = 1.0) -> None:
        self.counters, self.total_bytes, self.stream, self.interval = counters, total_bytes, stream, interval
        self.start = self.last = time.monotonic()
        self.reused_bytes = 0
        self.tty = bool(stream is not None and stream.isatty())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        new_bytes = self.counters.bytes.value
        done = new_bytes + self.reused_bytes
        rate = self.counters.tokens.value / elapsed
        remaining = max(self.total_bytes - done, 0)
        eta = elapsed * remaining / new_bytes if new_bytes else float("nan")
        percent = 100 * done / self.total_bytes if self.total_bytes else 100.0
        eta_text = _duration(eta) if eta == eta else "?"
        return (
            f"prepare_data: {self.counters.documents.value:,} documents, {self.counters.tokens.value:,} tokens, "
            f"{rate:,.0f} tokens/s, {percent:.1f}% of {self.total_bytes / 1e6:,.1f} MB, ETA {eta_text}"
        )

    def tick(self, force: bool = False) -> None:
        if self.stream is None or (not force and time.monotonic() - self.last < self.interval):
            return
        self.last = time.monotonic()
        self.stream.write(("\r" + self.line() + "\x1b[K") if self.tty else self.line() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self.tick(force=True)
        if self.stream is not None and self.tty:
            self.stream.write("\n")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; give a folder (new, empty or prepared before).")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (MANIFEST, SHARDS))
        if foreign:
            raise DataError(
                f"--out {str(out)!r} holds other things ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
                "prepare_data writes into a new or empty folder, or one it prepared before: choose another --out."
            )


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
    if not inputs:
        raise DataError("no inputs: name .txt, .jsonl or .jsonl.gz files, or folders of them.")
    tokenizer = load_tokenizer(tokenizer_path)
    out_dir = Path(out)
    _check_out(out_dir)
    units = plan_units(inputs, unit_bytes)
    dtype = token_dtype(tokenizer.vocab_size)
    (out_dir / SHARDS).mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the folder is incomplete until the manifest is back
    for stale in (out_dir / SHARDS).iterdir():
        if not stale.stem.isdigit() or int(stale.stem) >= len(units):
            stale.unlink()

    # fork: workers need no re-import of the caller's main module (a script, a notebook, stdin).
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counters = Counters(context)
    meter = Progress(counters, sum(u.end - u.start for u in units), progress)
    tasks = [_Task(i, unit, str(out_dir), dtype) for i, unit in enumerate(units)]
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
        with ProcessPoolExecutor(workers, context, _init_worker, (tokenizer_path, counters)) as pool:
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

    manifest = _manifest(tokenizer, dtype, units, records)
    manifest["reused_units"] = reused  # how this run went; not part of the data's identity
    if manifest["total_tokens"] == 0:
        raise DataError(
            f"{', '.join(inputs)}: no documents (blank .txt files and .jsonl files without lines); nothing to prepare: name files that hold text."
        )
    _write_atomic(
        out_dir / MANIFEST, json.dumps({k: v for k, v in manifest.items() if k != "reused_units"}, indent=1).encode()
    )
    return manifest


def _manifest(tokenizer: Tokenizer, dtype: str, units: list[Unit], records: list[dict]) -> dict[str, Any]:
    sources: dict[str, int] = {}
    for unit in units:
        sources.setdefault(unit.source, unit.file_size)
    return build_manifest(tokenizer, dtype, sources, [manifest_entry(record) for record in records])


def write_manifest(out: Path, tokenizer: Tokenizer, dtype: str, shards: list[dict[str, Any]]) -> None:
    """A manifest for shards written by other means (``benchmarks/data.py`` synthesises them)."""
    records = [{**shard, "identity": {"source": "", "start": 0, "end": 0, "sha256": ""}} for shard in shards]
    manifest = _manifest(tokenizer, dtype, [], records)
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
