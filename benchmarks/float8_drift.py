"""How far a training run drifts between data-parallel layouts, with and without float8 (docs/float8.md).

Each recipe (and ``none``, no float8) trains the debug model ``--steps`` steps of
``shakespeare_dialogue`` through ``./run_train.sh`` on 1 process x 4 micro-batches, FSDP 2 x 2,
FSDP 4 x 1 and HSDP 2 x 2 (micro-batches of 1 sequence of 64 tokens, a global batch of 4,
clipping on), in the default mode or with ``--layout-invariant``. Against 1 x 4, each layout's
largest relative difference of a step's loss and grad norm (TensorBoard's float32 values) and of
a weight tensor after the last step. Prints one JSON line per recipe and layout.

    python benchmarks/float8_drift.py [--steps 20] [--recipes none,rowwise,rowwise_with_gw_hp,tensorwise]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import compare_checkpoints  # noqa: E402

LAYOUTS = {
    "1x4": (1, []),
    "fsdp2x2": (2, []),
    "fsdp4x1": (4, []),
    "hsdp2x2": (4, ["--mesh", "dp_replicate=2,dp_shard=2"]),
}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm")


def train(dump: Path, ngpu: int, steps: int, extra: list[str]) -> None:
    args = [
        *("--training.dataset", "shakespeare_dialogue", "--training.seq_len", "64"),
        *("--training.local_batch_size", "1", "--training.global_batch_size", "4"),
        *("--training.steps", str(steps), "--training.max_norm", "0.5", "--metrics.log_freq", "1"),
        *("--validation.enable=false", "--debug.seed", "5", "--metrics.disable_color_printing"),
        *("--checkpoint.enable", "--checkpoint.interval", str(steps), "--job.dump_folder", str(dump)),
        *extra,
    ]
    proc = subprocess.run(
        [str(REPO_ROOT / "run_train.sh"), *args],
        env={**os.environ, "NGPU": str(ngpu), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])


def scalars(dump: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow to import

    (run,) = [p for p in (dump / "tb").iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in TAGS}


def largest(x: dict[int, float], y: dict[int, float]) -> float:
    return max(abs(x[s] - y[s]) / abs(x[s]) for s in x)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recipes", default="none,rowwise,rowwise_with_gw_hp,tensorwise")
    parser.add_argument("--layout-invariant", action="store_true")
    args = parser.parse_args(argv)
    mode = ["--debug.layout_invariant"] if args.layout_invariant else []
    for recipe in args.recipes.split(","):
        float8 = [] if recipe == "none" else ["--model.converters", "float8", "--float8.recipe_name", recipe]
        with tempfile.TemporaryDirectory() as root:
            dumps = {name: Path(root) / name for name in LAYOUTS}
            for name, (ngpu, extra) in LAYOUTS.items():
                train(dumps[name], ngpu, args.steps, [*float8, *mode, *extra])
            ref, ref_tensors = (
                scalars(dumps["1x4"]),
                compare_checkpoints.read_tensors(dumps["1x4"] / "checkpoint" / f"step-{args.steps}"),
            )
            for name in list(LAYOUTS)[1:]:
                got = scalars(dumps[name])
                tensors = compare_checkpoints.read_tensors(dumps[name] / "checkpoint" / f"step-{args.steps}")
                weights = max(
                    ((tensors[k].double() - ref_tensors[k].double()).norm() / ref_tensors[k].double().norm()).item()
                    for k in ref_tensors
                    if k.startswith("model.")
                )
                line = {"recipe": recipe, "layout": name, "steps": args.steps, "layout_invariant": bool(mode)}
                line |= {"loss": largest(ref[TAGS[0]], got[TAGS[0]]), "grad_norm": largest(ref[TAGS[1]], got[TAGS[1]])}
                print(json.dumps(line | {"weights": weights}), flush=True)


if __name__ == "__main__":
    main()
