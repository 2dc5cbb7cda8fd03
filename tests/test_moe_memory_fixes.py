"""What would fit an oversized Mixture-of-Experts job, now that TP, CP and PP compose with MoE:
every change the dry run proposes is a layout the job's checks accept, and fits by the estimate."""

from __future__ import annotations

import re

import pytest

from trainer.config import load_config
from trainer.entry.launch import main as launch_main
from trainer.planning.job_plan import resolve_job
from trainer.planning.memory_fixes import _microbatch_sizes, _tp_degrees

DRY_RUN = ["--dry-run", "--target-gpu", "h100"]
QWEN_30B = ["--config", "qwen3_30b_a3b.toml"]

OVERSIZED = {
    "ep 1 on a 66 GiB GPU": (8, ["--mesh", "ep=1", "--target.memory_gib", "66"]),
    "half the node": (4, ["--mesh", "ep=4"]),
    "no checkpointing": (8, ["--activation_checkpoint.mode", "none"]),
    "TP, no checkpointing": (8, ["--mesh", "dp_shard=4,tp=2,ep=4", "--activation_checkpoint.mode", "none"]),
    "EP over CP ranks, no checkpointing": (
        8,
        ["--mesh", "dp_shard=4,cp=2,ep=8", "--activation_checkpoint.mode", "none"],
    ),
    "CP x TP on a 40 GiB GPU": (8, ["--mesh", "dp_shard=2,cp=2,tp=2,ep=2", "--target.memory_gib", "40"]),
    "four sequences a micro-batch": (
        8,
        ["--training.local_batch_size", "4", "--training.global_batch_size", "64"],
    ),
    "three sequences a micro-batch": (
        8,
        ["--training.local_batch_size", "3", "--training.global_batch_size", "24", "--target.memory_gib", "60"],
    ),
    "nothing alone fits 30 GiB": (8, ["--target.memory_gib", "30", "--activation_checkpoint.mode", "none"]),
    "a balancing loss over whole sequences": (
        8,
        ["--moe.balance_loss_scope", "sequence", "--activation_checkpoint.mode", "none"],
    ),
    # Two stages on 32 GPUs hold each stage's experts gathered, with their float32 gradients
    # unsharded for the step: only eight stages (on 128) fit, and the batch feeds them.
    "Qwen3-235B-A22B in two stages on 32 GPUs": (
        32,
        [
            "--config",
            "qwen3_235b_a22b.toml",
            "--mesh",
            "pp=2,dp_shard=16,ep=8",
            "--training.global_batch_size",
            "128",
        ],
    ),
}

PROPOSED = {
    "Qwen3-235B-A22B in two stages on 32 GPUs": "`--parallelism.pipeline_parallel_degree 8` (with 128 processes)"
}
"""A change the advice must name (the others only have to be accepted and fit)."""

CHANGES = {
    r"dp_shard (\d+) \((\d+) processes": "--parallelism.data_parallel_shard_degree",
    r"`--parallelism.tensor_parallel_degree (\d+)`(?: \(with (\d+) processes\))?": "--parallelism.tensor_parallel_degree",
    r"`--parallelism.expert_parallel_degree (\d+)`": "--parallelism.expert_parallel_degree",
    r"`--parallelism.pipeline_parallel_degree (\d+)` \(with (\d+) processes": "--parallelism.pipeline_parallel_degree",
    r"`--parallelism.pipeline_parallel_microbatch_size (\d+)`": "--parallelism.pipeline_parallel_microbatch_size",
    r"`--training.local_batch_size (\d+)`": "--training.local_batch_size",
    r"`--activation_checkpoint.mode (full)`": "--activation_checkpoint.mode",
}


def _as_arguments(change: str) -> tuple[list[str], int | None]:
    """The overrides one proposed change stands for, and the processes it names (None: the same)."""
    for pattern, key in CHANGES.items():
        found = re.search(pattern, change)
        if found:
            processes = found.group(2) if found.lastindex == 2 else None
            return [key, found.group(1)], int(processes) if processes else None
    raise AssertionError(f"a change no test knows: {change}")


def _dry_run(monkeypatch, capsys, world: int, args: list[str]) -> tuple[int, str]:
    monkeypatch.setenv("NGPU", str(min(world, 8)))
    monkeypatch.setenv("NNODES", str(max(world // 8, 1)))
    code = launch_main([*DRY_RUN, *([] if "--config" in args else QWEN_30B), *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(OVERSIZED))
def test_every_proposed_change_is_accepted_and_fits(monkeypatch, tmp_path, capsys, case):
    monkeypatch.chdir(tmp_path)
    world, args = OVERSIZED[case]
    code, err = _dry_run(monkeypatch, capsys, world, args)
    assert code == 2 and "this job needs about" in err, err
    advice = re.search(r"(Any one of these|These together) would fit: (.*?)\. The estimate", err)
    assert advice, err
    assert PROPOSED.get(case, "") in advice.group(2), err
    together = advice.group(1) == "These together"
    changes = advice.group(2).split(", " if together else "; or ")
    proposals = [changes] if together else [[change] for change in changes]
    for proposal in proposals:
        extra, processes = [], world
        for change in proposal:
            arguments, named = _as_arguments(change)
            extra += arguments
            processes = named or processes
        code, err = _dry_run(monkeypatch, capsys, processes, _applied(args, extra))
        assert code == 0, (case, proposal, err)


MESH_KEYS = {
    "--parallelism.data_parallel_shard_degree": "dp_shard",
    "--parallelism.tensor_parallel_degree": "tp",
    "--parallelism.expert_parallel_degree": "ep",
    "--parallelism.pipeline_parallel_degree": "pp",
}


def _applied(args: list[str], extra: list[str]) -> list[str]:
    """``args`` with the overrides ``extra``; a degree goes into ``--mesh`` where one is given
    (the two may not both name it)."""
    if "--mesh" not in args:
        return [*args, *extra]
    at = args.index("--mesh") + 1
    mesh = dict(part.split("=") for part in args[at].split(","))
    rest = []
    for key, value in zip(extra[::2], extra[1::2], strict=True):
        if key in MESH_KEYS:
            mesh[MESH_KEYS[key]] = value
        else:
            rest += [key, value]
    return [*args[:at], ",".join(f"{k}={v}" for k, v in mesh.items()), *args[at + 1 :], *rest]


def test_tp_is_proposed_only_where_it_divides_what_it_splits():
    """Qwen3-30B-A3B's 4 key/value heads take TP up to 4, not 8; a 3-sequence micro-batch of
    a 24-sequence step on 8 ranks cuts into 1, not 2."""
    plan = resolve_job(load_config(["--config", "qwen3_30b_a3b.toml", "--mesh", "dp_shard=4,tp=2,ep=4"]), 8, "cuda")
    assert _tp_degrees(plan.workload) == [4]
    three = ["--config", "qwen3_30b_a3b.toml", "--training.local_batch_size", "3", "--training.global_batch_size", "24"]
    assert _microbatch_sizes(resolve_job(load_config(three), 8, "cuda").workload) == [1]
