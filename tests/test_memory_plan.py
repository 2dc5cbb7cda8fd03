"""The per-rank memory estimate: it follows the mesh and the settings, it is close to the measured
peak on CPU, and a job that does not fit stops before launch with the settings that would fit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from harness import ROOT, run_train

from trainer.config import ConfigError, load_config
from trainer.plan import check_memory, plan
from trainer.runtime.memory_plan import Workload, estimate, fixes

GIB = 1024**3
EIGHT_B = Workload(
    dim=4096,
    n_layers=32,
    n_heads=32,
    kv_heads=8,
    ffn_dim=14336,
    vocab_size=128256,
    local_batch_size=1,
    seq_len=8192,
    dp_shard=8,
    cp=1,
    tp=1,
    compute_bytes=2,
    device="cuda",
)


def test_the_parameter_count_is_the_models():
    assert EIGHT_B.params == 8_030_261_248  # the 8B flavor's count, tested in test_model.py
    debug = plan(load_config([]), 1)
    assert debug.workload.params == 5_770_496


def test_each_part_follows_the_setting_that_shards_it():
    base = estimate(EIGHT_B)
    assert estimate(replace(EIGHT_B, dp_shard=16)).model_state == pytest.approx(base.model_state / 2, rel=1e-6)
    assert estimate(replace(EIGHT_B, dp_shard=16)).activations == base.activations
    tp = estimate(replace(EIGHT_B, tp=2))
    assert tp.model_state == pytest.approx(base.model_state / 2, rel=1e-6)
    assert base.activations / 2 < tp.activations < base.activations  # the gathered norm outputs stay whole
    assert tp.logits < base.logits and estimate(replace(EIGHT_B, tp=2, loss_parallel=False)).logits > tp.logits
    deferred = estimate(replace(EIGHT_B, defer_gradient_reduction=True))
    assert deferred.model_state > base.model_state
    assert estimate(replace(EIGHT_B, local_batch_size=2)).activations == pytest.approx(2 * base.activations, rel=1e-6)


def test_checkpointing_keeps_less_the_more_it_recomputes():
    full = estimate(replace(EIGHT_B, ac_mode="full")).activations
    op = estimate(replace(EIGHT_B, ac_mode="selective", ac_option="op")).activations
    every_2nd = estimate(replace(EIGHT_B, ac_mode="selective", ac_option="2")).activations
    none = estimate(EIGHT_B).activations
    assert full < op < none and full < every_2nd < none


def test_suggested_changes_fit_and_the_error_names_them():
    limit = 60 * GIB
    how, changes = fixes(EIGHT_B, limit, world_size=8)
    assert how == "any" and changes
    assert any("activation_checkpoint.mode full" in c for c in changes)
    assert estimate(replace(EIGHT_B, ac_mode="full")).total <= limit < estimate(EIGHT_B).total
    batch_plan = plan(load_config(["--training.seq_len", "1024", "--training.local_batch_size", "16"]), 1)
    with pytest.raises(ConfigError, match=r"more than the test's limit \(1.00 GiB\).*local_batch_size") as error:
        check_memory(batch_plan, GIB, "the test's limit")
    suggested = int(re.search(r"local_batch_size (\d+)", str(error.value)).group(1))
    assert estimate(replace(batch_plan.workload, local_batch_size=suggested)).total <= GIB
    unchecked = plan(
        load_config(
            ["--training.seq_len", "1024", "--training.local_batch_size", "16", "--training.check_memory", "false"]
        ),
        1,
    )
    check_memory(unchecked, GIB, "the test's limit")


@pytest.mark.launcher
def test_a_job_that_does_not_fit_stops_before_launch():
    """The 8B preset on a CPU machine, named the torchtitan way (CONFIG_FILE): before this
    estimate, every rank spent minutes initialising it in silence."""
    start = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "run_train.sh")],
        env={**os.environ, "NGPU": "4", "CONFIG_FILE": "llama3_8b.toml"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "this job needs about" in proc.stderr and "params+grads+AdamW" in proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr  # no worker was started
    assert time.monotonic() - start < 30
    dry = run_train(4, ["--dry-run"])
    assert dry.returncode == 0 and "memory:" in dry.stdout and "mesh: pp=1 dp_replicate=1 dp_shard=4" in dry.stdout
    assert "[rank" not in dry.stdout + dry.stderr


MEASURED = {
    "no checkpointing": [],
}
"""More configurations (activation checkpointing, seq 2048) and meshes of several ranks:
``python benchmarks/memory.py``, whose figures are in docs/performance.md."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MEASURED))
def test_the_estimate_is_within_25_percent_of_the_measured_peak(case, tmp_path):
    """One process, two steps of two 4 x 768-token micro-batches (activations outweigh the
    runtime; the peak settles after the first few cycles of allocation), on CPU, where the
    peak is the process's maximum resident memory."""
    args = MEASURED[case] + [
        "--training.seq_len",
        "768",
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "8",
        "--training.steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard=false",
        "--job.dump_folder",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = float(re.findall(r"step: 2/2 .*?memory: ([0-9.]+)GiB", proc.stderr)[-1]) * GIB
    estimated = plan(load_config(args), 1).memory.total
    assert 0.75 < estimated / measured < 1.25, (estimated / GIB, measured / GIB)
