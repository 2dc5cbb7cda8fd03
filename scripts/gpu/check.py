"""The device check: what one lent GPU tells the project in 7 minutes, from one command.

    python3 scripts/gpu/check.py --out "$OUT"     # on the lent machine (docs/gpu.md, the runbook)
    python scripts/gpu/check.py                   # anywhere: the CPU half, then exit 2 without CUDA
    python scripts/gpu/check.py --rehearse        # the GPU half's every step on the CPU, tiny shapes

It installs the wheels the machine lacks (``scripts/gpu/wheels.py``), then measures, in this order
of value, each row written as soon as it is measured (``results.jsonl`` and ``table.md`` in
``--out``), so a run cut short keeps what it measured:

1. **bf16 against fp32**: the debug model's loss curve on the GPU in bf16 against the same job
   in fp32 on the CPU (run side by side), every step within :data:`LOSS_TOLERANCE`.
2. **The 1B preset** at a few steps: tokens/s, MFU, the allocator's peak, eager (no activation
   checkpointing) and compiled with selective AC; beside each, the simulator's prediction of the
   same job and the ratio (simulations run on the CPU while the GPU trains).
3. **The 8B shape at fewer layers** (8, or fewer if the memory estimate says 8 do not fit): the
   same figures, and the chunked loss off.
4. **The attention kernel** SDPA runs in bf16, causal and document-masked.
5. **A 3-step resume** from a checkpoint on the GPU, against the uninterrupted run.

A failed run is a row with its one-line cause, and the check goes on. Exit 0 when every row
passed, 1 when one failed, 2 without CUDA (after the CPU half: the environment, the wheels and
the simulator's prediction of the first GPU job).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import measure
import wheels
from report import Deadline, Results, Row

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

BUDGET_S = 420.0
LOSS_TOLERANCE = 0.03
"""Largest relative difference between a bf16 GPU loss and the fp32 CPU loss of the same step:
bf16 rounds activations to 8 bits of mantissa; a wrong kernel, mask or reduction moves the
curve by far more."""
RESUME_TOLERANCE = 1e-3
SIMULATOR_TARGETS = {"H100": "h100", "H200": "h200", "A100": "a100", "B200": "b200"}
"""GPU name fragment -> ``--target-gpu`` name; a CPU-only machine plans for an H100."""
EIGHT_B_LAYERS = (8, 6, 4, 2)
"""The 8B shape keeps its width with the first of these block counts that the memory estimate fits."""
FIT_FRACTION = 0.9


@dataclass
class Shape:
    """What the check runs, at full size on a GPU or tiny when rehearsing on the CPU."""

    loss_steps: int = 60
    steps: int = 8
    one_b: list[str] = field(default_factory=lambda: ["--config", "llama3_1b.toml"])
    eight_b: list[str] = field(default_factory=lambda: ["--config", "llama3_8b.toml"])
    precision: list[str] = field(default_factory=lambda: ["--training.mixed_precision_param", "bfloat16"])
    seq_len: int = 8192
    cpu: bool = False


REHEARSAL = Shape(
    loss_steps=4,
    steps=5,
    one_b=["--model.flavor", "debugmodel"],
    eight_b=["--model.flavor", "debugmodel"],
    precision=["--training.mixed_precision_param", "float32"],
    seq_len=256,
    cpu=True,
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "gpu_check", help="where the rows go")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--rehearse", action="store_true", help="every GPU step on the CPU, at tiny shapes")
    parser.add_argument("--jobs", type=int, default=None, help="run only the first N throughput jobs")
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
        check = Check(results, deadline, scratch, shape, target, memory, args.jobs)
        if not (cuda or args.rehearse):
            check.simulations(check.throughput_jobs()[:1])
            check.report_predictions_only()
            print("gpu_check: the GPU half needs CUDA, and no CUDA GPU is visible here; run it on the lent machine.")
            return 2
        check.run_all()
        print(f"gpu_check: {len(results.rows)} rows in {args.out / 'table.md'}")
        return 1 if results.failed() else 0


@dataclass
class Job:
    name: str
    args: list[str]
    note: str = ""


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
    ):
        self.results, self.deadline, self.scratch, self.shape = results, deadline, scratch, shape
        self.target, self.memory, self.jobs = target, memory, jobs
        self.pending: dict[str, tuple] = {}

    def run_all(self) -> None:
        jobs = self.throughput_jobs()[: self.jobs]
        self.simulations(jobs)
        self.loss_curve()
        for job in jobs:
            self.throughput(job)
        self.attention()
        self.resume()
        for name in list(self.pending):
            self.predicted_only(name)

    def common(self) -> list[str]:
        return ["--training.seq_len", str(self.shape.seq_len), "--training.steps", str(self.shape.steps)]

    def throughput_jobs(self) -> list[Job]:
        eager, compiled = (
            ["--activation_checkpoint.mode", "none"],
            ["--compile.enable", "--activation_checkpoint.mode", "selective"],
        )
        one_b = [*self.shape.one_b, *self.shape.precision, *self.common()]
        layers = self.eight_b_layers()
        eight_b = [*self.shape.eight_b, "--model.n_layers", str(layers), *self.shape.precision, *self.common()]
        return [
            Job("1B", [*one_b, *eager], "eager, no AC"),
            Job("1B", [*one_b, *compiled], "compiled + selective AC"),
            Job(f"8B x {layers} layers", [*eight_b, *eager], "eager, no AC, chunked loss"),
            Job(
                f"8B x {layers} layers",
                [*eight_b, *eager, "--training.loss_chunk_tokens", "0"],
                "eager, no AC, unchunked loss",
            ),
            Job(f"8B x {layers} layers", [*eight_b, *compiled], "compiled + selective AC"),
        ]

    def eight_b_layers(self) -> int:
        """The most blocks of :data:`EIGHT_B_LAYERS` whose unchunked, un-checkpointed job the
        memory estimate fits in :data:`FIT_FRACTION` of this GPU."""
        from trainer.config import load_config
        from trainer.planning.job_plan import resolve_job

        for layers in EIGHT_B_LAYERS:
            argv = [*self.shape.eight_b, "--model.n_layers", str(layers), *self.common()]
            argv += ["--activation_checkpoint.mode", "none", "--training.loss_chunk_tokens", "0"]
            if resolve_job(load_config(argv), 1, "cuda").memory.total <= FIT_FRACTION * self.memory:
                return layers
        return EIGHT_B_LAYERS[-1]

    def simulations(self, jobs: list[Job]) -> None:
        """Start the simulator on each job, on the CPU, while the GPU trains."""
        for index, job in enumerate(jobs):
            dump = self.scratch / f"simulation-{index}"
            self.pending[key(job)] = (*measure.start_simulation(dump, job.args, self.target), dump, job)

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
                f"{job.note}, target {self.target}",
                f"predicted peak {predicted['predicted_peak_gib']:.2f} GiB, step {predicted['predicted_step_s']:.3f} s",
                "not measured",
                "-",
                predicted,
            )
        )

    def report_predictions_only(self) -> None:
        for name in list(self.pending):
            self.predicted_only(name)

    def loss_curve(self) -> None:
        steps = ["--training.steps", str(self.shape.loss_steps)]
        if not self.deadline.allows(60):
            self.results.add(Row("debug model bf16 vs fp32", "", "out of time", "", "skipped"))
            return
        cpu_run = measure.start(
            self.scratch / "debug-cpu", [*steps, "--training.mixed_precision_param", "float32"], cpu=True
        )
        gpu = measure.train(
            self.scratch / "debug-gpu", [*steps, *self.shape.precision], self.deadline.left(), self.shape.cpu
        )
        cpu = measure.finish(*cpu_run, self.scratch / "debug-cpu", self.deadline.left())
        setting = f"{self.shape.loss_steps} steps, {'CPU' if self.shape.cpu else '1 GPU'} vs CPU"
        for name, run in (("GPU", gpu), ("CPU", cpu)):
            if not run.ok:
                self.results.add(
                    Row("debug model bf16 vs fp32", setting, f"{name} run: {run.cause}", "", "error"), run.output
                )
                return
        gpu_loss, cpu_loss = gpu.scalars[measure.LOSS], cpu.scalars[measure.LOSS]
        worst = max(abs(gpu_loss[s] - cpu_loss[s]) / cpu_loss[s] for s in cpu_loss)
        last = max(cpu_loss)
        figures = {
            "worst_relative": worst,
            "gpu": gpu_loss,
            "cpu": cpu_loss,
            "gpu_s": gpu.seconds,
            "cpu_s": cpu.seconds,
        }
        self.results.add(
            Row(
                "debug model bf16 vs fp32",
                setting,
                f"final {gpu_loss[last]:.4f}, worst step {100 * worst:.2f}%",
                f"final {cpu_loss[last]:.4f} (fp32, CPU); <= {100 * LOSS_TOLERANCE:.0f}%",
                "ok" if worst <= LOSS_TOLERANCE else "FAIL",
                figures,
            )
        )

    def throughput(self, job: Job) -> None:
        name = f"throughput {job.name}"
        if not self.deadline.allows(45):
            self.results.add(Row(name, job.note, "out of time", "", "skipped"))
            return
        run = measure.train(
            self.scratch / f"run-{len(self.results.rows)}", job.args, self.deadline.left(), self.shape.cpu
        )
        if not run.ok:
            self.results.add(Row(name, job.note, run.cause, "", "error", {"seconds": run.seconds}), run.output)
            return
        figures = {**measure.throughput(run), "seconds": run.seconds}
        mfu = f", MFU {figures['mfu_pct']:.1f}%" if "mfu_pct" in figures else ""
        self.results.add(
            Row(
                name,
                job.note,
                f"{figures['tokens_per_s']:,.0f} tokens/s{mfu}, step {figures['step_s']:.3f} s, "
                f"peak {figures['peak_active_gib']:.2f} GiB",
                f"{figures['steps_measured']} steps after {measure.WARMUP_STEPS} warm-up, run {run.seconds:.0f} s",
                "-",
                figures,
            )
        )
        self.compare(job, figures)

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
        simulated = " (simulated without compile)" if "--compile.enable" in job.args else ""
        self.results.add(
            Row(
                name,
                f"{job.note}, target {self.target}{simulated}",
                f"predicted peak {predicted['predicted_peak_gib']:.2f} GiB, step {predicted['predicted_step_s']:.3f} s",
                f"predicted/measured: peak {peak:.2f}, step {step:.2f}",
                "-",
                {**predicted, "peak_ratio": peak, "step_ratio": step},
            )
        )

    def attention(self) -> None:
        try:
            for setting, op, kernel in attention_kernels(self.shape.cpu):
                self.results.add(Row("SDPA kernel", setting, op, kernel, "-"))
        except Exception as e:  # a failed measurement is a row; the check goes on
            self.results.add(Row("SDPA kernel", "bf16", f"{type(e).__name__}: {e}"[:300], "", "error"))

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


def key(job: Job) -> str:
    return f"{job.name} / {job.note}"


def attention_kernels(cpu: bool) -> Iterator[tuple[str, str, str]]:
    """``(setting, ATen op, first kernel)`` for SDPA's causal and document-masked attention."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model.llama3 import causal_attention, document_causal_mask

    device, seq, dtype = ("cpu", 256, torch.float32) if cpu else ("cuda", 8192, torch.bfloat16)
    heads, kv_heads, head_dim = 32, 8, 64
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    documents = torch.arange(seq, device=device).div(seq // 3, rounding_mode="floor")[None]
    activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    for setting, mask in (("causal", None), ("document mask", document_causal_mask(documents, dtype))):
        with profile(activities=activities) as prof, synchronized(cpu):
            causal_attention(q, k, v, mask).sum().backward()
        ops = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
        kernels = [e.name for e in prof.events() if cpu or str(e.device_type).endswith("CUDA")]
        words = ("flash", "fmha", "efficient", "cudnn", "attention", "softmax")
        kernel = next((n for n in kernels if any(w in n.lower() for w in words)), "?")
        yield (
            f"{dtype}, {setting}, seq {seq}".replace("torch.", ""),
            (ops[0] if ops else "?").removeprefix("aten::"),
            kernel[:70],
        )


@contextlib.contextmanager
def synchronized(cpu: bool) -> Iterator[None]:
    yield
    if not cpu:
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    started = time.monotonic()
    code = main(sys.argv[1:])
    print(f"gpu_check: {time.monotonic() - started:.0f} s", flush=True)
    sys.exit(code)
