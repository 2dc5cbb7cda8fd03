"""Qwen3 dense on every mesh it composes with: the loss and gradients of the tiny tied model's
global batch equal one process's (uneven tokens per rank), its tied matrix gets the embedding's
and the output's gradient on every mesh, the layout-invariant mode trains one process's bits, a
checkpoint saves the matrix once and resumes on another mesh, and pipeline parallelism, which
would put the two ends apart, is refused.
"""

from __future__ import annotations

import re

import pytest
from checkpoint_helpers import COMMON, assert_resumes_on_another_mesh
from harness import (
    GLOBAL_BATCH,
    argv_for,
    assert_matches,
    reference,
    run_by_world,
    run_train,
    step_worker,
)
from torch.distributed.checkpoint import FileSystemReader

from trainer.config import ConfigError, load_config
from trainer.planning.job_plan import resolve_job

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "qwen3_debug"]

# name: (world size, local batch size, extra argv); accumulation = 8 / (local x dp)
MESHES = {
    "FSDP 4 x 2 micro-batches": (4, 1, []),
    "FSDP 2 x TP 2 (loss parallel)": (4, 2, ["--parallelism.tensor_parallel_degree", "2"]),
    "HSDP 2 x 2": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2"]),
    "FSDP 2 x CP 2": (4, 2, ["--parallelism.context_parallel_degree", "2"]),
    "TP 2, full AC": (2, 4, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
}


@pytest.fixture(scope="module")
def qwen3_ref() -> dict:
    return reference(argv_for(GLOBAL_BATCH, QWEN3))


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    cases = {
        mesh: (world, (step_worker, argv_for(local_batch, [*QWEN3, *extra])))
        for mesh, (world, local_batch, extra) in MESHES.items()
    }
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_matches_one_process(mesh: str, qwen3_ref: dict, launched: dict) -> None:
    results = launched[mesh]
    assert qwen3_ref["model"].output.weight is qwen3_ref["model"].tok_embeddings.weight
    assert "output.weight" not in results[0]["grads"]  # one matrix, one gradient
    assert_matches(results[0], qwen3_ref)
    counts = [c for r in results for c in r["counts"]]
    assert len(set(counts)) > 1, counts  # uneven micro-batches, or a per-micro-batch mean would pass
    if not mesh.startswith("TP"):  # data-parallel ranks: uneven too, or a per-rank mean would pass
        per_rank = [sum(r["counts"]) for r in results]
        assert len(set(per_rank)) > 1, per_rank


def test_the_tied_gradient_holds_both_uses(qwen3_ref: dict) -> None:
    """Without the output's share the embedding's gradient would be another: the comparison
    above sees a lost half of the tie."""
    model = qwen3_ref["model"]
    grad = qwen3_ref["unclipped"]["tok_embeddings.weight"]
    rows = qwen3_ref["inputs"].unique()
    unused = [r for r in range(grad.shape[0]) if r not in set(rows.tolist())]
    assert model.args.tie_embeddings
    assert grad[unused].abs().sum() > 0  # rows no token looked up: the output's gradient alone


def test_pipeline_parallelism_is_refused_before_launch() -> None:
    config = load_config([*QWEN3, "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="pipeline_parallel_degree.*ties them into one matrix") as err:
        resolve_job(config, world_size=2)
    assert "\n" not in str(err.value)


@pytest.mark.launcher
def test_a_checkpoint_holds_the_tied_matrix_once_and_resumes_on_another_mesh(tmp_path) -> None:
    """FSDP 2 trains 4 steps, saving at 2; TP 2 resumes step-2 and logs the losses of steps 3-4."""
    job = [*COMMON, *QWEN3, "--training.local_batch_size", "2", "--training.steps", "4"]
    job += ["--checkpoint.enable", "--checkpoint.interval", "2"]
    saved = assert_resumes_on_another_mesh(tmp_path, job, [], ["--mesh", "tp=2"])
    keys = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys


EXACT = re.compile(r"exact step values: (loss \S+, tokens \d+, grad norm \S+)")


@pytest.mark.launcher
def test_the_layout_invariant_mode_trains_one_process_s_bits(tmp_path) -> None:
    """``debug.layout_invariant`` sums the tied matrix's gradient (the root unit's) in the one
    order too: 3 steps of FSDP 2 log the bits of 1 process x 8 micro-batches."""
    job = [*COMMON, *QWEN3, "--training.local_batch_size", "1", "--training.steps", "3", "--debug.layout_invariant"]
    logged = {}
    for ngpu in (1, 2):
        done = run_train(ngpu, [*job, "--job.dump_folder", str(tmp_path / str(ngpu))])
        assert done.returncode == 0, done.stderr[-3000:]
        logged[ngpu] = EXACT.findall(done.stderr + done.stdout)
    assert len(logged[1]) == 3 and len(set(logged[1])) == 3
    assert logged[2] == logged[1]
