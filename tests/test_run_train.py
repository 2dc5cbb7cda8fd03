"""Through the real entry point: ``./run_train.sh`` on different meshes logs the same curve.

Several optimizer steps of chat fine-tuning with a Llama-3-style ``tokenizer.json`` (uneven
valid tokens: only the assistant's are labels) with a fixed global batch; the logged global
loss, valid-token count and grad norm of every step, and the validation loss, must agree. Every mesh is compared with the
reference in-process (``test_grad_accumulator.py`` and the TP, CP, PP, chat tests); here the
launcher itself is under test, so four meshes suffice: one process with accumulation 4, data x
context parallel over four processes, pipeline x data parallel (interleaved schedule) over
four, whose loss is computed on the last stage only, and HSDP x Ulysses context parallel x tensor
parallel over eight (the one eight-process launch: Ulysses' all-to-alls inside TP's heads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_train, tensorboard_scalars
from hf_tokenizer import build

pytestmark = pytest.mark.launcher

STEPS = 4
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "n_valid_tokens", "loss_metrics/global_max_loss")

COMMON = [
    "--training.dataset",
    "chat",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--debug.seed",
    "3",
    # Validation on the bundled held-out plays, at steps 2 and 4: 3 batches of 2 in all.
    "--validation.enable",
    "--validation.freq",
    "2",
    "--validation.steps",
    "3",
    "--validation.local_batch_size",
    "2",
]
VALIDATION_TAG = "validation/loss"

# name: (NGPU, local batch size, extra args)
MESHES = {
    "1x4": (1, 2, []),
    "dp_shard2xcp2x2": (4, 2, ["--mesh", "dp_shard=2,cp=2"]),
    "pp2xdp_shard2_interleaved": (
        4,
        2,
        [
            "--mesh",
            "pp=2,dp_shard=2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ),
    "dp_replicate2xcp2xtp2_ulysses": (
        8,
        2,
        ["--mesh", "dp_replicate=2,cp=2,tp=2", "--parallelism.context_parallel_backend", "ulysses"],
    ),
}


def logged_scalars(dump: Path) -> dict[str, list[float]]:
    out = {}
    for tag, values in tensorboard_scalars(dump, TAGS).items():
        assert list(values) == list(range(1, STEPS + 1))
        out[tag] = list(values.values())
    return out


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, dict[str, list[float]]]:
    tokenizer = build(tmp_path_factory.mktemp("llama3_style"))
    results = {}
    for name, (ngpu, local_batch, extra) in MESHES.items():
        dump = tmp_path_factory.mktemp(name)
        proc = run_train(
            ngpu,
            COMMON
            + [
                "--model.tokenizer_path",
                str(tokenizer),
                "--training.local_batch_size",
                str(local_batch),
                "--job.dump_folder",
                str(dump),
            ]
            + extra,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"step: {STEPS}/{STEPS}" in proc.stdout + proc.stderr
        assert (dump / "config.toml").is_file()
        results[name] = logged_scalars(dump)
        validation = tensorboard_scalars(dump, (VALIDATION_TAG,))[VALIDATION_TAG]
        assert list(validation) == [2, 4]
        results[name][VALIDATION_TAG] = list(validation.values())
    return results


@pytest.mark.parametrize("name", [m for m in MESHES if m != "1x4"])
def test_same_curve_on_every_mesh(curves, name):
    expected, got = curves["1x4"], curves[name]
    assert got["n_valid_tokens"] == expected["n_valid_tokens"]
    assert got["loss_metrics/global_avg_loss"] == pytest.approx(expected["loss_metrics/global_avg_loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert got[VALIDATION_TAG] == pytest.approx(expected[VALIDATION_TAG], rel=1e-5)


def test_curve_is_not_trivial(curves):
    """The comparison above means something: tokens vary by step, the loss moves, ranks differ."""
    reference = curves["1x4"]
    assert len(set(reference["n_valid_tokens"])) > 1
    loss = reference["loss_metrics/global_avg_loss"]
    assert loss[-1] < loss[0]
    assert reference[VALIDATION_TAG][1] < reference[VALIDATION_TAG][0]
    sharded = curves["dp_shard2xcp2x2"]
    assert all(m > a for m, a in zip(sharded["loss_metrics/global_max_loss"], sharded["loss_metrics/global_avg_loss"]))


def test_runs_on_a_plain_path_with_python3_only(tmp_path):
    """No venv, no `python` command: the launcher runs with `python3`."""
    import os
    import shutil
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a wrapper: a symlink would lose the virtual environment, if any
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    for tool in ("bash", "dirname", "sh"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(root / "run_train.sh"), "--help"],
        env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--training.steps" in proc.stdout


def test_the_tests_launch_with_their_own_interpreter():
    """A venv's python running the suite without the venv activated: the launcher tests start
    ``./run_train.sh`` with that interpreter (``$PYTHON``, set by conftest.py), not the first
    ``python`` on PATH, which may lack torch."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # the system's python, if any, without this environment's packages
    proc = subprocess.run([str(root / "run_train.sh"), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert os.environ["PYTHON"] == sys.executable
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--training.steps" in proc.stdout
