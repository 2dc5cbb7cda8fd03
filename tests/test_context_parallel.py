"""Context parallelism: the all-gather-KV and Ulysses attentions equal full causal (and
document-masked) attention, and every CP mesh of either backend (alone and with FSDP and TP)
gives the single-process reference's loss and gradients; the CP-specific bugs (tokens counted
per shard, DeepSpeed #5248's gradient scaled by cp) are caught on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import BASE_ARGV, argv_for, assert_matches, full, run_by_world, step_worker, trainer_for
from step_helpers import fetch_step, forward_backward, sums_of

from parallelisms.context_parallel import AllGatherKVAttention, attend_local_chunks
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.parallelize import ModelShape, ParallelSettings, check
from parallelisms.sequence_shards import head_tail_positions, natural_order
from parallelisms.ulysses import UlyssesAttention, UlyssesMask, all_to_all_bytes, kv_replication
from trainer.config import ConfigError, load_config
from trainer.loss import IGNORE_INDEX
from trainer.model.llama3 import causal_attention, document_causal_mask
from trainer.planning.job_plan import resolve_job
from trainer.runtime.distributed import init_distributed
from trainer.step.sums import Ranks

ULYSSES = ["--parallelism.context_parallel_backend", "ulysses"]

# name: (world size, local batch size, extra argv); global batch 8, seq_len 64. The debug model
# has 16 heads and 8 key/value heads: under Ulysses cp=2 x tp=2 a rank pair shares 8 heads.
# dp_replicate=2 x cp=2 x tp=2 with Ulysses runs through ./run_train.sh (test_run_train.py).
MESHES = {
    "cp=2": (2, 8, ["--parallelism.context_parallel_degree", "2"]),
    "dp_shard=2 x cp=2, 2 micro-batches": (4, 2, ["--mesh", "dp_shard=2,cp=2"]),
    "cp=2 x tp=2": (4, 8, ["--mesh", "cp=2,tp=2"]),
    "ulysses cp=2": (2, 8, ["--parallelism.context_parallel_degree", "2", *ULYSSES]),
    "ulysses dp_shard=2 x cp=2, 2 micro-batches": (4, 2, ["--mesh", "dp_shard=2,cp=2", *ULYSSES]),
    "ulysses cp=2 x tp=2": (4, 8, ["--mesh", "cp=2,tp=2", *ULYSSES]),
}


def test_head_tail_layout_balances_causal_work():
    assert head_tail_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for degree in (2, 3, 4):
        seq = 2 * degree * 5
        held = [head_tail_positions(seq, r, degree) for r in range(degree)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        work = {int((p + 1).sum()) for p in held}  # keys each query attends to under causality
        assert len(work) == 1


@pytest.mark.parametrize("degree", [2, 3])
def test_simulated_ranks_equal_full_attention(degree):
    """One process plays every rank: chunks, offsets and GQA, forward and backward."""
    torch.manual_seed(0)
    batch, heads, kv_heads, chunk, dim = 3, 6, 2, 5, 12  # odd sizes on purpose
    seq = 2 * degree * chunk
    q = torch.randn(batch, heads, seq, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    expected = causal_attention(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    out = torch.empty_like(expected)
    for rank in range(degree):
        pos = head_tail_positions(seq, rank, degree)
        shards = natural_order(torch.stack([k[:, :, head_tail_positions(seq, r, degree)] for r in range(degree)]))
        assert torch.equal(shards, k)  # gathering the shards restores the natural order
        out[:, :, pos] = attend_local_chunks(causal_attention, q[:, :, pos], k, v, rank, degree)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def allgather_attention_worker(degree: int) -> dict:
    """Each rank computes its shard with the real collective; rank 0 returns all outputs/grads."""
    init_distributed("cpu", timeout_s=300)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, chunk, dim = 2, 4, 2, 3, 6
    seq = 2 * degree * chunk
    q, k, v = (torch.randn(batch, h, seq, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    upstream = torch.randn(batch, heads, seq, dim, generator=gen)
    pos = head_tail_positions(seq, rank, degree)
    q_local, k_local, v_local = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    attention = AllGatherKVAttention(causal_attention, dist.group.WORLD, rank, degree)
    out = attention(q_local, k_local, v_local)
    out.backward(upstream[:, :, pos])
    return {
        "pos": pos,
        "out": out.detach(),
        "grads": [t.grad for t in (q_local, k_local, v_local)],
        "q": q,
        "k": k,
        "v": v,
        "upstream": upstream,
    }


def ulysses_attention_worker(degree: int) -> dict:
    """Ulysses with the real all-to-alls, causal and document-masked, with key/value heads that
    divide by ``degree`` (4 of 8) and that do not (2 of 8 at degree 4: replicated); rank 0
    returns every rank's largest errors against one full attention, forward and backward."""
    init_distributed("cpu", timeout_s=300)
    rank = dist.get_rank()
    errors = {}
    for kv_heads in (4, 2):
        for masked in (False, True):
            gen = torch.Generator().manual_seed(kv_heads)
            batch, heads, chunk, dim = 2, 8, 3, 6
            seq = 2 * degree * chunk
            q, k, v = (torch.randn(batch, h, seq, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
            upstream = torch.randn(batch, heads, seq, dim, generator=gen)
            ids = torch.randint(0, 4, (batch, seq), generator=gen).sort(dim=1).values
            pos = head_tail_positions(seq, rank, degree)
            local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            mask = UlyssesMask(dist.group.WORLD, degree)(ids[:, pos], q.dtype) if masked else None
            out = UlyssesAttention(causal_attention, dist.group.WORLD, degree)(*local, mask)
            out.backward(upstream[:, :, pos])
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            expected = causal_attention(*whole, document_causal_mask(ids, q.dtype) if masked else None)
            expected.backward(upstream)
            pairs = [(out, expected[:, :, pos])] + [(g.grad, w.grad[:, :, pos]) for g, w in zip(local, whole)]
            errors[(kv_heads, masked)] = max(((a - b).norm() / b.norm()).item() for a, b in pairs)
    gathered: list = [None] * degree
    dist.all_gather_object(gathered, errors)
    return {"errors": gathered}


CP2_ARGV = argv_for(8, ["--parallelism.context_parallel_degree", "2"])


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    """Every multi-process case of this file, one launch per world size."""
    cases = {
        mesh: (world, (step_worker, argv_for(local_batch, extra)))
        for mesh, (world, local_batch, extra) in MESHES.items()
    }
    for degree in (2, 4):
        cases[f"attention {degree}"] = (degree, (allgather_attention_worker, degree))
        cases[f"ulysses attention {degree}"] = (degree, (ulysses_attention_worker, degree))
    cases["shard counts"] = (2, (cp_shard_counts_worker, CP2_ARGV))
    cases["bugs allgather_kv"] = (2, (cp_bug_worker, CP2_ARGV))
    cases["bugs ulysses"] = (2, (cp_bug_worker, CP2_ARGV + ULYSSES))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("degree", [2, 4])
def test_allgather_kv_attention_equals_full_attention(degree, launched):
    results = launched[f"attention {degree}"]
    q, k, v, upstream = (results[0][key] for key in ("q", "k", "v", "upstream"))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    expected = causal_attention(q, k, v)
    expected.backward(upstream)
    for r in results:
        torch.testing.assert_close(r["out"], expected[:, :, r["pos"]].detach(), rtol=1e-5, atol=1e-6)
        # K/V gradients come back through the reduce-scatter: every rank's queries contribute.
        for got, want in zip(r["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want[:, :, r["pos"]], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("degree", [2, 4])
def test_ulysses_attention_equals_full_attention(degree, launched):
    """Every rank, causal and masked, with and without replicated key/value heads."""
    for rank_errors in launched[f"ulysses attention {degree}"][0]["errors"]:
        assert set(rank_errors) == {(4, False), (4, True), (2, False), (2, True)}
        assert max(rank_errors.values()) < 1e-6, rank_errors


def test_kv_replication_is_the_fewest_copies_cp_divides():
    assert [kv_replication(kv, 4) for kv in (1, 2, 4, 8, 6)] == [4, 2, 1, 1, 2]
    assert kv_replication(3, 2) == 2
    # Llama 3 70B at tp=8: one key/value head per rank; cp=4 sends 4 copies of it.
    forward, backward = all_to_all_bytes(tokens=1024, heads=8, kv_heads=1, head_dim=128, degree=4, element_bytes=2)
    assert forward == backward == 1024 * (2 * 8 + 2 * 4) * 128 * 2 * 3 // 4


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_context_parallel_matches_single_process_reference(mesh, ref, launched):
    results = launched[mesh]
    assert_matches(results[0], ref)
    assert set(results[0]["writes"]) == {1}


def cp_shard_counts_worker(argv: list[str]) -> list[int]:
    _, job = trainer_for(argv)
    return [int((mb.labels != IGNORE_INDEX).sum()) for mb in fetch_step(job)]


@pytest.mark.slow
def test_padding_lands_unevenly_on_cp_shards(launched):
    counts = launched["shard counts"]
    assert counts[0] != counts[1]


def cp_bug_worker(argv: list[str]) -> dict:
    """Two CP bugs on the same data: tokens counted as if CP ranks held duplicates (count over
    data-parallel ranks only), and the gradient scaled by the CP degree."""
    p, job = trainer_for(argv)
    microbatches = fetch_step(job)
    sums_of(job).groups[Ranks.TOKENS] = job.meshes.batch.get_group()
    per_shard = forward_backward(job, microbatches)
    per_shard_grads = {name: full(prm.grad) for name, prm in job.model.named_parameters()}
    job.model.zero_grad(set_to_none=True)
    sums_of(job).groups[Ranks.TOKENS] = job.meshes.loss.get_group()
    right = forward_backward(job, microbatches)
    scaled = {name: full(prm.grad) * p.dims.cp for name, prm in job.model.named_parameters()}
    return {"per_shard": _summary(per_shard, per_shard_grads), "scaled": _summary(right, scaled)}


def _summary(result, grads: dict[str, torch.Tensor]) -> dict:
    return {"loss": result.loss_avg, "norm": result.grad_norm, "n": result.n_valid_tokens, "grads": grads}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["allgather_kv", "ulysses"])
def test_cp_bugs_are_caught(backend, ref, launched):
    result = launched[f"bugs {backend}"][0]
    assert result["per_shard"]["n"] < ref["n"]
    with pytest.raises(AssertionError):
        assert_matches(result["per_shard"], ref)
    with pytest.raises(AssertionError):
        assert_matches(result["scaled"], ref)


def test_validation_names_the_key():
    def message(argv: list[str], world: int) -> str:
        with pytest.raises(ConfigError) as error:
            resolve_job(load_config(BASE_ARGV + argv), world)
        return str(error.value)

    text = message(["--mesh", "cp=2,tp=2", "--training.seq_len", "60", "--training.local_batch_size", "8"], 4)
    assert "training.seq_len" in text and "8" in text
    text = message(
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.context_parallel_backend",
            "ring",
            "--training.local_batch_size",
            "8",
        ],
        2,
    )
    assert "context_parallel_backend" in text and "CUDA" in text
    text = message(
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--training.local_batch_size",
            "8",
            "--parallelism.context_parallel_rotate_method",
            "alltoall",
        ],
        2,
    )
    assert "context_parallel_rotate_method" in text
    text = message(["--training.seq_len", "60", "--parallelism.context_parallel_degree", "3", *ULYSSES], 3)
    assert "context_parallel_degree" in text and "tensor_parallel_degree" in text and "16 heads" in text
    text = message(
        ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method", "alltoall"]
        + ULYSSES,
        2,
    )
    assert "context_parallel_rotate_method" in text and "ulysses" in text


@pytest.mark.parametrize(
    "cp, tp, heads, kv_heads, ok",
    [(2, 2, 16, 8, True), (4, 2, 16, 2, True), (8, 1, 8, 1, True), (4, 2, 12, 4, False), (3, 1, 16, 8, False)],
)
def test_ulysses_needs_cp_times_tp_to_divide_the_heads(cp, tp, heads, kv_heads, ok):
    """Key/value heads never block Ulysses (they are replicated); query heads must split evenly."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, world_size=cp * tp)
    settings = ParallelSettings(seq_len=2 * cp * tp * 4, cp_backend="ulysses")
    shape = ModelShape(n_heads=heads, n_kv_heads=kv_heads, vocab_size=64 * tp)
    if ok:
        check(dims, settings, shape, "cpu")
    else:
        with pytest.raises(ParallelismError, match="ulysses"):
            check(dims, settings, shape, "cpu")
