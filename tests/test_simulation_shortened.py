"""``--simulate`` traces a few of a step's micro-batches (``trainer/simulation/microbatches.py``):
each rank's peak, and its FLOPs, memory traffic and collectives once extended, must be what
tracing every micro-batch gives, for gradient accumulation (of a Mixture-of-Experts whose exact
balancing runs a counting pre-pass: each micro-batch's forward twice, the first ones all before
the first backward; or holds its forwards in host memory until the backwards) and for 1F1B,
whose pipeline ranks each trace a count of their own."""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import pytest
import torch
from simulation_helpers import CONFIGS

from parallelisms.torch_private import pipelining
from trainer.entry.simulate import simulate_roles
from trainer.simulation.cost_model import Collective
from trainer.simulation.fake_job import create_adamw_state
from trainer.simulation.microbatches import rank_count, schedule_count, traced_count
from trainer.simulation.step_time import step_time
from trainer.simulation.targets import target_named

SEQ = ["--training.seq_len", "64"]
EXACT_MOE = ["--config", str(CONFIGS / "debug_moe.toml"), "--moe.balance_loss_scope", "global_batch"]
MOE_PREPASS = [*EXACT_MOE, "--moe.held_forwards", "prepass"]
HELD_ON_HOST = [*EXACT_MOE, "--moe.held_forwards", "host", "--activation_checkpoint.mode", "full"]
HELD_ON_HOST += ["--training.seq_len", "4096", "--training.loss_chunk_tokens", "1024"]
PIPELINE_BATCH = ["--training.local_batch_size", "8", "--training.global_batch_size", "16"]
TARGET = target_named("h100", {}, 8)
CASES = {
    # name: (ranks, arguments); every case runs 6 or 8 micro-batches a step
    "accumulation": (2, [*MOE_PREPASS, "--training.local_batch_size", "2", "--training.global_batch_size", "24"]),
    "1F1B": (8, ["--parallelism.pipeline_parallel_degree", "4", *PIPELINE_BATCH]),
    # Each block's input (4096 tokens of 256 values) large enough to move (``host_offload.MIN_BYTES``).
    "held in host memory": (
        2,
        [*HELD_ON_HOST, "--training.local_batch_size", "1", "--training.global_batch_size", "12"],
    ),
}


def _roles(nproc: int, args: list[str], shorten: bool):
    with contextlib.redirect_stderr(io.StringIO()):
        return simulate_roles(args, nproc, 1, TARGET, shorten=shorten)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_shortened_step_has_the_peak_and_cost_of_the_whole_step(case, tmp_path):
    nproc, args = CASES[case]
    if case == "1F1B" and not pipelining.shortened_trace_checked():
        pytest.skip(f"torch {torch.__version__}: pipeline simulations trace every micro-batch (microbatches.py)")
    args = ["--job.dump_folder", str(tmp_path), *SEQ, *args]
    plan, whole = _roles(nproc, args, shorten=False)
    _, short = _roles(nproc, args, shorten=True)
    real = schedule_count(plan)
    assert real >= 6 and all(r.traced_microbatches == real for r in whole)
    assert all(r.traced_microbatches < real for r in short), [r.traced_microbatches for r in short]
    # The step's token ids and labels, one int64 tensor each per sample, are all the memory the
    # traced step holds for fewer micro-batches than the whole one; the token count over them
    # is traffic it does not extend.
    microbatch_ids = 2 * 8 * plan.parallel.pp_microbatch_size * plan.config.training.seq_len
    for full, part in zip(whole, short):
        stage = f"pipeline rank {full.pp_rank}"
        assert 0 <= full.memory.peak_bytes - part.memory.peak_bytes <= real * microbatch_ids, stage
        assert part.memory.peak_phase == full.memory.peak_phase, stage
        # Exact but for a FLOP per micro-batch: the last stage adds up its micro-batches' losses,
        # n - 1 additions, which no extension linear in the micro-batches reproduces.
        assert abs(part.cost.flops - full.cost.flops) <= real, stage
        assert set(part.cost.flops_by_kind) == set(full.cost.flops_by_kind), stage
        for kind, flops in full.cost.flops_by_kind.items():
            assert abs(part.cost.flops_by_kind[kind] - flops) <= real, (stage, kind)
        assert part.cost.fused_bytes == pytest.approx(full.cost.fused_bytes, rel=1e-2), stage
        assert part.cost.memory_bytes == pytest.approx(full.cost.memory_bytes, rel=1e-2), stage
        assert part.cost.host_bytes == full.cost.host_bytes, stage
        times = [step_time(r.cost, TARGET, plan.dims.pp, "1F1B", 1, real) for r in (part, full)]
        assert times[0].step_s == pytest.approx(times[1].step_s, rel=1e-2), stage
        exact, fsdp = _timed(part.cost.collectives), _timed(full.cost.collectives)
        if case != "1F1B":
            assert exact == fsdp, stage
        else:  # FSDP's gathers are close (microbatches.py); the pipeline's transfers exact
            assert part.cost.comm_bytes()["pp"] == pytest.approx(full.cost.comm_bytes()["pp"], rel=1e-5), stage
            assert part.cost.comm_bytes()["dp_shard_cp"] == pytest.approx(
                full.cost.comm_bytes()["dp_shard_cp"], rel=0.05
            ), stage


def _timed(collectives: list[Collective]) -> dict[tuple, float]:
    """What the step time counts of the collectives (a receive costs its sender's time): how
    many times the step runs each kind, on each dimension, of each size."""
    times: Counter = Counter()
    for c in collectives:
        if c.kind != "recv":
            times[(c.kind, c.dim, c.size, c.bus_bytes)] += c.times
    return {key: round(n, 9) for key, n in times.items()}


@pytest.mark.fast
def test_ranks_trace_what_their_schedule_needs(tmp_path, monkeypatch):
    from trainer.config import load_config
    from trainer.planning.job_plan import resolve_job as make_plan

    def planned(nproc: int, *args: str):
        return make_plan(load_config(["--job.dump_folder", str(tmp_path), *SEQ, *args]), nproc)

    monkeypatch.setattr(torch, "__version__", "2.14.1")
    one_f_one_b = planned(8, *CASES["1F1B"][1], "--training.global_batch_size", "32")
    assert schedule_count(one_f_one_b) == 16 and traced_count(one_f_one_b) == 5
    assert [rank_count(one_f_one_b, r) for r in range(4)] == [5, 4, 3, 3]
    # Where the shortened trace was not checked against the whole one, every rank traces all.
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    assert traced_count(one_f_one_b) == 16 and [rank_count(one_f_one_b, r) for r in range(4)] == [16] * 4
    for schedule in ("GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
        whole = planned(8, *CASES["1F1B"][1], "--parallelism.pipeline_parallel_schedule", schedule)
        assert traced_count(whole) == rank_count(whole, 0) == schedule_count(whole) == 8, schedule
    accumulation = planned(2, *CASES["accumulation"][1])
    assert schedule_count(accumulation) == 6 and traced_count(accumulation) == 4


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["foreach", "fused", "amsgrad"])
def test_the_made_optimizer_state_is_what_a_first_step_makes(kind):
    """The simulator makes AdamW's state instead of running its first step: the same tensors."""
    options = {"foreach": True} if kind == "foreach" else {"fused": True} if kind == "fused" else {"amsgrad": True}
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    stepped = torch.optim.AdamW(params, **options)
    for p in params:
        p.grad = torch.zeros_like(p)
    stepped.step()
    made = torch.optim.AdamW(params, **options)
    create_adamw_state(made)
    for p in params:
        real, ours = stepped.state[p], made.state[p]
        assert real.keys() == ours.keys()
        for key in real:
            assert (real[key].shape, real[key].dtype, real[key].device) == (
                ours[key].shape,
                ours[key].dtype,
                ours[key].device,
            ), key
