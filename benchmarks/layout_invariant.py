"""What ``debug.layout_invariant`` costs: step time and memory against the default mode.

The debug model through ``./run_train.sh`` on 1, 2 and 4 processes with the same global batch
(16 sequences of 128 tokens, micro-batches of 4: 4, 2 and 1 micro-batches per rank), the mode off
and on, one thread per rank in both (the mode sets one thread per rank on CPU; the default mode
is given the same, so only the reduction differs). The step time is TensorBoard's mean
``end_to_end`` over steps 2 to ``--steps`` - 1 (step 1 builds and warms up); memory is rank 0's
peak as the console reports it. The pairs run interleaved, ``--repeats`` times, and the median is
kept. Prints one JSON line per data-parallel degree.

    python benchmarks/layout_invariant.py [--steps 12] [--repeats 1] [--dp 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

COMMON = [
    "--training.dataset",
    "shakespeare_dialogue",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "16",
    "--training.seq_len",
    "128",
    "--validation.enable=false",
    "--metrics.disable_color_printing",
]


def measure(ngpu: int, steps: int, mode: list[str]) -> tuple[float, float]:
    """(mean step time in s over steps 2 .. steps - 1, rank 0's peak memory in GiB)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow to import

    args = [*COMMON, "--training.steps", str(steps), "--metrics.log_freq", str(steps - 1), *mode]
    with tempfile.TemporaryDirectory() as dump:
        proc = subprocess.run(
            [str(REPO_ROOT / "run_train.sh"), *args, "--job.dump_folder", dump],
            env={**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        (run,) = (Path(dump) / "tb").iterdir()
        events = EventAccumulator(str(run))
        events.Reload()
        step_time = {s.step: s.value for s in events.Scalars("time_metrics/end_to_end(s)")}[steps - 1]
    memory = max(float(m) for m in re.findall(r"memory: ([0-9.]+)GiB", proc.stdout + proc.stderr))
    return step_time, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dp", default="1,2,4", help="comma-separated data-parallel degrees")
    opts = parser.parse_args()
    for dp in (int(d) for d in opts.dp.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {"default": [], "layout_invariant": []}
        for _ in range(opts.repeats):
            runs["default"].append(measure(dp, opts.steps, []))
            runs["layout_invariant"].append(measure(dp, opts.steps, ["--debug.layout_invariant"]))
        row: dict[str, float | int] = {"dp": dp, "microbatches_per_rank": 4 // dp}
        for name, results in runs.items():
            row[f"{name}_step_s"] = round(statistics.median(t for t, _ in results), 4)
            row[f"{name}_peak_gib"] = round(statistics.median(m for _, m in results), 3)
        row["time_ratio"] = round(float(row["layout_invariant_step_s"]) / float(row["default_step_s"]), 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
