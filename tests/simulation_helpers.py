"""Running ``--simulate`` in the test process and reading what it wrote."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from trainer.entry.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "train_configs"
DOCS = ROOT / "docs"
DOCUMENTED_TORCH = "2.13.0"
"""The torch the docs' simulated figures were made with: CI's pin (``.ci/run``). The simulator
traces torch's own ops, and another torch's differ (2.15's first pipeline stage of the 405B holds
0.6 GiB less at its peak)."""


def documented_torch() -> bool:
    """Whether this torch is the one the documented figures were simulated with."""
    return torch.__version__.split("+")[0] == DOCUMENTED_TORCH


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
