"""Replica groups of several processes (FSDP, TP, PP or EP over two ranks inside a group): a
killed group is restarted whole by torchrun and heals exactly, a restarted group forgets the manager address
its killed attempt left in torchrun's store, and groups of different process counts stop on every rank."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
from harness import Launched, run_ranks
from replica_helpers import (
    GROUP_ARGS,
    HEALED,
    HEALED_LINE,
    MOE_ARGS,
    TRAJECTORY_TOLERANCE,
    ending,
    group_args,
    paced_until,
    surviving_batches_reference,
    trained_alike,
    weight_digests,
)

pytest.importorskip("torchft")

PAIR_STEPS = 30


LAYOUTS = {"dp_shard=2,ep=2": MOE_ARGS, "tp=2": GROUP_ARGS, "pp=2": GROUP_ARGS}
"""A group's mesh -> the model it trains (expert parallelism: the debug MoE, exact balancing).
``dp_shard=2`` with the dense model and ``cp=2`` passed as well (2026-11-28, run by hand) and are
left out of the suite for its time: FSDP over the two ranks is in the first."""


@pytest.mark.launcher
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_groups_of_two_processes_leave_out_a_killed_group_and_heal_it_exactly(layout, lighthouse, tmp_path):
    """Two groups of two processes each (FSDP with the MoE's experts split over the two ranks of
    a group, tensor parallelism over two, or two pipeline stages): group 1's processes SIGKILLed at
    step 3 and restarted by torchrun, group 0 trains on alone (paced until the restarted group
    heals from it). Every step's loss equals one process fed the surviving groups' batches (under
    FSDP each group's two ranks read the data-parallel shards 2g and 2g + 1; under TP and PP
    both read shard g), and the two groups end with the same weights (the digest covers each rank's
    shards)."""
    mesh, model = ["--mesh", layout], LAYOUTS[layout]
    data_ranks = 2 if layout.startswith("dp_shard") else 1
    survivor = Launched(
        2, [*group_args(0, lighthouse, tmp_path / "group0", model, PAIR_STEPS), *mesh], tmp_path / "0.log"
    )
    failing = Launched(
        2,
        [*group_args(1, lighthouse, tmp_path / "group1", model, PAIR_STEPS), *mesh],
        tmp_path / "1.log",
        MAX_RESTARTS="1",
    )
    with ending(survivor, failing):
        failing.wait_for(f"step: 3/{PAIR_STEPS}")
        for pid in failing.workers():
            os.kill(pid, signal.SIGKILL)
        paced_until(survivor, failing, HEALED_LINE)
        assert survivor.finish(timeout=240) == 0, survivor.output()[-3000:]
        assert failing.finish(timeout=60) == 0, failing.output()[-3000:]
    alive, _ = trained_alike(survivor, failing, PAIR_STEPS)
    participants = [alive[s][0] for s in range(1, PAIR_STEPS + 1)]
    healed = int(re.findall(HEALED, failing.output())[0])
    assert [0] in participants and participants[-1] == [0, 1] and healed < PAIR_STEPS, (participants, healed)
    digests = weight_digests([survivor.output(), failing.output()])
    assert digests[0] and digests[0][-1:] == digests[1][-1:]
    [expected] = run_ranks(surviving_batches_reference, 1, participants, model, data_ranks)
    losses = [alive[s][1] for s in range(1, PAIR_STEPS + 1)]
    assert losses == pytest.approx(expected["loss"], rel=TRAJECTORY_TOLERANCE)


def _stale_manager_forgotten() -> list[bool]:
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    from trainer import replica_groups

    torch.distributed.init_process_group("gloo")  # torchrun's way: its store at MASTER_PORT
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
    )
    if torch.distributed.get_rank() == 0:  # what the killed attempt's rank 0 left there
        store.set(MANAGER_ADDR_KEY, "http://127.0.0.1:9")
        store.set(REPLICA_ID_KEY, "meshtrain_group_1:killed")
    torch.distributed.barrier()
    replica_groups._forget_an_earlier_attempts_manager()
    return [store.check([key]) for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY)]


def test_a_restarted_group_forgets_the_killed_attempts_manager_before_any_rank_reads_it():
    """torchrun's store outlives a restart of a group's processes; the other ranks of a
    restarted group must not read the dead manager address its killed rank 0 published (they
    would time out connecting to it: seen with groups of two processes)."""
    assert run_ranks(_stale_manager_forgotten, 2) == [[False, False], [False, False]]


@pytest.mark.launcher
def test_groups_of_another_process_count_stop_on_every_rank_naming_it(lighthouse, tmp_path):
    """Group 0 of two processes meets group 1 of one: local rank 1 of group 0 has no peer to meet,
    and would wait for one until a timeout; instead every rank of both groups stops at once with
    the line that names the process count, before any step."""
    jobs = [
        Launched(ngpu, group_args(g, lighthouse, tmp_path / f"group{g}", GROUP_ARGS, 6), tmp_path / f"{g}.log")
        for g, ngpu in enumerate((2, 1))
    ]
    with ending(*jobs):
        codes = [job.finish(timeout=240) for job in jobs]
    lines = [
        f"config error: replica group {g} cannot train with group {1 - g}: processes per group (NGPU x NNODES) is "
        f"{here} here, {there} in group {1 - g}"
        for g, (here, there) in enumerate([(2, 1), (1, 2)])
    ]
    for job, code, line in zip(jobs, codes, lines):
        output = job.output()
        assert code == 1 and f"the job failed (exit 1): local rank 0: {line}" in output, output[-3000:]
        assert "replica groups: step" not in output, output[-3000:]
    assert f"local rank 1 (not shown: LOG_RANK=0) failed: {lines[0]}" in jobs[0].output(), jobs[0].output()[-3000:]
