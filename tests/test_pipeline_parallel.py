"""Pipeline parallelism keeps the promise: every PP mesh and schedule gives the single-process
reference's loss, grad norm and every gradient (one scaling pass), checkpoints reshard across
pipeline degrees, HSDP all-reduces once per step, and torchtitan's PP normalisation bug (the
division by N applied for logging only) fails the comparison.

Multi-process cases share launches (one per world size) to keep the suite's time down: a
launch builds one trainer after another in the same process group.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    BASE_ARGV,
    MAX_NORM,
    TOLERANCE,
    argv_for,
    assert_matches,
    counting_hsdp_collectives,
    full,
    max_relative_error,
    passes_over,
    run_ranks,
    trainer_for,
)
from step_helpers import fetch_step, forward_backward, part_of

from parallelisms.pipeline_split import BUBBLE_FRACTION, SCHEDULES, plan_split, split_model
from trainer.build import resume
from trainer.config import ConfigError, load_config
from trainer.data.datasets import load_dataset
from trainer.loss import IGNORE_INDEX
from trainer.model.llama3 import FLAVORS, Transformer
from trainer.planning.job_plan import resolve_job
from trainer.step.grad_accumulator import GradAccumulator
from trainer.step.grad_sync import total_norm
from trainer.step.train_step import train_step

# name: (local batch size, extra argv); global batch 8, seq_len 64, debug model (6 blocks)
TWO_RANKS = {
    "pp=2 1F1B": (8, ["--mesh", "pp=2"]),
    "pp=2 Interleaved1F1B, 2 stages per rank": (
        8,
        ["--mesh", "pp=2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    ),
    "pp=2 ZBVZeroBubble": (8, ["--mesh", "pp=2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    "pp=2 InterleavedZeroBubble, schedule named in lower case": (
        8,
        ["--mesh", "pp=2", "--parallelism.pipeline_parallel_schedule", "interleavedzerobubble"],
    ),
}
FOUR_RANKS = {
    "pp=2 x dp_shard=2, 4 accumulation micro-batches, GPipe": (
        1,
        ["--mesh", "pp=2,dp_shard=2", "--parallelism.pipeline_parallel_schedule", "GPipe"],
    ),
    "pp=2 x tp=2": (4, ["--mesh", "pp=2,tp=2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "pp=2 x cp=2": (8, ["--mesh", "pp=2,cp=2"]),
}
EIGHT_RANKS = {
    "dp_replicate=2 x pp=2 x dp_shard=2": (1, ["--mesh", "dp_replicate=2,pp=2,dp_shard=2"]),
}


# --------------------------------------------------------------------------------------------
# The split and the config (fast)
# --------------------------------------------------------------------------------------------


def test_split_puts_the_embedding_first_and_the_output_last():
    # 6 blocks + 1 (embedding) + 1 (output) = 8 units over 2 stages, then 4 stages.
    assert plan_split(6, 2, "1F1B", -1, 1, 1).stage_blocks == ((0, 1, 2), (3, 4, 5))
    four = plan_split(6, 2, "Interleaved1F1B", -1, 1, 1)
    assert four.stage_blocks == ((0,), (1, 2), (3, 4), (5,))
    assert [four.rank_stages(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert plan_split(6, 2, "ZBVZeroBubble", -1, 1, 1).rank_stages(0) == [0, 3]
    # Uneven: the remainder goes to the middle stages first.
    assert plan_split(7, 2, "Interleaved1F1B", -1, 1, 1).stage_blocks == ((0,), (1, 2, 3), (4, 5), (6,))
    assert plan_split(6, 3, "1F1B", 2, 0, 0).stage_blocks == ((0, 1), (2, 3), (4, 5))


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_stages_keep_the_whole_models_parameter_names(schedule):
    """Every parameter is held by exactly one pipeline rank, under its non-PP name."""
    args = FLAVORS["debugmodel"]
    with torch.device("meta"):
        names = [name for name, _ in Transformer(args).named_parameters()]
    split = plan_split(args.n_layers, 2, schedule, -1, 1, 1)
    held = []
    for pp_rank in range(2):
        with torch.device("meta"):
            model = Transformer(args)
        views = split_model(model, split, pp_rank)
        rank_names = [name for name, _ in model.named_parameters()]
        assert sorted(rank_names) == sorted(n for v in views for n, _ in v.named_parameters())
        held += rank_names
    assert sorted(held) == sorted(names)


def plan_for(*extra: str, world_size: int = 2):
    return resolve_job(load_config(BASE_ARGV + ["--training.local_batch_size", "8", *extra]), world_size)


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--parallelism.pipeline_parallel_layers_per_stage", "3"], "parallelism.pipeline_parallel_layers_per_stage"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "8"], "parallelism.pipeline_parallel_layers_per_stage"),
        (["--parallelism.pipeline_parallel_microbatch_size", "3"], "parallelism.pipeline_parallel_microbatch_size"),
        (["--parallelism.pipeline_parallel_microbatch_size", "8"], "parallelism.pipeline_parallel_microbatch_size"),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "GPipe",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "2",
            ],
            "parallelism.pipeline_parallel_schedule",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "4",
            ],
            "parallelism.pipeline_parallel_schedule",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
                "--parallelism.pipeline_parallel_first_stage_less_layers",
                "0",
                "--parallelism.pipeline_parallel_last_stage_less_layers",
                "0",
            ],
            "parallelism.pipeline_parallel_schedule",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
                "--training.global_batch_size",
                "10",
                "--training.local_batch_size",
                "10",
            ],
            "parallelism.pipeline_parallel_schedule",
        ),
        (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--compile.enable"], "compile.enable"),
        (
            ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--activation_checkpoint.mode", "selective"],
            "activation_checkpoint.mode",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
                "--activation_checkpoint.mode",
                "selective",
            ],
            "activation_checkpoint.selective_ac_option",
        ),
        (
            ["--parallelism.pipeline_parallel_first_stage_less_layers", "9"],
            "parallelism.pipeline_parallel_first_stage_less_layers",
        ),
    ],
    ids=[
        "not divisible",
        "stages not a multiple of pp",
        "micro-batch does not divide",
        "too few micro-batches",
        "single-stage schedule with 2 stages per rank",
        "interleaved with 1 stage per rank",
        "ZBV with 4 stages per rank",
        "micro-batches not whole rounds",
        "zero bubble with compile",
        "ZBV with per-op selective checkpointing",
        "interleaved zero bubble with per-op selective checkpointing",
        "embedding stage too large",
    ],
)
def test_pipeline_config_errors_name_the_key(extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        plan_for("--mesh", "pp=2", *extra)


def test_mesh_takes_pp_as_outermost_dimension():
    p = plan_for("--mesh", "pp=2,dp_shard=2,tp=2", "--training.local_batch_size", "4", world_size=8)
    assert (p.dims.pp, p.dims.dp_shard, p.dims.tp) == (2, 2, 2)
    assert p.pipeline_microbatches == 4
    inferred = plan_for("--mesh", "pp=2", "--training.local_batch_size", "2", world_size=4)
    assert inferred.dims.dp_shard == 2
    with pytest.raises(ConfigError, match="pp=2"):
        plan_for("--mesh", "pp=2,dp_shard=3", world_size=4)


def test_bubble_fractions():
    assert BUBBLE_FRACTION["1F1B"](4, 1, 8) == pytest.approx(3 / 11)
    assert BUBBLE_FRACTION["Interleaved1F1B"](4, 2, 8) < BUBBLE_FRACTION["1F1B"](4, 1, 8)
    assert set(BUBBLE_FRACTION) == set(SCHEDULES)


# --------------------------------------------------------------------------------------------
# Against the single-process reference (slow: one launch per world size)
# --------------------------------------------------------------------------------------------


def pp_step(argv: list[str], bug: bool = False) -> dict | None:
    """One step through the trainer's own code. Returns, from one rank per pipeline stage (the
    first of its data, context and tensor-parallel ranks), the stage's full gradients and the
    number of writes finalize made to each; every rank reports its step result.

    ``bug`` also returns torchtitan's PP gradients: the summed-loss gradients clipped by their
    own norm, with N used only for the logged loss.
    """
    p, training = trainer_for(argv)
    params = list(training.model.parameters())
    accumulator = part_of(training, GradAccumulator)
    finish = accumulator.finish
    seen: dict = {"writes": []}

    def counting_finish(result):
        locals_ = [prm.grad._local_tensor for prm in params]
        before = [t._version for t in locals_]
        if bug:
            raw = {name: full(prm.grad) for name, prm in training.model.named_parameters()}
            norm = total_norm([prm.grad for prm in params], p.dims.pp).item()
            seen["bug"] = {"norm": norm, "grads": {k: g * min(1.0, MAX_NORM / (norm + 1e-6)) for k, g in raw.items()}}
        finish(result)
        seen["writes"].extend(passes_over(locals_, before))

    accumulator.finish = counting_finish
    microbatches = fetch_step(training)
    result = forward_backward(training, microbatches)
    grads = {name: full(prm.grad) for name, prm in training.model.named_parameters()}
    out = {"loss": result.loss_avg, "loss_max": result.loss_max, "norm": result.grad_norm, "n": result.n_valid_tokens}
    # Every schedule evaluates (forward only, as validation does: inside the loss context, which under
    # loss parallel the last stage's vocabulary-sharded loss needs), its own training order notwithstanding.
    inputs, labels = torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.labels for mb in microbatches])
    assert training.pipeline is not None
    with training.forward.context():
        out["evaluated"] = training.pipeline.evaluate(inputs, labels).item()
        out["evaluated_short"] = training.pipeline.evaluate(inputs[:3], labels[:3]).item()
    owner = training.meshes.loss.get_local_rank() == 0 and training.meshes.tp.get_local_rank() == 0
    if owner:
        out.update(grads=grads, writes=seen["writes"], bug=seen.get("bug"))
    return out


def pp_steps(cases: list[tuple[list[str], bool]]) -> list[dict]:
    return [pp_step(argv, bug) for argv, bug in cases]


def merged(results: list[list[dict]], case: int) -> dict:
    """Case ``case``'s step result with the gradients of every stage put together."""
    out = dict(results[0][case])
    out["grads"] = {k: v for r in results for k, v in r[case].get("grads", {}).items()}
    out["writes"] = [w for r in results for w in r[case].get("writes", [])]
    return out


def check_case(results: list[list[dict]], case: int, ref: dict, writes: bool = True) -> dict:
    result = merged(results, case)
    assert_matches(result, ref)
    if writes:
        assert set(result["writes"]) == {1}  # one scaling pass, on every stage
    # Every rank logs the same numbers, the non-last stages included.
    for r in results:
        assert (r[case]["loss"], r[case]["loss_max"], r[case]["n"]) == (result["loss"], result["loss_max"], result["n"])
        assert r[case]["norm"] == pytest.approx(result["norm"], rel=1e-6)
    return result


@pytest.fixture(scope="module")
def two_ranks():
    cases = [(argv_for(local, extra), name == "pp=2 1F1B") for name, (local, extra) in TWO_RANKS.items()]
    return run_ranks(pp_steps, 2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_pp_two_ranks_match_reference(two_ranks, case, ref):
    check_case(two_ranks, list(TWO_RANKS).index(case), ref)


@pytest.mark.slow
def test_torchtitan_logging_only_division_is_caught(two_ranks, ref):
    """Gradients of summed losses, clipped by their own norm, N used for the logged loss only:
    the loss matches, the norm (N times too large) and the gradients do not."""
    result = merged(two_ranks, 0)
    bug = {k: v for r in two_ranks for k, v in (r[0].get("bug") or {}).get("grads", {}).items()}
    buggy = {**result, "grads": bug, "norm": two_ranks[0][0]["bug"]["norm"]}
    assert buggy["norm"] == pytest.approx(ref["norm"] * ref["n"], rel=1e-5)
    with pytest.raises(AssertionError):
        assert_matches(buggy, ref)
    # Without clipping the gradients themselves are off by N.
    unclipped_bug = {k: g / min(1.0, MAX_NORM / (buggy["norm"] + 1e-6)) for k, g in bug.items()}
    assert max_relative_error(unclipped_bug, ref["unclipped"]) > 100


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_pipeline_evaluation_sums_the_same_loss(two_ranks, case, ref):
    """The forward-only pass a validation calls, under every schedule (the zero-bubble ones
    included, whose own eval fails): the summed loss on every stage, padded groups included
    (3 sequences of an 8-sequence step)."""
    index = list(TWO_RANKS).index(case)
    for r in two_ranks:
        assert r[index]["evaluated"] == pytest.approx(ref["loss"] * ref["n"], rel=TOLERANCE)
    model, inputs, labels = ref["model"], ref["inputs"][:3], ref["labels"][:3]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            model(inputs).flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
    for r in two_ranks:
        assert r[index]["evaluated_short"] == pytest.approx(expected.item(), rel=TOLERANCE)


def reshard_worker(dump: str) -> dict:
    """Two steps at pp=2 x dp_shard=2 saving each; then step 2 again from the step-1 checkpoint
    at pp=1 (dp_shard=4) and at pp=2 x tp=2."""
    common = argv_for(
        2,
        [
            "--job.dump_folder",
            dump,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1",
            "--training.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
        ],
    )
    losses = {}
    p, training = trainer_for(common + ["--mesh", "pp=2,dp_shard=2"])
    state, checkpointer = training.state, resume(p, load_dataset(p.config, p.tokenizer, p.global_batch_size), training)
    for _ in range(2):
        state.step += 1
        losses.setdefault("pp=2 x dp_shard=2", []).append(train_step(training.step, state).result.loss_avg)
        checkpointer.maybe_save(state.step)
    checkpointer.close()
    for mesh in ("dp_shard=4", "pp=2,tp=2"):
        p, training = trainer_for(common + ["--mesh", mesh, "--checkpoint.load_step", "1"])
        state, checkpointer = (
            training.state,
            resume(p, load_dataset(p.config, p.tokenizer, p.global_batch_size), training),
        )
        assert state.step == 1
        state.step += 1
        losses[mesh] = [train_step(training.step, state).result.loss_avg]
        checkpointer.close()
    return losses


def four_ranks_worker(cases: list[tuple[list[str], bool]], dump: str) -> dict:
    return {"steps": pp_steps(cases), "reshard": reshard_worker(dump)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    cases = [(argv_for(local, extra), False) for local, extra in FOUR_RANKS.values()]
    return run_ranks(four_ranks_worker, 4, cases, str(tmp_path_factory.mktemp("reshard")))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR_RANKS))
def test_pp_four_ranks_match_reference(four_ranks, case, ref):
    results = [r["steps"] for r in four_ranks]
    result = check_case(results, list(FOUR_RANKS).index(case), ref)
    if "dp_shard" in case:
        assert result["loss_max"] > result["loss"]  # the two data-parallel ranks differ


@pytest.mark.slow
def test_checkpoint_reshards_across_pipeline_degrees(four_ranks):
    losses = four_ranks[0]["reshard"]
    expected = losses["pp=2 x dp_shard=2"][1]
    assert losses["dp_shard=4"][0] == pytest.approx(expected, rel=1e-5)
    assert losses["pp=2,tp=2"][0] == pytest.approx(expected, rel=1e-5)
    assert losses["pp=2 x dp_shard=2"][0] != pytest.approx(expected, rel=1e-3)  # step 2 is another batch


def hsdp_worker(argv: list[str]) -> dict:
    """The reference comparison and FSDP's collectives over one HSDP x PP step."""
    p, parts = trainer_for(argv)
    with counting_hsdp_collectives(parts) as counts:
        result = forward_backward(parts, fetch_step(parts))
    units = {
        id(m._get_fsdp_state()._fsdp_param_group)
        for stage in parts.pipeline.stages
        for m in stage.submod.modules()
        if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None
    }
    counts.update(units=len(units), microbatches=p.pipeline_microbatches, accumulation=p.microbatches)
    grads = {name: full(prm.grad) for name, prm in parts.model.named_parameters()}
    out = {
        "loss": result.loss_avg,
        "loss_max": result.loss_max,
        "norm": result.grad_norm,
        "n": result.n_valid_tokens,
        "counts": counts,
    }
    if parts.meshes.loss.get_local_rank() == 0:
        out["grads"] = grads
    return out


@pytest.mark.slow
def test_hsdp_pp_matches_reference_and_all_reduces_once_per_step(ref):
    local, extra = EIGHT_RANKS["dp_replicate=2 x pp=2 x dp_shard=2"]
    results = run_ranks(hsdp_worker, 8, argv_for(local, extra))
    check_case([[r] for r in results], 0, ref, writes=False)
    for r in results:
        counts = r["counts"]
        assert counts["accumulation"] == 2 and counts["microbatches"] == 2
        assert counts["units"] >= 4  # embedding or norm+output, and 3 blocks
        # Once per step and FSDP unit, however many pipeline and accumulation micro-batches.
        assert counts["all_reduce_replicate"] == counts["units"]
        assert counts["reduce_scatter"] == counts["units"]
