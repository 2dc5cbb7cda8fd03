"""GPU acceptance run in one command, for a machine with one GPU and no internet (under 20 minutes).

    python scripts/gpu_check.py              # prints one table; exit 0 when the checks pass
    python scripts/gpu_check.py --steps 8    # shorter throughput runs

What it runs, all through ``./run_train.sh`` on the bundled plays (no download):

* **bf16 against fp32.** The debug model trains its 60 steps on the GPU in bf16 (fp32 master
  weights and reductions) and on this machine's CPU in fp32, same seed and data; every logged
  loss must agree within :data:`LOSS_TOLERANCE` (relative). bf16 rounds activations to 8 bits of
  mantissa, so the curves differ a little; a wrong kernel, mask or reduction moves them by far
  more.
* **Throughput.** The 1B and 3B shapes (``llama3_1b.toml``, flavor ``3B``) at one sequence of
  :data:`SEQ_LEN` tokens per step, eager without activation checkpointing and compiled with
  per-op selective checkpointing: tokens/s and MFU (the trainer's own, averaged after the first
  steps), the CUDA allocator's peak (``torch.cuda.max_memory_allocated``, the dashboard's
  ``max_active``) and the step time. A shape the memory estimate says cannot fit is skipped.
* **Simulator.** Where ``trainer/simulation`` exists and knows this GPU, its predicted peak and
  step time for the same job (eager: it does not compile), against the measured ones.
* **Attention kernel.** Which SDPA implementation the model's attention runs in bf16, causal and
  with a document mask (the ATen op and the first CUDA kernel the profiler records).

Without CUDA it exits 2 with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

LOSS_TOLERANCE = 0.03
"""Largest relative difference between a bf16 GPU loss and the fp32 CPU loss of the same step."""
SEQ_LEN = 2048
WARMUP_STEPS = 3
"""Steps left out of the throughput averages (allocation, autotuning, compilation)."""
SHAPES = {"1B": ["--config", "llama3_1b.toml"], "3B": ["--config", "llama3_1b.toml", "--model.flavor", "3B"]}
VARIANTS = {
    "eager": ["--activation_checkpoint.mode", "none"],
    "compile + AC op": ["--compile.enable", "--activation_checkpoint.mode", "selective"],
}
SIMULATOR_TARGETS = {"H100": "h100", "H200": "h200", "A100": "a100", "B200": "b200"}
"""GPU name fragment -> ``--target-gpu`` name of the simulator."""


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a GPU machine.")
        return 2
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps of each throughput run")
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name(0)
    rows: list[tuple[str, str, str, str, str]] = []
    with tempfile.TemporaryDirectory() as scratch:
        rows += loss_rows(Path(scratch))
        rows += throughput_rows(Path(scratch), args.steps, device)
    rows += attention_rows()
    print(f"gpu_check on {device}, torch {torch.__version__}")
    print(table(("check", "setting", "measured", "reference", "result"), rows))
    return 1 if any(row[4] == "FAIL" for row in rows) else 0


def train(dump: Path, args: list[str], cpu: bool = False) -> dict[str, dict[int, float]]:
    """Run ``./run_train.sh`` on one device; its TensorBoard scalars, ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {**os.environ, "NGPU": "1", "LOG_RANK": "0"}
    if cpu:
        env |= {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
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
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {proc.stderr[-1500:]}")
    runs = sorted((dump / "tb").iterdir())
    events = EventAccumulator(str(runs[-1]))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def loss_rows(scratch: Path) -> list[tuple[str, str, str, str, str]]:
    loss = "loss_metrics/global_avg_loss"
    gpu = train(scratch / "debug-gpu", ["--training.mixed_precision_param", "bfloat16"])[loss]
    cpu = train(scratch / "debug-cpu", ["--training.mixed_precision_param", "float32"], cpu=True)[loss]
    worst = max(abs(gpu[s] - cpu[s]) / cpu[s] for s in cpu)
    last = max(cpu)
    return [
        (
            "debug model bf16 vs fp32",
            f"{len(cpu)} steps, 1 GPU vs CPU",
            f"final {gpu[last]:.4f}, worst step {100 * worst:.2f}%",
            f"final {cpu[last]:.4f} (fp32, CPU); <= {100 * LOSS_TOLERANCE:.0f}%",
            "ok" if worst <= LOSS_TOLERANCE else "FAIL",
        )
    ]


def throughput_rows(scratch: Path, steps: int, device: str) -> list[tuple[str, str, str, str, str]]:
    import torch

    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job

    total = torch.cuda.get_device_properties(0).total_memory
    common = ["--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "1", "--training.steps", str(steps)]
    rows = []
    for shape, shape_args in SHAPES.items():
        for variant, variant_args in VARIANTS.items():
            args = [*shape_args, *common, *variant_args]
            setting = f"{shape}, seq {SEQ_LEN}, {variant}"
            estimate = resolve_job(load_config(args), 1, "cuda").memory.total
            if estimate > total:
                rows.append((f"throughput {shape}", setting, "skipped", f"estimate {estimate / 2**30:.1f} GiB", "-"))
                continue
            scalars = train(scratch / f"{shape}-{len(rows)}", args)
            kept = [s for s in scalars["throughput(tps)"] if s > WARMUP_STEPS] or list(scalars["throughput(tps)"])
            tps = statistics.mean(scalars["throughput(tps)"][s] for s in kept)
            mfu = statistics.mean(scalars.get("mfu(%)", {s: float("nan") for s in kept})[s] for s in kept)
            step_s = statistics.median(scalars["time_metrics/end_to_end(s)"][s] for s in kept)
            peak = max(scalars["memory/max_active(GiB)"].values()) * 2**30
            rows.append(
                (f"throughput {shape}", setting, f"{tps:,.0f} tokens/s, MFU {mfu:.1f}%", f"step {step_s:.3f} s", "-")
            )
            rows.append(
                (
                    f"peak memory {shape}",
                    setting,
                    f"{peak / 2**30:.2f} GiB allocated",
                    f"estimate {estimate / 2**30:.2f} GiB (with runtime and slack)",
                    "-",
                )
            )
            if variant == "eager":
                rows.append(simulator_row(scratch / f"sim-{shape}", args, device, shape, peak, step_s))
    return rows


def simulator_row(
    dump: Path, args: list[str], device: str, shape: str, peak: float, step_s: float
) -> tuple[str, str, str, str, str]:
    """The simulator's prediction for the same job, run in a process of its own (optional)."""
    name = f"simulator {shape}"
    target = next((t for fragment, t in SIMULATOR_TARGETS.items() if fragment in device.upper()), None)
    try:
        import trainer.entry.simulate  # noqa: F401
    except ImportError:
        return (name, "eager", "n/a", "trainer/simulation is absent", "-")
    if target is None:
        return (name, "eager", "n/a", f"no simulator target for {device}", "-")
    code = "import sys; from trainer.entry.simulate import simulate; sys.exit(simulate(sys.argv[1:], 1, 1))"
    command = [sys.executable, "-c", code, *args, "--job.dump_folder", str(dump), "--target-gpu", target]
    proc = subprocess.run(
        command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, cwd=REPO_ROOT
    )
    report_path = dump / "simulation.json"
    if not report_path.exists():
        return (name, "eager", "n/a", f"simulation failed: {proc.stderr.strip()[-200:]}", "-")
    role = json.loads(report_path.read_text())["roles"][0]
    return (
        name,
        f"eager, target {target}",
        f"peak {role['peak_bytes'] / 2**30:.2f} GiB, step {role['step_time_s']:.3f} s",
        f"predicted/measured: peak {role['peak_bytes'] / peak:.2f}, step {role['step_time_s'] / step_s:.2f}",
        "-",
    )


def attention_rows() -> list[tuple[str, str, str, str, str]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer.model.llama3 import causal_attention, document_causal_mask

    heads, kv_heads, head_dim = 32, 8, 64
    q = torch.randn(1, heads, SEQ_LEN, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, SEQ_LEN, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    documents = torch.arange(SEQ_LEN, device="cuda").div(SEQ_LEN // 3, rounding_mode="floor")[None]
    rows = []
    for setting, mask in (("causal", None), ("document mask", document_causal_mask(documents, torch.bfloat16))):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            causal_attention(q, k, v, mask).sum().backward()
            torch.cuda.synchronize()
        ops = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
        kernels = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]
        words = ("flash", "fmha", "efficient", "cudnn", "attention", "softmax")
        kernel = next((n for n in kernels if any(w in n.lower() for w in words)), "?")
        op = ops[0] if ops else "?"
        rows.append(("SDPA kernel", f"bf16, {setting}", op.removeprefix("aten::"), kernel[:60], "-"))
    return rows


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in (header, *rows)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
