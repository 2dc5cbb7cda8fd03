"""The device check: what one lent GPU tells the project in 7 minutes, from one command.

    python3 scripts/gpu/check.py --out "$OUT"     # on the lent machine (docs/gpu.md, the runbook)
    python scripts/gpu/check.py                   # anywhere: the CPU half, then exit 2 without CUDA
    python scripts/gpu/check.py --rehearse        # the GPU half's every step on the CPU, tiny shapes

It installs the wheels the machine lacks (``scripts/gpu/wheels.py``), then measures, in this order
of value, each row written as soon as it is measured (``results.jsonl`` and ``table.md`` in
``--out``), so a run cut short keeps what it measured:

0. **The kernel probes** that calibrate the simulator (``calibrate.py``): dense matmuls by shape
   class, attention, the experts' grouped matmul, a copy, the eager kernels that cast each element,
   RMSNorm; written to ``calibration/<target>.json``
   in ``--out`` (commit it to ``trainer/simulation/calibrations/``) and read by this check's simulations.
1. **The loss curve, like against like**: the debug model in bf16 against fp32, both on the GPU
   (every step within :data:`LOSS_TOLERANCE`), and fp32 on the GPU against fp32 on the CPU from
   the same seed (step 1 within :data:`DEVICE_TOLERANCE`: the same weights and data, so float32
   round-off alone).
2. **The Qwen3-30B-A3B shape at fewer layers** (as many as the memory estimate fits), at the
   preset's per-GPU work for each balancing scope, eager and compiled: tokens/s, MFU, the peak,
   which expert kernels ran; beside each, the simulator's prediction of the same job, and the
   ratio (simulations run on the CPU while the GPU trains); the step's top kernels.
3. **The 1B preset and the 8B shape at fewer layers**, eager: the same figures.
4. **The attention kernel** SDPA runs in bf16, causal and document-masked.
5. **A 3-step resume** from a checkpoint on the GPU, against the uninterrupted run.
6. **The dense models compiled** with selective AC, the 8B shape unchunked, then the float8 rows,
   as far as the budget goes (``scripts/gpu/jobs.py`` orders the jobs; ``--only TEXT``, on a warm
   machine, runs those whose setting contains TEXT, with nothing else).

A failed run is a row with its one-line cause, and the check goes on. Exit 0 when every row passed,
1 when one failed, 2 without CUDA (after the CPU half: the environment, the wheels, a prediction).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import calibrate
import measure
import wheels
from jobs import FIRST_JOBS, REHEARSAL, Job, Shape, throughput_jobs
from probes import attention_kernels, expert_kernels, initial_weights, release_memory
from report import Deadline, Results, Row

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from trainer.hardware import GPUS  # noqa: E402

BUDGET_S = 420.0
LOSS_TOLERANCE = 0.03
"""Largest relative difference between the bf16 and the fp32 loss of the same step on the same
GPU: bf16 rounds activations to 8 bits of mantissa (measured on an H200: 1.3% at worst over 60
steps); a wrong kernel, mask or reduction moves the curve by far more."""
DEVICE_TOLERANCE = 1e-4
"""Largest relative difference between the fp32 step-1 losses of the GPU and the CPU: the same
weights and tokens, so only the order of float32 sums differs (about 1e-7 per addition, some
1e-6 over the debug model's products and its 16,384 tokens); different initial weights, the
failure this row exists for, moved step 1 by 1% (8.1750 against 8.0976)."""
CPU_STEPS = 10
"""Steps of the fp32 CPU run: step 1 is the test, the next steps show how round-off grows."""
RESUME_TOLERANCE = 1e-3
BF16_ROW = "debug model bf16 vs fp32"
DEVICE_ROW = "debug model GPU vs CPU"
PEAK_TFLOPS = {name: gpu.bf16_flops / 1e12 for name, gpu in GPUS.items()}
FP8_PEAK_TFLOPS = {name: gpu.fp8_flops / 1e12 for name, gpu in GPUS.items() if gpu.fp8_flops}
SIMULATOR_TARGETS = {"H100": "h100", "H200": "h200", "A100": "a100", "B200": "b200"}
"""GPU name fragment -> ``--target-gpu`` name; a CPU-only machine plans for an H100."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "gpu_check", help="where the rows go")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--rehearse", action="store_true", help="every GPU step on the CPU, at tiny shapes")
    parser.add_argument("--jobs", type=int, default=None, help="run only the first N throughput jobs")
    parser.add_argument("--only", default=None, help="only the throughput jobs whose setting contains this text")
    args = parser.parse_args(argv)
    deadline = Deadline(args.budget)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch_name:
        scratch = Path(scratch_name)
        try:
            installed = wheels.install(scratch / "site")
        except (RuntimeError, OSError) as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
        import torch

        cuda = torch.cuda.is_available()
        device = torch.cuda.get_device_name(0) if cuda else "no CUDA GPU"
        title = f"gpu_check on {device}, torch {torch.__version__}, Python {platform.python_version()}"
        results = Results(args.out, title + (" (rehearsal on the CPU)" if args.rehearse else ""))
        results.add(Row("environment", "wheels", installed, f"{sys.executable}", "ok"))
        shape = REHEARSAL if args.rehearse else Shape()
        target = next((t for fragment, t in SIMULATOR_TARGETS.items() if fragment in device.upper()), "h100")
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * 10**9
        check = Check(results, deadline, scratch, shape, target, memory, args.jobs, args.only)
        if not (cuda or args.rehearse):
            check.simulations(check.throughput_jobs()[:1])
            check.run_throughput([])  # the predictions alone
            print("gpu_check: the GPU half needs CUDA, and no CUDA GPU is visible here; run it on the lent machine.")
            return 2
        check.run_all()
        print(f"gpu_check: {len(results.rows)} rows in {args.out / 'table.md'}")
        return 1 if results.failed() else 0


class Check:
    def __init__(
        self,
        results: Results,
        deadline: Deadline,
        scratch: Path,
        shape: Shape,
        target: str,
        memory: int,
        jobs: int | None = None,
        only: str | None = None,
    ):
        self.results, self.deadline, self.scratch, self.shape = results, deadline, scratch, shape
        self.target, self.memory, self.jobs, self.only = target, memory, jobs, only
        self.pending: dict[str, tuple] = {}
        self.calibration: Path | None = None
        """The probes' calibration file, which the simulations read; None: the stored one."""

    def calibrate(self) -> None:
        """The kernel probes, first: they take seconds, and the simulations wait for them."""
        try:
            figures = calibrate.calibrate(self.shape.cpu, self.device_name(), self.target)
        except Exception as e:  # a failed probe is a row; the simulations use the stored calibration
            self.results.add(Row("calibration probes", self.target, f"{type(e).__name__}: {e}"[:300], "", "error"))
            return
        self.calibration = calibrate.write(figures, self.results.out / "calibration")
        peak = 1e12 * PEAK_TFLOPS.get(self.target, float("nan"))
        fp8_peak = 1e12 * FP8_PEAK_TFLOPS.get(self.target, float("nan"))
        file = str(self.calibration.relative_to(self.results.out))
        for check, setting, measured, reference, probe in calibrate.probe_rows(figures, peak, fp8_peak, file):
            self.results.add(Row(check, setting, measured, reference, "-", probe))

    def device_name(self) -> str:
        import torch

        return "CPU (rehearsal)" if self.shape.cpu else torch.cuda.get_device_name(0)

    def run_all(self) -> None:
        jobs = self.throughput_jobs()
        if self.only is not None:  # a later call, on a warm machine: the rows an earlier one skipped
            self.simulations(jobs)
            return self.run_throughput(jobs)
        self.calibrate()
        self.simulations(jobs)
        self.loss_curve()
        for job in jobs[:FIRST_JOBS]:
            self.throughput(job)
        self.kernel_probes()
        self.resume()
        self.run_throughput(jobs[FIRST_JOBS:])

    def throughput_jobs(self) -> list[Job]:
        return [j for j in throughput_jobs(self.shape, self.memory)[: self.jobs] if (self.only or "") in j.note]

    def run_throughput(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.throughput(job)
        for name in list(self.pending):
            self.predicted_only(name)

    def simulations(self, jobs: list[Job]) -> None:
        """Start the simulator on each job, on the CPU, while the GPU trains."""
        for index, job in enumerate(jobs):
            dump, args = self.scratch / f"simulation-{index}", [*job.args, *job.simulation]
            started = measure.start_simulation(dump, args, self.target, self.calibration)
            self.pending[key(job)] = (*started, dump, job)

    def prediction(self, name: str) -> dict[str, float] | str:
        proc, started, dump, _ = self.pending.pop(name)
        return measure.simulation(proc, started, dump, self.deadline.left())

    def predicted_only(self, name: str) -> None:
        job = self.pending[name][3]
        predicted = self.prediction(name)
        if isinstance(predicted, str):
            self.results.add(Row(f"simulator {job.name}", job.note, predicted, "", "error"))
            return
        self.results.add(
            Row(
                f"simulator {job.name}",
                f"{job.note}, {self.simulated(job)}",
                predicted_text(predicted),
                "not measured",
                "-",
                predicted,
            )
        )

    def simulated(self, job: Job) -> str:
        """How the simulation saw the job: its target, its calibration, the routing it stated,
        and compile as fused elementwise bytes."""
        stated = f", {' '.join(job.simulation)}" if job.simulation else ""
        compiled = ", compile as fused elementwise bytes" if "--compile.enable" in job.args else ""
        calibrated = "this check's probes" if self.calibration else "the stored calibration"
        return f"target {self.target} with {calibrated}{stated}{compiled}"

    def loss_curve(self) -> None:
        """Like against like: bf16 against fp32 on the GPU, then fp32 on the GPU against fp32 on
        the CPU from the same seed. The three runs go side by side (the debug model is small)."""
        steps = ["--training.steps", str(self.shape.loss_steps)]
        if not self.deadline.allows(60):
            for name in (BF16_ROW, DEVICE_ROW):
                self.results.add(Row(name, "", "out of time", "", "skipped"))
            return
        fp32 = ["--training.mixed_precision_param", "float32"]
        cpu_count = min(CPU_STEPS, self.shape.loss_steps)
        cpu_steps = ["--training.steps", str(cpu_count)]
        cpu_run = measure.start(self.scratch / "debug-cpu", [*cpu_steps, *fp32], cpu=True)
        fp32_run = measure.start(self.scratch / "debug-fp32", [*steps, *fp32], self.shape.cpu)
        bf16 = measure.train(
            self.scratch / "debug-bf16", [*steps, *self.shape.precision], self.deadline.left(), self.shape.cpu
        )
        fp32_gpu = measure.finish(*fp32_run, self.scratch / "debug-fp32", self.deadline.left())
        cpu = measure.finish(*cpu_run, self.scratch / "debug-cpu", self.deadline.left())
        device = "CPU" if self.shape.cpu else "1 GPU"
        if self.compared(BF16_ROW, f"{self.shape.loss_steps} steps, {device}", bf16, fp32_gpu):
            low, high = bf16.scalars[measure.LOSS], fp32_gpu.scalars[measure.LOSS]
            worst = worst_relative(low, high)
            last = max(high)
            self.results.add(
                Row(
                    BF16_ROW,
                    f"{self.shape.loss_steps} steps, {device}, the same weights",
                    f"final {low[last]:.4f}, worst step {100 * worst:.2f}%",
                    f"final {high[last]:.4f} (fp32, same GPU); <= {100 * LOSS_TOLERANCE:.0f}%",
                    "ok" if worst <= LOSS_TOLERANCE else "FAIL",
                    {"worst_relative": worst, "bf16": low, "fp32": high, "bf16_s": bf16.seconds},
                )
            )
        setting = f"fp32, {cpu_count} steps, {device} vs CPU, the same seed"
        if self.compared(DEVICE_ROW, setting, fp32_gpu, cpu):
            here, there = fp32_gpu.scalars[measure.LOSS], cpu.scalars[measure.LOSS]
            first = abs(here[1] - there[1]) / there[1]
            worst = worst_relative(here, there)
            self.results.add(
                Row(
                    DEVICE_ROW,
                    setting,
                    f"step 1 {here[1]:.6f}, difference {first:.1e}; worst of {len(there)} steps {worst:.1e}",
                    f"step 1 {there[1]:.6f} (CPU); <= {DEVICE_TOLERANCE:.0e} at step 1",
                    "ok" if first <= DEVICE_TOLERANCE else "FAIL",
                    {"step1_relative": first, "worst_relative": worst, "device": here, "cpu": there},
                )
            )

    def compared(self, name: str, setting: str, *runs: measure.Run) -> bool:
        """Whether every run of a comparison finished; an ``error`` row for the first that did not."""
        for run in runs:
            if not run.ok:
                self.results.add(Row(name, setting, run.cause, "", "error"), run.output)
                return False
        return True

    def throughput(self, job: Job) -> None:
        name = f"throughput {job.name}"
        if not self.deadline.allows(45):
            self.results.add(Row(name, job.note, "out of time", "", "skipped"))
            return
        dump = self.scratch / f"run-{len(self.results.rows)}"
        run = measure.train(dump, job.args, self.deadline.left(), self.shape.cpu)
        if not run.ok:
            self.results.add(Row(name, job.note, run.cause, "", "error", {"seconds": run.seconds}), run.output)
            return
        figures = {**measure.throughput(run), "seconds": run.seconds}
        graphs = measure.compiled_graphs(run.output)
        mfu = f", MFU {figures['mfu_pct']:.1f}%" if "mfu_pct" in figures else ""
        self.results.add(
            Row(
                name,
                job.note,
                f"{figures['tokens_per_s']:,.0f} tokens/s{mfu}, step {figures['step_s']:.3f} s, "
                f"peak {figures['peak_active_gib']:.2f} GiB",
                f"{figures['steps_measured']} steps after {measure.WARMUP_STEPS} warm-up, run {run.seconds:.0f} s"
                + (f"; compile: {graphs}" if graphs else ""),
                "-",
                figures,
            )
        )
        self.compare(job, figures)
        if job.profiled:
            self.kernels(job, dump, run)

    def kernels(self, job: Job, dump: Path, run: measure.Run) -> None:
        """The traced step's top kernels and the MoE time split of a profiled job."""
        name = f"kernels {job.name}"
        try:
            found = measure.step_kernels(dump, run.output)
        except (OSError, ValueError, KeyError) as e:
            self.results.add(Row(name, job.note, f"{type(e).__name__}: {e}"[:300], "", "error"))
            return
        top = ", ".join(f"{k[:60]} {ms:.1f}" for k, ms in found["top_ms"].items())  # type: ignore[attr-defined]
        by_op = ", ".join(f"{k.removeprefix('aten::')} {ms:.1f}" for k, ms in found["top_ops_ms"].items())  # type: ignore[attr-defined]
        measured = f"{found['kind']} ms of {found['total_ms']:.0f} in {found['trace']}: {top}"
        measured += f"; by ATen op: {by_op}" if by_op else ""
        self.results.add(Row(name, job.note, measured, f"MoE time split: {found['moe_split']}", "-", found))

    def compare(self, job: Job, measured: dict[str, float]) -> None:
        """The simulator's prediction of the job beside what was measured, and the ratios: each
        lent machine calibrates the simulator (its efficiency, HBM efficiency, allocator slack)."""
        if key(job) not in self.pending:
            return
        predicted = self.prediction(key(job))
        name = f"simulator {job.name}"
        if isinstance(predicted, str):
            self.results.add(Row(name, job.note, predicted, "", "error"))
            return
        peak = predicted["predicted_peak_gib"] / measured["peak_active_gib"]
        step = predicted["predicted_step_s"] / measured["step_s"]
        tokens = predicted["predicted_tokens_per_s"] / measured["tokens_per_s"]
        self.results.add(
            Row(
                name,
                f"{job.note}, {self.simulated(job)}",
                predicted_text(predicted),
                f"predicted/measured: tokens/s {tokens:.2f}, peak {peak:.2f}, step {step:.2f}",
                "-",
                {**predicted, "peak_ratio": peak, "step_ratio": step, "tokens_ratio": tokens},
            )
        )

    def kernel_probes(self) -> None:
        try:
            self.results.add(Row("initial weights", *initial_weights(self.shape.cpu)))
        except Exception as e:  # a failed measurement is a row; the check goes on
            self.results.add(Row("initial weights", "", f"{type(e).__name__}: {e}"[:300], "", "error"))
        try:
            for setting, op, kernel in attention_kernels(self.shape.cpu):
                self.results.add(Row("SDPA kernel", setting, op, kernel, "-"))
        except Exception as e:  # a failed measurement is a row; the check goes on
            self.results.add(Row("SDPA kernel", "bf16", f"{type(e).__name__}: {e}"[:300], "", "error"))
        try:
            setting, kernel, times, figures = expert_kernels(self.shape.cpu)
            self.results.add(Row("experts kernel", setting, kernel, times, "-", figures))
        except Exception as e:  # as above
            self.results.add(Row("experts kernel", "bf16", f"{type(e).__name__}: {e}"[:300], "", "error"))
        release_memory(self.shape.cpu)

    def resume(self) -> None:
        """Six steps with a checkpoint at 3, then a new job started from that checkpoint: its
        steps 4 to 6 must repeat the first job's."""
        if not self.deadline.allows(60):
            self.results.add(Row("resume", "", "out of time", "", "skipped"))
            return
        base = [*self.shape.precision, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
        first = measure.train(self.scratch / "resume-a", base, self.deadline.left(), self.shape.cpu)
        step3 = self.scratch / "resume-a" / "checkpoint" / "step-3"
        resumed = measure.Run(0.0, first.cause)
        if first.ok:
            extra = ["--checkpoint.initial_load_path", str(step3), "--checkpoint.initial_load_model_only=false"]
            resumed = measure.train(self.scratch / "resume-b", [*base, *extra], self.deadline.left(), self.shape.cpu)
        setting = "debug model, 3 steps from step-3"
        if not resumed.ok:
            self.results.add(Row("resume", setting, resumed.cause, "", "error"), resumed.output or first.output)
            return
        before, after = first.scalars[measure.LOSS], resumed.scalars[measure.LOSS]
        worst = max(abs(after[s] - before[s]) / before[s] for s in (4, 5, 6))
        self.results.add(
            Row(
                "resume",
                setting,
                f"steps {sorted(after)}, worst loss difference {worst:.2e}",
                f"the uninterrupted run's steps 4-6; <= {RESUME_TOLERANCE:.0e}",
                "ok" if sorted(after) == [4, 5, 6] and worst <= RESUME_TOLERANCE else "FAIL",
                {"uninterrupted": before, "resumed": after},
            )
        )


def worst_relative(curve: dict[int, float], reference: dict[int, float]) -> float:
    """The largest relative difference over the steps both curves have."""
    return max(abs(curve[s] - reference[s]) / reference[s] for s in reference if s in curve)


def predicted_text(predicted: dict[str, float]) -> str:
    return (
        f"predicted {predicted['predicted_tokens_per_s']:,.0f} tokens/s, peak "
        f"{predicted['predicted_peak_gib']:.2f} GiB, step {predicted['predicted_step_s']:.3f} s"
    )


def key(job: Job) -> str:
    return f"{job.name} / {job.note}"


if __name__ == "__main__":
    started = time.monotonic()
    code = main(sys.argv[1:])
    print(f"gpu_check: {time.monotonic() - started:.0f} s", flush=True)
    sys.exit(code)
