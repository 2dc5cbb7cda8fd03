"""Float8 over a whole run: what holds across data-parallel layouts step after step (docs/float8.md).

With ``debug.layout_invariant``, 8 rowwise steps of ``shakespeare_dialogue`` (masked prompts and
padding: uneven valid tokens per micro-batch and rank; clipping on every step) end in bit-identical
checkpoints on 1 process x 4 micro-batches, FSDP 2 x 2 and HSDP 2 x 2; tensorwise and
rowwise_with_gw_hp do the same over 4 steps on 1 x 4 and FSDP 2 x 2. Without the mode the same
rowwise run is not bit-identical across layouts, and stays within the drift docs/float8.md states
(whose 20-step table ``benchmarks/float8_drift.py`` measures; the runs here are short for the
suite's time).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from harness import ROOT, run_by_world, tensorboard_scalars, train_as_a_worker

pytest.importorskip("torchao.float8", reason="float8 training needs torchao (the `float8` extra)")

sys.path.insert(0, str(ROOT / "scripts"))
import compare_checkpoints

STEPS = 8
SHORT = 4


def argv(recipe: str, steps: int, dump: Path, extra: list[str]) -> list[str]:
    return [
        "--training.dataset",
        "shakespeare_dialogue",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--training.max_norm",
        "0.5",  # below the debug model's grad norm here: every step clips
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard=false",
        "--validation.enable=false",
        "--debug.seed",
        "5",
        *([] if recipe == "none" else ["--model.converters", "float8", "--float8.recipe_name", recipe]),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(steps // 2),
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


ON = ["--debug.layout_invariant"]
TENSORBOARD = ["--metrics.enable_tensorboard=true"]
HSDP = ["--mesh", "dp_replicate=2,dp_shard=2"]
# name: (world size, recipe, steps, extra argv)
RUNS = {
    "rowwise 1x4": (1, "rowwise", STEPS, ON),
    "rowwise fsdp2x2": (2, "rowwise", STEPS, ON),
    "rowwise hsdp2x2": (4, "rowwise", STEPS, [*ON, *HSDP]),
    "tensorwise 1x4": (1, "tensorwise", SHORT, ON),
    "tensorwise fsdp2x2": (2, "tensorwise", SHORT, ON),
    "rowwise_with_gw_hp 1x4": (1, "rowwise_with_gw_hp", SHORT, ON),
    "rowwise_with_gw_hp fsdp2x2": (2, "rowwise_with_gw_hp", SHORT, ON),
    "default rowwise 1x4": (1, "rowwise", STEPS, TENSORBOARD),
    "default rowwise fsdp2x2": (2, "rowwise", STEPS, TENSORBOARD),
    "default none 1x4": (1, "none", STEPS, TENSORBOARD),
    "default none fsdp2x2": (2, "none", STEPS, TENSORBOARD),
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("float8_runs")
    folders = {name: root / name.replace(" ", "_") for name in RUNS}
    run_by_world(
        {
            name: (world, (train_as_a_worker, argv(recipe, steps, folders[name], extra)))
            for name, (world, recipe, steps, extra) in RUNS.items()
        }
    )
    return folders


def checkpoint(dump: Path, step: int) -> dict[str, torch.Tensor]:
    return compare_checkpoints.read_tensors(dump / "checkpoint" / f"step-{step}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, steps, layouts",
    [
        ("rowwise", STEPS, ["fsdp2x2", "hsdp2x2"]),
        ("tensorwise", SHORT, ["fsdp2x2"]),
        ("rowwise_with_gw_hp", SHORT, ["fsdp2x2"]),
    ],
)
def test_with_the_layout_invariant_mode_every_layout_ends_in_the_same_bits(dumps, recipe, steps, layouts):
    for step in (steps // 2, steps):
        expected = checkpoint(dumps[f"{recipe} 1x4"], step)
        assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in expected)
        for layout in layouts:
            result = compare_checkpoints.compare(expected, checkpoint(dumps[f"{recipe} {layout}"], step))
            assert result.compared == len(expected) and not result.differing, (layout, step, result.differing[:3])


def weight_drift(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of a weight tensor between two checkpoints."""
    weights = [k for k in a if k.startswith("model.")]
    return max(((a[k].double() - b[k].double()).norm() / a[k].double().norm()).item() for k in weights)


def loss_drift(a: Path, b: Path) -> float:
    """The largest relative difference of a step's loss between two runs (TensorBoard's float32)."""
    (tag,) = TAGS = ("loss_metrics/global_avg_loss",)
    x, y = tensorboard_scalars(a, TAGS)[tag], tensorboard_scalars(b, TAGS)[tag]
    assert sorted(x) == sorted(y) == list(range(1, STEPS + 1))
    return max(abs(x[s] - y[s]) / abs(x[s]) for s in x)


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, weights_within, losses_within",
    [("rowwise", (1e-4, 5e-2), (1e-5, 1e-3)), ("none", (0, 1e-6), (0, 1e-6))],
)
def test_without_the_mode_a_run_drifts_across_layouts_as_stated(dumps, recipe, weights_within, losses_within):
    """docs/float8.md's bounds, on FSDP 2 x 2 against 1 x 4 after 8 steps (measured on 2026-12-02:
    rowwise weights 2.9e-3, loss 4.4e-5; without float8 1.8e-7 and 1.4e-7): float8 rounding turns
    FSDP's other order of sums into differences far beyond round-off, which without float8 stay at it."""
    one, fsdp = dumps[f"default {recipe} 1x4"], dumps[f"default {recipe} fsdp2x2"]
    weights = weight_drift(checkpoint(one, STEPS), checkpoint(fsdp, STEPS))
    losses = loss_drift(one, fsdp)
    assert weights_within[0] <= weights <= weights_within[1], weights
    assert losses_within[0] <= losses <= losses_within[1], losses
