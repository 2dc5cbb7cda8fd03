"""Activation checkpointing and torch.compile change speed and memory, never the numbers:
each mode gives the single-process eager reference's loss and gradients, under FSDP 2 and under
dp_shard 2 x tp 2. Also: profiler traces land where documented."""

from __future__ import annotations

import pytest
from harness import BASE_ARGV, argv_for, assert_matches, run_ranks, step_worker, train_as_a_worker

from trainer.config import ConfigError, load_config
from trainer.planning.job_plan import resolve_job

VARIANTS = {
    "AC full": ["--activation_checkpoint.mode", "full"],
    "AC every 2nd block": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "AC per op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "compile": ["--compile.enable"],
    "compile + AC per op": ["--compile.enable", "--activation_checkpoint.mode", "selective"],
    "compile's graphs + AC per op": [
        "--compile.enable",
        "--compile.backend",
        "aot_eager",
        "--activation_checkpoint.mode",
        "selective",
    ],
}
MESHES = {
    "FSDP 2": (2, 4, []),
    "dp_shard 2 x tp 2": (4, 2, ["--mesh", "dp_shard=2,tp=2"]),
}
SKIPPED = {
    "FSDP 2": {"compile + AC per op"},
    "dp_shard 2 x tp 2": {"compile", "AC full", "AC every 2nd block", "compile's graphs + AC per op"},
}
"""Compiling costs most of this test's time on CPU: under TP, compile + AC per op covers compile
and AC at once (the other AC modes run under CP x TP and FSDP x CP in ``test_document_mask.py``).
Under FSDP, Inductor compiles the blocks once; per-op recomputation there runs compile's graphs
through ``aot_eager`` (the same partitioning and recomputation, eager kernels, compiled 4x faster)."""


def variants_worker(argvs: dict[str, list[str]]) -> dict[str, dict] | None:
    """Every variant in one process group (joined once), one fresh job each."""
    return {name: step_worker(argv) for name, argv in argvs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_activation_checkpointing_and_compile_match_eager(mesh, ref):
    world, local_batch, extra = MESHES[mesh]
    argvs = {}
    variants = {name: flags for name, flags in VARIANTS.items() if name not in SKIPPED.get(mesh, ())}
    for name, flags in variants.items():
        if "--compile.enable" in flags and "tp" in mesh:
            flags = flags + ["--compile.components", "model"]  # see test below
        argvs[name] = argv_for(local_batch, extra + flags)
    results = run_ranks(variants_worker, world, argvs)[0]
    for name in variants:
        assert_matches(results[name], ref)


def test_compiled_loss_with_loss_parallel_is_refused():
    argv = BASE_ARGV + [
        "--training.local_batch_size",
        "8",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--compile.enable",
    ]
    with pytest.raises(ConfigError, match="compile.components"):
        resolve_job(load_config(argv), 2)


def test_bad_selective_option_names_the_key():
    with pytest.raises(ConfigError, match="activation_checkpoint.selective_ac_option"):
        load_config(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"])


def train_worker(argv: list[str]) -> None:
    train_as_a_worker(argv)


@pytest.mark.slow
def test_profiler_traces_per_rank(tmp_path):
    argv = BASE_ARGV + [
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    ]
    run_ranks(train_worker, 2, argv)
    traces = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "profile_traces").rglob("*.json"))
    assert traces == [f"profile_traces/iteration_{s}/rank{r}_trace.json" for s in (2, 4) for r in (0, 1)]
    with pytest.raises(ConfigError, match="profiling.enable_memory_snapshot"):
        resolve_job(
            load_config(BASE_ARGV + ["--training.local_batch_size", "8", "--profiling.enable_memory_snapshot"]), 1
        )
