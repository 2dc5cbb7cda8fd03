"""The device check's results, written as they are measured, and its time budget.

Every row goes to ``results.jsonl`` (one JSON object a line, with the raw numbers) and the whole
table is rewritten to ``table.md`` after each row, so a run cut short by the device tool's time
limit still returns everything it measured.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HEADER = ("check", "setting", "measured", "reference", "result")


@dataclass
class Row:
    check: str
    setting: str
    measured: str
    reference: str = ""
    result: str = "-"
    """``ok``, ``FAIL`` (a measured figure outside its tolerance), ``error`` (the run failed: its
    one-line cause is in ``measured``), ``skipped`` or ``-`` (a figure with nothing to pass)."""
    figures: dict[str, Any] = field(default_factory=dict)
    """The raw numbers behind the text, for whoever compares runs."""


class Results:
    """The rows so far, mirrored to ``out`` after each one."""

    def __init__(self, out: Path, title: str) -> None:
        self.out, self.title = out, title
        self.rows: list[Row] = []
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = out / "results.jsonl"
        self.jsonl.write_text("")

    def add(self, row: Row, output: str = "") -> Row:
        """Record ``row``; a failed run's ``output`` (its last lines) goes to ``failures.log``,
        which comes back with the table: one line of cause rarely tells the whole story."""
        self.rows.append(row)
        if output:
            tail = "\n".join(output.splitlines()[-200:])
            with (self.out / "failures.log").open("a") as f:
                f.write(f"===== {row.check} | {row.setting}\n{tail}\n")
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"time": round(time.time(), 1), **asdict(row)}) + "\n")
        (self.out / "table.md").write_text(f"{self.title}\n\n{markdown(self.rows)}\n")
        print(f"gpu_check: {row.check} | {row.setting} | {row.measured} | {row.reference} | {row.result}", flush=True)
        return row

    def failed(self) -> bool:
        return any(row.result in ("FAIL", "error") for row in self.rows)


def markdown(rows: list[Row]) -> str:
    cells = [HEADER, *((r.check, r.setting, r.measured, r.reference, r.result) for r in rows)]
    lines = ["| " + " | ".join(c.replace("|", "/") for c in line) + " |" for line in cells]
    lines.insert(1, "|" + "---|" * len(HEADER))
    return "\n".join(lines)


class Deadline:
    """The check's time budget: each run gets what is left, less what the runs after it need at
    the least, so that one slow run cannot starve the rest of the table."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def allows(self, needed: float) -> bool:
        return self.left() >= needed
