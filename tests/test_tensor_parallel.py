"""Tensor parallelism (sequence parallel, loss parallel) alone and composed with FSDP/HSDP
gives the single-process reference's loss and gradients, and each TP-specific bug is caught."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import BASE_ARGV, argv_for, assert_matches, full, run_by_world, step_worker, trainer_for
from step_helpers import fetch_step, forward_backward, sums_of
from torch.distributed.tensor import DTensor, Shard

from parallelisms import parallelize
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.parallelize import ModelShape, ParallelSettings
from trainer.config import ConfigError, load_config
from trainer.model.llama3 import padded_vocab_size
from trainer.planning.job_plan import SETTING_KEYS, resolve_job
from trainer.step.sums import Ranks

# name: (world size, local batch size, extra argv); global batch 8
MESHES = {
    "tp=2": (2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp=2, gathered logits": (
        2,
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"],
    ),
    "dp_shard=2 x tp=2, 2 micro-batches": (4, 2, ["--mesh", "dp_shard=2,tp=2"]),
    "dp_replicate=2 x dp_shard=2 x tp=2": (8, 1, ["--mesh", "dp_replicate=2,dp_shard=2,tp=2"]),
}


LOGITS_ARGV = argv_for(4, ["--parallelism.tensor_parallel_degree", "2"])
BF16_ARGV = argv_for(4, ["--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"])


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    """Every multi-process case of this file, one launch per world size."""
    cases = {
        mesh: (world, (step_worker, argv_for(local_batch, extra)))
        for mesh, (world, local_batch, extra) in MESHES.items()
    }
    gathered = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"]
    cases["logits gathered"] = (2, (logits_worker, argv_for(4, gathered)))
    cases["bf16"] = (2, (logits_worker, BF16_ARGV))
    cases["bugs"] = (4, (tp_bug_worker, argv_for(2, ["--mesh", "dp_shard=2,tp=2"])))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_tensor_parallel_matches_single_process_reference(mesh, ref, launched):
    results = launched[mesh]
    assert_matches(results[0], ref)
    assert set(results[0]["writes"]) == {1}  # one scaling pass, also over TP shards


def logits_worker(argv: list[str]) -> dict:
    """The logits a TP rank holds, and the dtype the matmuls run in."""
    p, job = trainer_for(argv)
    seen: dict[str, torch.dtype] = {}
    wq = job.model.layers["0"].attention.wq

    def record_dtype(module, args):
        seen.setdefault("wq_weight", module.weight.dtype)

    wq.register_forward_pre_hook(record_dtype)
    inputs = fetch_step(job)[0].inputs
    logits = job.model(inputs)
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    return {
        "is_dtensor": isinstance(logits, DTensor),
        "placements": tuple(logits.placements) if isinstance(logits, DTensor) else None,
        "local_shape": tuple(local.shape),
        "vocab": p.model_args.vocab_size,
        "wq_dtype": seen["wq_weight"],
        "param_dtype": wq.weight.dtype,
    }


@pytest.mark.slow
def test_loss_parallel_keeps_one_vocabulary_slice_per_rank(launched):
    # Loss parallel shards the logits whatever the compute dtype: the bf16 case shows it.
    sharded, gathered = launched["bf16"], launched["logits gathered"]
    vocab = sharded[0]["vocab"]
    for rank in sharded:
        assert rank["is_dtensor"] and rank["placements"] == (Shard(2),)
        assert rank["local_shape"] == (4, 64, vocab // 2)  # 1/tp of the logits' memory
    for rank in gathered:
        assert not rank["is_dtensor"]
        assert rank["local_shape"] == (4, 64, vocab)


@pytest.mark.slow
def test_mixed_precision_applies_with_tensor_parallel_alone(launched):
    """FSDP always wraps the model (over a 1-rank mesh when dp = 1), so bf16 compute needs no
    fallback: parameters are stored in float32 and gathered in bfloat16 for the matmuls."""
    for rank in launched["bf16"]:
        assert rank["wq_dtype"] == torch.bfloat16
        assert rank["param_dtype"] == torch.float32


def tp_bug_worker(argv: list[str]) -> dict:
    """The right step, then two TP bugs on the same data: a grad norm that sums every rank's
    local shards (replicated ones tp times), and tokens counted over the TP group too."""
    _, job = trainer_for(argv)
    microbatches = fetch_step(job)
    right = forward_backward(job, microbatches)
    true_sq = sum(full(prm.grad).double().square().sum() for prm in job.model.parameters())
    naive_sq = sum(prm.grad.to_local().double().square().sum() for prm in job.model.parameters())
    dist.all_reduce(naive_sq)
    job.model.zero_grad(set_to_none=True)
    sums_of(job).groups[Ranks.TOKENS] = dist.group.WORLD  # counts every TP rank's copy of the tokens
    over_counted = forward_backward(job, microbatches)
    grads = {name: full(prm.grad) for name, prm in job.model.named_parameters()}
    return {
        "right_norm": right.grad_norm,
        "true_norm_after_step": true_sq.sqrt().item(),
        "naive_norm_after_step": naive_sq.sqrt().item(),
        "over_counted": {
            "loss": over_counted.loss_avg,
            "norm": over_counted.grad_norm,
            "n": over_counted.n_valid_tokens,
            "grads": grads,
        },
    }


@pytest.mark.slow
def test_tp_bugs_are_caught(ref, launched):
    result = launched["bugs"][0]
    assert result["right_norm"] == pytest.approx(ref["norm"], rel=5e-6)
    # Replicated parameters (the norms' weights) counted once per TP rank inflate the norm.
    assert result["naive_norm_after_step"] > result["true_norm_after_step"] * (1 + 1e-4)
    # Tokens summed over TP ranks double N: the comparison with the reference fails.
    assert result["over_counted"]["n"] == 2 * ref["n"]
    with pytest.raises(AssertionError):
        assert_matches(result["over_counted"], ref)


def test_validation_names_the_tensor_parallel_key():
    def check(argv: list[str], world: int) -> str:
        with pytest.raises(ConfigError) as error:
            resolve_job(load_config(BASE_ARGV + argv), world)
        return str(error.value)

    message = check(["--parallelism.tensor_parallel_degree", "3", "--training.local_batch_size", "8"], 3)
    assert "parallelism.tensor_parallel_degree" in message and "16 attention heads" in message
    message = check(
        ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63", "--training.local_batch_size", "8"], 2
    )
    assert "training.seq_len" in message
    message = check(
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "8",
            "--parallelism.enable_async_tensor_parallel",
            "--compile.enable",
        ],
        2,
    )
    assert "CUDA" in message
    message = check(
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "8",
            "--parallelism.enable_async_tensor_parallel",
        ],
        2,
    )
    assert "compile.enable" in message
    message = check(["--training.local_batch_size", "8", "--parallelism.enable_async_tensor_parallel"], 1)
    assert "parallelism.tensor_parallel_degree" in message
    shape = ModelShape(n_heads=16, n_kv_heads=8, vocab_size=100)
    with pytest.raises(ParallelismError, match="tp = 8 does not divide the 100 vocabulary rows") as error:
        parallelize.check(ParallelDims(1, 1, 1, 8, 8), ParallelSettings(seq_len=64), shape, "cpu")
    assert "`parallelism.tensor_parallel_degree` = 8" in error.value.render(SETTING_KEYS)


def test_vocabulary_is_padded_the_same_on_every_mesh():
    assert padded_vocab_size(2048) == 2048
    assert padded_vocab_size(32000) == 32000
    assert padded_vocab_size(2001) == 2048
    assert padded_vocab_size(1) == 64
