"""Replica groups of different jobs never train together (``trainer/replica_identity.py``): the
groups' identities are compared through a real store each time a quorum forms, as torchft's
process group is configured, and a group differing in any shared setting (the optimizer, the
seed, the batch, the group count, the process count, the mesh, the model, the data) stops in one
line naming the key, on every rank of both groups; settings that only say how a group runs may
differ. Launched: two one-process groups of different seeds both stop before any step.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from functools import cache
from pathlib import Path

import pytest
import torch.distributed as dist
from replica_helpers import GROUP_ARGS, group_args, worker

from trainer.config import FIELDS, JobConfig
from trainer.entry.job import prepare
from trainer.replica_identity import (
    PER_GROUP,
    PER_GROUP_SECTIONS,
    SHARED_ELSEWHERE,
    SHARED_SECTIONS,
    Meeting,
    job_identity,
    shared_keys,
)
from trainer.runtime.errors import ConfigError

pytest.importorskip("torchft")

BASE = ["--fault_tolerance.enable", "--fault_tolerance.group_count", "2", "--fault_tolerance.lighthouse", "http://h:1"]


@cache
def identity(extra: tuple[str, ...], world_size: int, dump: str) -> dict[str, str]:
    job = prepare([*BASE, "--job.dump_folder", dump, *extra], world_size, local_ranks=1, memory=False)
    return job_identity(job.plan, job.dataset.identity)


def meet(identities: list[dict[str, str]], groups: list[int], timeout_s: float = 20) -> dict[str, object]:
    """Each group's rank 0, and group 0's rank 1, meet in one quorum through a real TCPStore (the
    quorum's store of local rank 0) and each group's own store, in threads as torchft's are:
    ``"g/r"`` -> what :meth:`Meeting.agrees` returned, or the exception it raised."""
    quorum_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    own_stores = [dist.HashStore() for _ in groups]
    found: dict[str, object] = {}

    def join(g: int, local_rank: int) -> None:
        meeting = Meeting(groups[g], identities[g], timedelta(seconds=timeout_s), own_stores[g])
        try:
            agreed = meeting.agrees(
                f"127.0.0.1:{quorum_store.port}/torchft/7/{local_rank}", 7, g, len(groups), local_rank
            )
            found[f"{g}/{local_rank}"] = agreed or meeting.conflict
        except Exception as e:  # what the rank would hand torchft
            found[f"{g}/{local_rank}"] = e

    threads = [threading.Thread(target=join, args=(g, 0)) for g in range(len(groups))]
    threads.append(threading.Thread(target=join, args=(0, 1)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a meeting hung"
    return found


CASES = {
    "lr": (["--optimizer.lr", "0.001"], 1, "`optimizer.lr`", "0.003", "0.001"),
    "seed": (["--debug.seed", "7"], 1, "`debug.seed`", "0", "7"),
    "global_batch": (["--training.global_batch_size", "32"], 1, "`training.global_batch_size`", "16", "32"),
    "group_count": (["--fault_tolerance.group_count", "3"], 1, "`fault_tolerance.group_count`", "2", "3"),
    "min_replica_size": (
        ["--fault_tolerance.min_replica_size", "2"],
        1,
        "`fault_tolerance.min_replica_size`",
        "1",
        "2",
    ),
    "schedule": (["--lr_scheduler.warmup_steps", "9"], 1, "`lr_scheduler.warmup_steps`", "5", "9"),
    "steps": (["--training.steps", "61"], 1, "`training.steps`", "60", "61"),
    "model": (["--model.n_layers", "3"], 1, "`model.n_layers`", "0", "3"),
    "data": (["--training.seq_len", "64"], 1, "`training.seq_len`", "128", "64"),
    "processes": ([], 2, "processes per group (NGPU x NNODES)", "1", "2"),
}
"""Group 1's settings against group 0's defaults (one process): the key named, group 0's value, group 1's."""


@pytest.mark.parametrize("case", list(CASES))
def test_groups_differing_in_a_shared_setting_never_meet_and_every_rank_names_it(case, tmp_path):
    extra, world_size, key, zero, one = CASES[case]
    mine = identity((), 1, str(tmp_path / "0"))
    theirs = identity(("--fault_tolerance.replica_id", "1", *extra), world_size, str(tmp_path / "1"))
    found = meet([mine, theirs], [0, 1])
    assert sorted(found) == ["0/0", "0/1", "1/0"]
    for rank, verdict in found.items():
        here, there = (0, 1) if rank.startswith("0") else (1, 0)
        values = (zero, one) if here == 0 else (one, zero)
        expected = (
            f"replica group {here} cannot train with group {there}: {key} is {values[0]} here, {values[1]} in "
            f"group {there}"
        )
        assert isinstance(verdict, ConfigError) and expected in str(verdict), (rank, verdict)


def test_groups_differing_only_in_how_each_runs_meet(tmp_path):
    """The dump folder, the id, the lighthouse's spelling, timeouts, logging, checkpointing, the
    loader, memory and speed settings: a group on other machines may need its own."""
    own = (
        *("--fault_tolerance.replica_id", "1", "--fault_tolerance.lighthouse", "http://elsewhere:2"),
        *("--fault_tolerance.timeout_seconds", "9", "--fault_tolerance.max_uncommitted_steps", "3"),
        *("--metrics.log_freq", "3", "--checkpoint.enable", "--checkpoint.interval", "7"),
        *("--training.num_workers", "1", "--training.loss_chunk_tokens", "256", "--comm.train_timeout_seconds", "50"),
        *("--activation_checkpoint.mode", "full", "--validation.enable=false"),
    )
    mine, theirs = identity((), 1, str(tmp_path / "0")), identity(own, 1, str(tmp_path / "1"))
    assert meet([mine, theirs], [0, 1]) == {"0/0": True, "1/0": True, "0/1": True}


def test_two_groups_of_one_id_never_meet(tmp_path):
    mine = identity((), 1, str(tmp_path / "0"))
    for verdict in meet([mine, mine], [1, 1]).values():
        assert isinstance(verdict, ConfigError)
        assert "two replica groups run with `fault_tolerance.replica_id` = 1: each would train" in str(verdict)


def test_a_meeting_whose_peer_is_gone_fails_within_the_timeout_on_every_rank(tmp_path):
    """A group that asked for the quorum and died before configuring it: its peers' meeting fails
    as the process group's own would (torchft leaves the step uncommitted), never hangs."""
    mine = identity((), 1, str(tmp_path / "0"))
    quorum_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    own = dist.HashStore()
    errors: dict[int, BaseException] = {}

    def join(local_rank: int) -> None:
        try:
            Meeting(0, mine, timedelta(seconds=1), own).agrees(
                f"127.0.0.1:{quorum_store.port}/torchft/3/{local_rank}", 3, 0, 2, local_rank
            )
        except Exception as e:
            errors[local_rank] = e

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a meeting hung"
    assert isinstance(errors[0], dist.DistError), errors
    assert "did not say what it runs" in str(errors[1])


def test_every_section_is_shared_or_per_group_and_the_exceptions_name_real_keys():
    """A new section or key must be placed: shared (compared) or per group."""
    sections = [f.name for f in JobConfig.__dataclass_fields__.values()]
    assert sorted(sections) == sorted((*SHARED_SECTIONS, *PER_GROUP_SECTIONS))
    assert not set(SHARED_SECTIONS) & set(PER_GROUP_SECTIONS)
    assert all(key in FIELDS and key.split(".")[0] in SHARED_SECTIONS for key in PER_GROUP)
    assert all(key in FIELDS and key.split(".")[0] in PER_GROUP_SECTIONS for key in SHARED_ELSEWHERE)
    assert "optimizer.lr" in shared_keys() and "job.dump_folder" not in shared_keys()


@pytest.mark.slow
def test_two_launched_groups_of_different_seeds_both_stop_before_any_step(lighthouse, tmp_path: Path):
    jobs = [
        worker([*group_args(g, lighthouse, tmp_path / str(g), GROUP_ARGS, 6), *(["--debug.seed", "7"] if g else [])])
        for g in range(2)
    ]
    try:
        outputs = [job.communicate(timeout=240)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    for g, (job, output) in enumerate(zip(jobs, outputs)):
        assert job.returncode == 2, output[-3000:]
        seeds = ("0", "7") if g == 0 else ("7", "0")
        line = (
            f"meshtrain: config error: replica group {g} cannot train with group {1 - g}: `debug.seed` is "
            f"{seeds[0]} here, {seeds[1]} in group {1 - g}; start every group"
        )
        assert line in output and "Traceback" not in output, output[-3000:]
        assert "replica groups: step" not in output and "step: 1/" not in output, output[-3000:]
