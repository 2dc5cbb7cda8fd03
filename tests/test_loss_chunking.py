"""``training.loss_chunk_tokens``: ``auto`` chunks the loss only where the whole logits would not
fit, a number the user sets is kept, and the plan (``--dry-run``, the start report) says which
and why. That chunking changes the loss only by round-off is ``test_loss.py``'s."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import run_train

from trainer.config import load_config
from trainer.planning.held_for_speed import GATHERED_EXPERTS_SHARE, HELD_FORWARDS_SHARE, fitted
from trainer.planning.job_plan import resolve_job
from trainer.planning.loss_chunking import AUTO_CHUNK_TOKENS, FIT_FRACTION
from trainer.planning.memory_limits import TARGET_MEMORY_BYTES
from trainer.planning.memory_plan import estimate
from trainer.planning.workload import Workload

H100 = TARGET_MEMORY_BYTES["h100"]
EIGHT_B = ["--config", "llama3_8b.toml"]


def _plan(argv: list[str], world: int, limit: int | None):
    return resolve_job(load_config(argv), world, "cuda", limit=limit)


def _whole(argv: list[str], world: int) -> int:
    return _plan([*argv, "--training.loss_chunk_tokens", "0"], world, None).memory.total


@pytest.mark.parametrize("world", [1, 8])
def test_auto_chunks_exactly_when_the_whole_logits_would_not_fit(world):
    """The 8B preset: on one H100 the whole logits do not fit, on eight they do; at a
    limit just above and just below 1/0.9 of the whole-logits job the decision flips."""
    whole = _whole(EIGHT_B, world)
    plan = _plan(EIGHT_B, world, H100)
    expected = 0 if whole <= FIT_FRACTION * H100 else AUTO_CHUNK_TOKENS
    assert plan.loss_chunking.tokens == expected == plan.workload.loss_chunk_tokens
    assert (world == 8) == (expected == 0)
    edge = whole / FIT_FRACTION
    assert _plan(EIGHT_B, world, int(edge) + 1).loss_chunking.tokens == 0
    chunked = _plan(EIGHT_B, world, int(edge) - 1)
    assert chunked.loss_chunking.tokens == AUTO_CHUNK_TOKENS
    assert chunked.memory.total < whole  # the estimate counts one chunk's logits
    assert "auto" in chunked.loss_chunking.why and "would need" in chunked.loss_chunking.why


@pytest.mark.parametrize("setting", [0, 512])
def test_a_number_the_user_sets_is_kept_whatever_the_memory(setting):
    argv = [*EIGHT_B, "--training.loss_chunk_tokens", str(setting)]
    for limit in (None, 10**9, 10**13):
        chunking = _plan(argv, 1, limit).loss_chunking
        assert chunking.tokens == setting and "as set" in chunking.why


def test_without_a_known_limit_auto_chunks_and_without_the_loss_in_the_model_nothing_does():
    assert _plan(EIGHT_B, 8, None).loss_chunking.tokens == AUTO_CHUNK_TOKENS
    gathered = _plan([*EIGHT_B, "--mesh", "dp_shard=4,tp=2", "--parallelism.disable_loss_parallel"], 8, H100)
    assert gathered.loss_chunking.tokens == 0 and "tensor parallelism" in gathered.loss_chunking.why


@pytest.mark.launcher
def test_dry_run_and_the_start_report_say_whether_the_loss_is_chunked(tmp_path):
    """The 8B preset's ``--dry-run`` on its 8 H100s, and a run's start report (rank 0's log)."""
    dry = run_train(8, ["--config", "llama3_8b.toml", "--dry-run", "--target-gpu", "h100"])
    assert "loss: unchunked (whole logits): auto: with the whole logits the job needs" in dry.stdout, dry.stdout
    args = ["--training.steps", "1", "--validation.enable=false", "--job.dump_folder", str(tmp_path)]
    run = run_train(1, [*args, "--training.loss_chunk_tokens", "48"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loss: chunked, 48 tokens a chunk: `training.loss_chunk_tokens` = 48 as set" in run.stdout + run.stderr


@pytest.mark.parametrize("limit", [None, 10**9, 10**13])
def test_on_the_cpu_auto_chunks_whatever_memory_is_free(limit):
    """The CPU's limit is the memory free when a rank starts: a decision by it could differ
    between ranks, or between a run and its resume, and round the same job differently."""
    chunking = resolve_job(load_config([]), 1, "cpu", limit=limit).loss_chunking
    assert chunking.tokens == AUTO_CHUNK_TOKENS and "CPU" in chunking.why


def test_exact_moe_balancing_under_full_checkpointing_chunks_where_its_held_forwards_fit():
    """The Qwen3-30B-A3B preset (full AC, ``global_batch`` scope) on 8 GPUs: where the step's
    held block inputs fit, chunked, since its own forwards count the routing only with the loss
    in chunks; on its 8 H100s they do not (the pre-pass counts), and with the ``micro_batch``
    scope there is nothing to hold: memory decides."""
    preset = ["--config", "qwen3_30b_a3b.toml"]
    exact = _plan(preset, 8, 4 * H100)
    assert exact.loss_chunking.tokens == AUTO_CHUNK_TOKENS and "exact MoE balancing" in exact.loss_chunking.why
    assert exact.workload.holds_forwards
    assert "exact MoE balancing" not in _plan(preset, 8, H100).loss_chunking.why
    per_microbatch = _plan([*preset, "--moe.balance_loss_scope", "micro_batch"], 8, 4 * H100)
    assert per_microbatch.loss_chunking.tokens == 0 and "within" in per_microbatch.loss_chunking.why


def test_held_forwards_keep_their_loss_gradients_where_they_fit():
    """The held forwards of exact balancing compute their loss's gradients at once, keeping the
    output weight's gradient per micro-batch, without tensor parallelism (whose output weight is
    a DTensor); where that alone does not fit, the chunks' logits are recomputed in backward
    instead; where the held forwards do not fit on the GPU they wait in host memory, and where
    that does not fit either, the pre-pass counts. Routed experts over one rank (ep 8 = dp_shard),
    kept gathered through the step, are given up before each."""
    preset = ["--config", "qwen3_30b_a3b.toml"]
    held = _plan(preset, 8, 4 * H100).workload
    assert held.holds_loss_gradients and held.accumulation > 1
    tp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4"]
    tensor_parallel = _plan([*preset, *tp], 8, 4 * H100).workload
    assert tensor_parallel.holds_forwards and not tensor_parallel.holds_loss_gradients
    recomputed = replace(held, hold_loss_gradients=False)
    gradients = held.accumulation * held.vocab_size * held.dim * held.compute_bytes
    assert estimate(held).activations - estimate(recomputed).activations >= gradients - 2 * held.dim * held.vocab_size
    assert fitted(held, 4 * H100) == held and held.experts_stay_gathered

    def limit(w: Workload) -> int:
        """The memory ``w`` just fits in, the experts kept gathered within their own share."""
        return int(estimate(w).total / (GATHERED_EXPERTS_SHARE if w.experts_stay_gathered else HELD_FORWARDS_SHARE)) + 1

    resharded = replace(held, gathers_one_rank_experts=False)
    assert fitted(held, limit(resharded)) == resharded and not resharded.experts_stay_gathered
    both = replace(recomputed, gathers_one_rank_experts=False)
    assert fitted(held, limit(both)) == both and both.holds_forwards
    # The preset on an H100: 71.0 GiB with the experts gathered, over 85% of its 79.2; every
    # forward held on the GPU, over 90%; held in host memory (two micro-batches on the GPU), within.
    host = replace(resharded, offload_forwards=True)
    assert fitted(held, H100) == host and host.offloads_forwards and host.holds_loss_gradients
    block_inputs = held.n_layers * held.local_batch_size * held.seq_len * held.dim * held.compute_bytes
    assert estimate(resharded).total - estimate(host).total >= (held.accumulation - 2) * block_inputs
    # Where those do not fit either, the pre-pass counts.
    prepass = replace(both, hold_forwards=False)
    assert fitted(held, limit(prepass)) == prepass and not prepass.holds_forwards
    # A choice the user made stays (the memory check may refuse it); on a CPU the host is the device.
    chosen = replace(held, fit_held_forwards=False)
    assert fitted(chosen, H100).holds_forwards and not fitted(chosen, H100).offloads_forwards
    assert not fitted(replace(held, device="cpu"), H100).offloads_forwards
