"""``scripts/prepare_data.py``'s progress: counters the worker processes share, and the line
that reports them (documents, tokens, tokens/s, % of bytes, ETA)."""

from __future__ import annotations

import time
from typing import Any, TextIO


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
