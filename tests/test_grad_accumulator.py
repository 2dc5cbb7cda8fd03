"""The promise: for a fixed global batch, every mesh and accumulation count gives the same loss
and the same gradients as one process computing ``sum of token losses / N`` on the whole batch
(see ``harness.py``). Each classic bug is injected and shown to fail the same comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import (
    BASE_ARGV,
    TOLERANCE,
    argv_for,
    assert_matches,
    clipped,
    counting_hsdp_collectives,
    max_relative_error,
    passes_over,
    run_by_world,
    step_worker,
    trainer_for,
)
from step_helpers import fetch_step, forward_backward

from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.step.batches import MicroBatch
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.grad_sync import GradSync
from trainer.step.part import StepResult
from trainer.step.sums import StepSums

# name: (world size, local batch size, extra argv); accumulation = 8 / (local x dp)
MESHES = {
    "1 rank x 4 micro-batches": (1, 2, []),
    "FSDP 4 x 1": (4, 2, []),
    "FSDP 2 x 2": (2, 2, []),
    "HSDP (2,2) x 2": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2"]),
    "FSDP 2 x 2, deferred reduction": (2, 2, ["--training.defer_gradient_reduction"]),
}


def hsdp_argv(defer: bool) -> list[str]:
    argv = BASE_ARGV + [
        "--training.global_batch_size",
        "16",
        "--training.local_batch_size",
        "1",
        "--mesh",
        "dp_replicate=2,dp_shard=2",
    ]
    return argv + (["--training.defer_gradient_reduction"] if defer else [])


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    """Every multi-process case of this file, one launch per world size."""
    cases = {
        mesh: (world, (step_worker, argv_for(local_batch, extra)))
        for mesh, (world, local_batch, extra) in MESHES.items()
    }
    for defer in (False, True):
        cases[f"hsdp counts, defer={defer}"] = (4, (collective_count_worker, hsdp_argv(defer)))
    return run_by_world(cases)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_matches_single_process_reference(mesh, ref, launched):
    world = MESHES[mesh][0]
    results = launched[mesh]
    result = results[0]
    assert_matches(result, ref)
    # Each gradient is written exactly once by finalize: no second scaling pass.
    assert set(result["writes"]) == {1}
    # The data really is uneven, or this test could not tell the bugs apart.
    counts = [c for r in results for c in r["counts"]]
    assert len(set(counts)) > 1, counts
    assert sum(counts) == ref["n"]
    per_rank = [sum(r["counts"]) for r in results]
    if world > 1:
        assert len(set(per_rank)) > 1, per_rank
        assert result["loss_max"] > result["loss"]
    if "rank_mean_grads" in result:
        with pytest.raises(AssertionError):
            assert_matches({**result, "grads": clipped(result["rank_mean_grads"])}, ref)


def test_per_microbatch_mean_bug_is_caught(ref):
    """Hugging Face's old accumulation: mean per micro-batch, then mean of the means."""
    model = ref["model"]
    model.zero_grad(set_to_none=True)
    micro = 4
    for inputs, labels in zip(ref["inputs"].chunk(micro), ref["labels"].chunk(micro)):
        n = (labels != IGNORE_INDEX).sum()
        (cross_entropy_sum(model(inputs), labels) / n / micro).backward()
    buggy = clipped({k: prm.grad for k, prm in model.named_parameters()})
    assert max_relative_error(buggy, ref["grads"]) > 100 * TOLERANCE


def alone(model: torch.nn.Module, microbatches: int, max_norm: float, kind: type = GradAccumulator):
    """The step's parts that normalise the loss, on one process: an accumulator and FSDP's reduction."""
    sums = StepSums.alone()
    return kind(sums, GradSync(model, sums, microbatches=microbatches), microbatches=microbatches, max_norm=max_norm)


def test_second_scaling_pass_is_caught():
    """A two-pass finish (divide by N, then clip) writes each gradient twice."""

    class TwoPass(GradAccumulator):
        def finish(self, result):
            super().finish(result)
            torch._foreach_mul_([p.grad for p in self.reduction.model.parameters()], 1.0)

    model = torch.nn.Linear(4, 3)
    for kind, expected in ((GradAccumulator, 1), (TwoPass, 2)):
        acc = alone(model, microbatches=2, max_norm=1.0, kind=kind)
        labels = [torch.tensor([0, 1, IGNORE_INDEX]), torch.tensor([2, IGNORE_INDEX, IGNORE_INDEX])]
        acc.begin([MicroBatch(lab, lab, None, None) for lab in labels])
        for i, lab in enumerate(labels):
            loss = cross_entropy_sum(model(torch.randn(1, 3, 4)), lab.view(1, 3))
            loss.backward()
            acc.after_backward(i, loss)
        grads = [p.grad for p in model.parameters()]
        before = [g._version for g in grads]
        acc.finish(StepResult())
        assert passes_over(grads, before) == [expected] * 2
        model.zero_grad(set_to_none=True)


def test_unclipped_and_single_microbatch_also_scale_once():
    """max_norm <= 0 and accumulation 1 still normalise with exactly one multiply."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inputs, labels = torch.randn(1, 5, 4), torch.tensor([[0, 1, IGNORE_INDEX, 2, IGNORE_INDEX]])
    acc = alone(model, microbatches=1, max_norm=0.0)
    acc.begin([MicroBatch(inputs, labels, None, None)])
    loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    acc.after_backward(0, loss)
    raw = [p.grad.clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    before = [g._version for g in grads]
    result = StepResult()
    acc.finish(result)
    assert passes_over(grads, before) == [1, 1]
    for g, r in zip((p.grad for p in model.parameters()), raw):
        torch.testing.assert_close(g, r / 3)
    assert result.n_valid_tokens == 3 and not result.skipped
    assert result.loss_avg == pytest.approx(loss.item() / 3)


@pytest.mark.parametrize("bad", ["all_masked", "nan"])
def test_degenerate_step_is_skipped_and_counted(bad, caplog):
    model = torch.nn.Linear(4, 3)
    acc = alone(model, microbatches=1, max_norm=1.0)
    labels = torch.full((1, 3), IGNORE_INDEX) if bad == "all_masked" else torch.tensor([[0, 1, 2]])
    inputs = torch.randn(1, 3, 4)
    if bad == "nan":
        inputs[0, 0, 0] = math.nan
    acc.begin([MicroBatch(inputs, labels, None, None)])
    loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    acc.after_backward(0, loss)
    result = StepResult()
    with caplog.at_level("WARNING", logger="meshtrain"):
        acc.finish(result)
    assert result.skipped
    assert "skipping the optimizer step" in caplog.text
    assert result.n_valid_tokens == (0 if bad == "all_masked" else 3)


def collective_count_worker(argv: list[str]) -> dict[str, int]:
    """Count FSDP's reduce-scatters and cross-replica all-reduces over one HSDP step."""
    p, job = trainer_for(argv)
    with counting_hsdp_collectives(job) as counts:
        forward_backward(job, fetch_step(job))
    groups = {
        id(m._get_fsdp_state()._fsdp_param_group)
        for m in job.model.modules()
        if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None
    }
    counts["units"] = len(groups)
    counts["microbatches"] = p.microbatches
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True])
def test_hsdp_all_reduces_once_per_step(defer, launched):
    counts = launched[f"hsdp counts, defer={defer}"][0]
    assert counts["microbatches"] == 4
    assert counts["units"] >= 8  # embedding, 6 blocks, norm+output
    assert counts["all_reduce_replicate"] == counts["units"]
    per_step = 1 if defer else counts["microbatches"]
    assert counts["reduce_scatter"] == counts["units"] * per_step
