"""The promise: for a fixed global batch, every mesh and accumulation count gives the same loss
and the same gradients as one process computing ``sum of token losses / N`` on the whole batch.

The data is ``shakespeare_dialogue``: prompts and padding are masked, so valid-token counts
differ between micro-batches and ranks (checked below), which is what makes the classic bugs
visible. Each bug is injected and shown to fail the same comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from multiprocess import run_ranks
from trainer.config import load_config
from trainer.data.loader import GlobalOrder
from trainer.grad_accumulator import GradAccumulator
from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model import Transformer
from trainer.train import build_job, fetch_step, forward_backward, plan

GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the debug model's initial true grad norm, so clipping is exercised
TOLERANCE = 5e-6

BASE_ARGV = [
    "--training.dataset", "shakespeare_dialogue",
    "--training.seq_len", "64",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.max_norm", str(MAX_NORM),
    "--training.steps", "1",
    "--debug.seed", "7",
    "--metrics.enable_tensorboard=false",
]

# name: (world size, local batch size, extra argv); accumulation = 8 / (local x dp)
MESHES = {
    "1 rank x 4 micro-batches": (1, 2, []),
    "FSDP 4 x 1": (4, 2, []),
    "FSDP 2 x 2": (2, 2, []),
    "HSDP (2,2) x 2": (4, 1, ["--mesh", "dp_replicate=2,dp_shard=2"]),
    "FSDP 2 x 2, deferred reduction": (2, 2, ["--training.defer_gradient_reduction"]),
}


def argv_for(local_batch_size: int, extra: list[str]) -> list[str]:
    return BASE_ARGV + ["--training.local_batch_size", str(local_batch_size)] + extra


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference(argv: list[str]):
    """One process, no sharding, no accumulation: the definition of the right answer."""
    p = plan(load_config(argv), world_size=1)
    model = Transformer(p.model_args)
    model.init_weights(p.config.debug.seed)
    samples = [p.dataset[i] for i in GlobalOrder(len(p.dataset), GLOBAL_BATCH, p.config.debug.seed).batch(0)]
    inputs = torch.stack([s[0] for s in samples])
    labels = torch.stack([s[1] for s in samples])
    n = int((labels != IGNORE_INDEX).sum())
    loss = cross_entropy_sum(model(inputs), labels) / n
    loss.backward()
    grads = {name: prm.grad.detach().clone() for name, prm in model.named_parameters()}
    norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().float()
    coef = min(1.0, MAX_NORM / (norm.item() + 1e-6))
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "n": n,
        "grads": {k: g * coef for k, g in grads.items()},
        "unclipped": grads,
        "labels": labels,
        "model": model,
        "inputs": inputs,
    }


@pytest.fixture(scope="module")
def ref():
    return reference(argv_for(GLOBAL_BATCH, []))


def max_relative_error(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert grads.keys() == expected.keys()
    return max(((grads[k] - expected[k]).norm() / expected[k].norm()).item() for k in expected)


def assert_matches(result: dict, ref: dict) -> None:
    assert result["n"] == ref["n"]
    assert result["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE)
    assert result["norm"] == pytest.approx(ref["norm"], rel=TOLERANCE)
    assert max_relative_error(result["grads"], ref["grads"]) < TOLERANCE


def step_worker(argv: list[str]) -> dict | None:
    """One training step through the trainer's own code; rank 0 returns the full gradients."""
    import os

    p = plan(load_config(argv), int(os.environ["WORLD_SIZE"]))
    job = build_job(p)
    params = [prm for prm in job.model.parameters()]
    finalize = job.accumulator.finalize
    writes: list[int] = []

    def counting_finalize():
        locals_ = [prm.grad._local_tensor for prm in params]
        before = [t._version for t in locals_]
        out = finalize()
        writes.extend(passes_over(locals_, before))
        return out

    job.accumulator.finalize = counting_finalize
    microbatches = fetch_step(job)
    result = forward_backward(job, microbatches)
    grads = {name: full(prm.grad) for name, prm in job.model.named_parameters()}
    counts = [int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches]
    out = {
        "loss": result.loss_avg,
        "loss_max": result.loss_max,
        "norm": result.grad_norm,
        "n": result.n_valid_tokens,
        "grads": grads,
        "counts": counts,
        "writes": writes,
    }
    if p.dims.dp_replicate == 1 and p.dims.dp > 1 and p.dims.tp == 1:
        out["rank_mean_grads"] = per_rank_mean_then_average(job, microbatches)
    return out if dist.get_rank() == 0 else {"counts": counts}


def passes_over(tensors: list[torch.Tensor], versions_before: list[int]) -> list[int]:
    """How many times each tensor was written in place since ``versions_before``.

    Views of one buffer (FSDP keeps a parameter group's gradients in one) share a version
    counter, so one pass over n such views adds n to each view's version.
    """
    sharing: dict[int, int] = {}
    for t in tensors:
        sharing[t.untyped_storage().data_ptr()] = sharing.get(t.untyped_storage().data_ptr(), 0) + 1
    return [
        (t._version - before) / sharing[t.untyped_storage().data_ptr()]
        for t, before in zip(tensors, versions_before)
    ]


def per_rank_mean_then_average(job, microbatches) -> dict[str, torch.Tensor]:
    """The DDP/FSDP-default bug: each rank normalises by its own tokens, ranks are averaged."""
    job.model.zero_grad(set_to_none=True)
    local_n = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
    for i, (inputs, labels) in enumerate(microbatches):
        job.model.set_is_last_backward(i == len(microbatches) - 1)
        (cross_entropy_sum(job.model(inputs), labels) / local_n / dist.get_world_size()).backward()
    return {name: full(prm.grad) for name, prm in job.model.named_parameters()}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_matches_single_process_reference(mesh, ref):
    world, local_batch, extra = MESHES[mesh]
    results = run_ranks(step_worker, world, argv_for(local_batch, extra))
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
            assert_matches({**result, "grads": _clipped(result["rank_mean_grads"])}, ref)


def _clipped(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().item()
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    return {k: g * coef for k, g in grads.items()}


def test_per_microbatch_mean_bug_is_caught(ref):
    """Hugging Face's old accumulation: mean per micro-batch, then mean of the means."""
    model = ref["model"]
    model.zero_grad(set_to_none=True)
    micro = 4
    for inputs, labels in zip(ref["inputs"].chunk(micro), ref["labels"].chunk(micro)):
        n = (labels != IGNORE_INDEX).sum()
        (cross_entropy_sum(model(inputs), labels) / n / micro).backward()
    buggy = _clipped({k: prm.grad for k, prm in model.named_parameters()})
    assert max_relative_error(buggy, ref["grads"]) > 100 * TOLERANCE


def test_second_scaling_pass_is_caught():
    """A two-pass finalize (divide by N, then clip) writes each gradient twice."""

    class TwoPass(GradAccumulator):
        def finalize(self):
            result = super().finalize()
            torch._foreach_mul_([p.grad for p in self.model.parameters()], 1.0)
            return result

    model = torch.nn.Linear(4, 3)
    for cls, expected in ((GradAccumulator, 1), (TwoPass, 2)):
        acc = cls(model, loss_group=None, num_microbatches=2, max_norm=1.0, hsdp=False)
        labels = [torch.tensor([0, 1, IGNORE_INDEX]), torch.tensor([2, IGNORE_INDEX, IGNORE_INDEX])]
        acc.begin_step(labels)
        for i, lab in enumerate(labels):
            acc.prepare_backward(i)
            loss = cross_entropy_sum(model(torch.randn(1, 3, 4)), lab.view(1, 3))
            loss.backward()
            acc.record_loss(loss)
        grads = [p.grad for p in model.parameters()]
        before = [g._version for g in grads]
        acc.finalize()
        assert passes_over(grads, before) == [expected] * 2
        model.zero_grad(set_to_none=True)


def test_unclipped_and_single_microbatch_also_scale_once():
    """max_norm <= 0 and accumulation 1 still normalise with exactly one multiply."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inputs, labels = torch.randn(1, 5, 4), torch.tensor([[0, 1, IGNORE_INDEX, 2, IGNORE_INDEX]])
    acc = GradAccumulator(model, loss_group=None, num_microbatches=1, max_norm=0.0, hsdp=False)
    acc.begin_step([labels])
    acc.prepare_backward(0)
    loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    acc.record_loss(loss)
    raw = [p.grad.clone() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    before = [g._version for g in grads]
    result = acc.finalize()
    assert passes_over(grads, before) == [1, 1]
    for g, r in zip((p.grad for p in model.parameters()), raw):
        torch.testing.assert_close(g, r / 3)
    assert result.n_valid_tokens == 3 and not result.skipped
    assert result.loss_avg == pytest.approx(loss.item() / 3)


@pytest.mark.parametrize("bad", ["all_masked", "nan"])
def test_degenerate_step_is_skipped_and_counted(bad, caplog):
    model = torch.nn.Linear(4, 3)
    acc = GradAccumulator(model, loss_group=None, num_microbatches=1, max_norm=1.0, hsdp=False)
    labels = torch.full((1, 3), IGNORE_INDEX) if bad == "all_masked" else torch.tensor([[0, 1, 2]])
    inputs = torch.randn(1, 3, 4)
    if bad == "nan":
        inputs[0, 0, 0] = math.nan
    acc.begin_step([labels])
    acc.prepare_backward(0)
    loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    acc.record_loss(loss)
    with caplog.at_level("WARNING", logger="meshtrain"):
        result = acc.finalize()
    assert result.skipped and acc.n_skipped_steps == 1
    assert "skipping the optimizer step" in caplog.text
    assert result.n_valid_tokens == (0 if bad == "all_masked" else 3)


def collective_count_worker(argv: list[str]) -> dict[str, int]:
    """Count FSDP's reduce-scatters and cross-replica all-reduces over one HSDP step."""
    import os

    p = plan(load_config(argv), int(os.environ["WORLD_SIZE"]))
    job = build_job(p)
    replicate_group = job.meshes.world["dp_replicate"].get_group()
    counts = {"all_reduce_replicate": 0, "reduce_scatter": 0}
    originals = {}

    def wrap(name, key, predicate):
        original = getattr(dist, name)
        originals[name] = original

        def counted(*args, **kwargs):
            if predicate(kwargs):
                counts[key] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_reduce", "all_reduce_replicate", lambda kw: kw.get("group") is replicate_group)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            wrap(name, "reduce_scatter", lambda kw: True)
    try:
        forward_backward(job, fetch_step(job))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    groups = {id(m._get_fsdp_state()._fsdp_param_group) for m in job.model.modules()
              if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None}
    counts["units"] = len(groups)
    counts["microbatches"] = p.microbatches
    return counts


@pytest.mark.parametrize("defer", [False, True])
def test_hsdp_all_reduces_once_per_step(defer):
    argv = BASE_ARGV + ["--training.global_batch_size", "16", "--training.local_batch_size", "1",
                        "--mesh", "dp_replicate=2,dp_shard=2"]
    argv += ["--training.defer_gradient_reduction"] if defer else []
    counts = run_ranks(collective_count_worker, 4, argv)[0]
    assert counts["microbatches"] == 4
    assert counts["units"] >= 8  # embedding, 6 blocks, norm+output
    assert counts["all_reduce_replicate"] == counts["units"]
    per_step = 1 if defer else counts["microbatches"]
    assert counts["reduce_scatter"] == counts["units"] * per_step
