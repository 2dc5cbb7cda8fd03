"""Running ``--simulate`` in the test process and reading what it wrote."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from trainer.entry.simulate import simulate

CONFIGS = Path(__file__).resolve().parent.parent / "train_configs"
DOCS = Path(__file__).resolve().parent.parent / "docs"


def simulate_job(tmp_path: Path, nproc: int, *args: str, nnodes: int = 1) -> tuple[int, str, dict]:
    """The exit code, what it printed and ``simulation.json``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = simulate(["--job.dump_folder", str(tmp_path), *args], nproc, nnodes)
    text = out.getvalue()
    return code, text, json.loads(Path(text.strip().splitlines()[-1]).read_text())


def documented_row(page: str, first: str) -> list[str]:
    """The cells of the table row of ``docs/page`` whose first cell is ``first``."""
    for line in (DOCS / page).read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == first:
            return cells
    raise AssertionError(f"docs/{page} has no table row {first!r}")
