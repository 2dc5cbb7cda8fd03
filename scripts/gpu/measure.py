"""The device check's measurements: jobs launched through ``./run_train.sh`` as a user launches
them, read back from their TensorBoard scalars, and the simulator's prediction of the same job.

A run that fails or runs out of time gives its one-line cause instead of figures, and the check
goes on with the next one.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 3
"""Steps left out of the throughput figures (allocation, autotuning, compilation)."""
LOSS = "loss_metrics/global_avg_loss"
GIB = 2**30
CALIBRATION_ENV = "MESHTRAIN_CALIBRATION"
"""``trainer/simulation/calibration.py``'s: a calibration file that stands for the stored one."""


@dataclass
class Run:
    """One launch of ``./run_train.sh``."""

    seconds: float
    cause: str = ""
    """Why it failed, in one line; empty when it exited 0."""
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    output: str = ""

    @property
    def ok(self) -> bool:
        return not self.cause


def environment(cpu: bool) -> dict[str, str]:
    """The job's environment: one process, rank 0's log, this interpreter (and its packages)."""
    env = {**os.environ, "NGPU": "1", "LOG_RANK": "0", "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    return env


def start(dump: Path, args: list[str], cpu: bool) -> tuple[subprocess.Popen[str], float]:
    """Start a training job (see :func:`launched`)."""
    command = [
        str(REPO_ROOT / "run_train.sh"),
        *args,
        "--job.dump_folder",
        str(dump),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "--validation.enable=false",
    ]
    return launched(command, cpu)


def launched(command: list[str], cpu: bool, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], float]:
    """``command`` started in a process group of its own (so that a timeout ends all of it), its
    output collected; the process and when it started."""
    proc = subprocess.Popen(
        command,
        env={**environment(cpu), **(env or {})},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, time.monotonic()


def finish(proc: subprocess.Popen[str], started: float, dump: Path, timeout: float) -> Run:
    """Wait for a started job; its scalars, or its one-line cause."""
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        stop(proc)
        output, _ = proc.communicate()
        return Run(time.monotonic() - started, f"did not finish in the {timeout:.0f} s left to it", output=output)
    seconds = time.monotonic() - started
    if proc.returncode:
        return Run(seconds, f"exit {proc.returncode}: {cause(output)}", output=output)
    try:
        return Run(seconds, scalars=scalars(dump), output=output)
    except (OSError, ValueError, KeyError) as e:
        return Run(seconds, f"no TensorBoard scalars: {e}", output=output)


def train(dump: Path, args: list[str], timeout: float, cpu: bool = False) -> Run:
    proc, started = start(dump, args, cpu)
    return finish(proc, started, dump, timeout)


def stop(proc: subprocess.Popen[str]) -> None:
    """End a job's whole process group: the launcher, torchrun and the workers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def cause(output: str) -> str:
    """The line that says why a job failed: meshtrain's own one-line error, else the last line of
    the last traceback, else the last line printed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("meshtrain:"):
            return line[:300]
    for line in reversed(lines):
        bare = line.split("]:", 1)[-1].strip()  # torchrun prefixes a rank's lines with [rankN]:
        kind = bare.split(":", 1)[0]
        if bare[:1].isalpha() and ("Error" in kind or "Exception" in kind) and "ChildFailedError" not in kind:
            return bare[:300]
    return lines[-1][:300] if lines else "no output"


def scalars(dump: Path) -> dict[str, dict[int, float]]:
    """The newest TensorBoard run in ``dump``: ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((d for d in (dump / "tb").iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise ValueError(f"{dump / 'tb'} is empty")
    events = EventAccumulator(str(runs[-1]))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def throughput(run: Run) -> dict[str, float]:
    """Tokens/s, MFU and step time averaged after the warm-up steps; the allocator's peaks."""
    s = run.scalars
    steps = sorted(s["throughput(tps)"])
    kept = [step for step in steps if step > WARMUP_STEPS] or steps
    figures = {
        "tokens_per_s": statistics.mean(s["throughput(tps)"][k] for k in kept),
        "step_s": statistics.median(s["time_metrics/end_to_end(s)"][k] for k in kept),
        "peak_active_gib": max(s["memory/max_active(GiB)"].values()),
        "steps_measured": len(kept),
    }
    if "memory/max_reserved(GiB)" in s:
        figures["peak_reserved_gib"] = max(s["memory/max_reserved(GiB)"].values())
    if "mfu(%)" in s:
        figures["mfu_pct"] = statistics.mean(s["mfu(%)"][k] for k in kept)
    return figures


def compiled_graphs(output: str) -> str:
    """The start report's compile line (``trainer/metrics/reports.py``) without its reasons: how
    many graphs and graph breaks compile made of the first step; empty for an eager run."""
    lines = [line.split("compile: ", 1)[1] for line in output.splitlines() if "INFO compile: " in line]
    return lines[-1].split(":", 1)[0].replace(" traced in the first step", "") if lines else ""


def step_kernels(dump: Path, output: str, top: int = 8) -> dict[str, object]:
    """A profiled run's traced step (``--profiling.enable_profiling``): its top kernels by device
    time (ms; the CPU's top-level ops when no kernel ran) and the total, and the start report's
    MoE time split (``trainer/metrics/reports.py``), as the log printed it."""
    traces = sorted((dump / "profile_traces").glob("iteration_*/rank0_trace.json"))
    if not traces:
        raise ValueError(f"no profiler trace in {dump / 'profile_traces'}")
    events = json.loads(traces[-1].read_text())["traceEvents"]
    kind = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    totals: dict[str, float] = {}
    for e in events:
        if e.get("cat") == kind:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
    split = [line.split("MoE time split", 1)[1] for line in output.splitlines() if "MoE time split" in line]
    return {
        "trace": traces[-1].parent.name,
        "kind": kind,
        "total_ms": sum(totals.values()),
        "top_ms": largest(totals, top),
        "top_ops_ms": kernels_by_op(events, top),
        "moe_split": split[-1].strip(" ,:") if split else "not in the log",
    }


def kernels_by_op(events: list[dict[str, Any]], top: int) -> dict[str, float]:
    """Kernel ms by the ATen op that launched them, the ``top`` largest: the rows ``--simulate``
    prints by op, on the GPU (a kernel names no op; its launch's ``External id`` is the innermost
    op's). Empty where no kernel ran."""
    ops = {
        e["args"]["External id"]: e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    launched = {
        e["args"]["correlation"]: e["args"].get("External id")
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    totals: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            op = ops.get(args.get("External id") or launched.get(args.get("correlation")), "(no ATen op)")
            totals[op] = totals.get(op, 0.0) + e.get("dur", 0) / 1e3
    return largest(totals, top)


def largest(totals: dict[str, float], top: int) -> dict[str, float]:
    """The ``top`` largest of ``totals``, largest first."""
    return dict(sorted(totals.items(), key=lambda item: -item[1])[:top])


def start_simulation(
    dump: Path, args: list[str], target: str, calibration: Path | None = None
) -> tuple[subprocess.Popen[str], float]:
    """``--simulate`` the same one-GPU job for ``target``, on the CPU, beside the GPU runs; with
    the ``calibration`` file the probes wrote, when given, instead of the stored one."""
    command = [str(REPO_ROOT / "run_train.sh"), *args, "--job.dump_folder", str(dump), "--simulate"]
    command += ["--target-gpu", target]
    return launched(command, cpu=True, env={CALIBRATION_ENV: str(calibration)} if calibration else {})


def simulation(proc: subprocess.Popen[str], started: float, dump: Path, timeout: float) -> dict[str, Any] | str:
    """The simulator's predicted peak (GiB, its tensors alone), step time and tokens/s, or its
    one-line cause."""
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        stop(proc)
        return f"the simulation did not finish in the {timeout:.0f} s left to it"
    report = dump / "simulation.json"
    if not report.exists():
        return f"the simulation failed (exit {proc.returncode}): {cause(output)}"
    whole = json.loads(report.read_text())
    role = whole["roles"][0]
    return {
        "calibration": whole.get("calibration", ""),
        "predicted_peak_gib": role["peak_bytes"] / GIB,
        "predicted_step_s": role["step_time_s"],
        "predicted_tokens_per_s": role["tokens_per_s_per_gpu"],
        "predicted_mfu": role.get("mfu", float("nan")),
        "simulation_s": time.monotonic() - started,
    }
