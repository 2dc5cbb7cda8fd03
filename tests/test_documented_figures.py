"""The figures the docs quote from ``--simulate`` stay what this code gives: a change of the
simulator or of the estimate that moves one fails here until the page is updated with it.

docs/scale.md's preset table is kept true by ``test_simulation.py``'s preset test (which runs
those simulations anyway); docs/float8.md's Llama 3 8B table and its cast traffic here."""

from __future__ import annotations

import re

import pytest
from simulation_helpers import CONFIGS, DOCS, documented_row, simulate_job

pytest.importorskip("torchao.float8", reason="float8 training needs torchao (the `float8` extra)")

ROWWISE = ["--model.converters", "float8", "--float8.recipe_name", "rowwise"]
TENSORWISE = ["--model.converters", "float8", "--float8.recipe_name", "tensorwise"]
COMPILED = ["--compile.enable"]
ROWS = {  # docs/float8.md's first cell: (the variant's arguments, the bf16 row it is compared with)
    "bf16, eager": ([], None),
    "float8 rowwise, eager": (ROWWISE, "bf16, eager"),
    "bf16, `--compile.enable`": (COMPILED, None),
    "float8 rowwise, `--compile.enable`": ([*COMPILED, *ROWWISE], "bf16, `--compile.enable`"),
    "float8 tensorwise, `--compile.enable`": ([*COMPILED, *TENSORWISE], "bf16, `--compile.enable`"),
}


@pytest.mark.slow
def test_the_8b_float8_table_is_what_the_simulator_says(tmp_path):
    """``./run_train.sh --config llama3_8b.toml --simulate`` with and without float8, eager and
    compiled, both recipes compiled (about 25 s each on 2 cores)."""
    roles = {}
    for label, (extra, _) in ROWS.items():
        args = ["--config", str(CONFIGS / "llama3_8b.toml"), "--target-gpu", "h100", *extra]
        code, text, report = simulate_job(tmp_path / str(len(roles)), 8, *args)
        assert code == 0, text
        (roles[label],) = report["roles"]
    for label, (_, base) in ROWS.items():
        role = roles[label]
        ratio = f" ({role['tokens_per_s_per_gpu'] / roles[base]['tokens_per_s_per_gpu']:.2f}x)" if base else ""
        found = [
            f"{role['compute_s']:.3f} s",
            f"{role['memory_bound_s']:.3f} s",
            f"{role['step_time_s']:.3f} s",
            f"{role['tokens_per_s_per_gpu']:,.0f}{ratio}",
            f"{role['peak_bytes'] / 2**30:.2f} GiB",
        ]
        assert documented_row("float8.md", label)[1:] == found, label
    prose = " ".join((DOCS / "float8.md").read_text().split())
    per_token = {label: round(role["memory_traffic_bytes_per_token"] / 1e6) for label, role in roles.items()}
    eager = f"eager, from {per_token['bf16, eager']} to {per_token['float8 rowwise, eager']} MB a token"
    compiled = (
        f"compiled, from {per_token['bf16, `--compile.enable`']} to "
        f"{per_token['float8 rowwise, `--compile.enable`']} MB a token with rowwise scales and "
        f"{per_token['float8 tensorwise, `--compile.enable`']} with tensorwise"
    )
    assert eager in prose and compiled in prose, (eager, compiled, re.findall(r"from \d+ to \d+ MB a token", prose))
