"""Fault-tolerant replica groups (``trainer/replica_groups.py``): a group killed or stalled
mid-run is left out while the other trains on, heals from it when restarted or awake, and every
step's loss equals one process fed exactly the batches of the groups that trained that step;
checkpoints resume every group together; each failure around the groups is one line. A
Mixture-of-Experts run's balancing loss and expert loads are held to the same reference, and
its groups' routing biases end equal. A step whose quorum broke keeps nothing of itself (tested
in one process, since whether a launched fault breaks a step is a matter of when it lands).

The groups here are one process each (2 x 1); ``test_replica_groups_of_processes.py`` runs two
groups of two processes each, with a shorter run, as it takes twice the cores. The data is
``shakespeare_dialogue``, whose masked prompts and padding give every group a different number
of valid tokens per step, so a loss averaged over the groups instead of their tokens differs
from the reference.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Launched, assert_equal, free_port, full, run_ranks, tensorboard_scalars, trainer_for
from replica_helpers import (
    GROUPS,
    HEALED,
    HEALED_LINE,
    MOE_ARGS,
    STEPS,
    TRAINED_ALONE,
    TRAJECTORY_TOLERANCE,
    ending,
    group_args,
    paced_until,
    steps_logged,
    surviving_batches_reference,
    tokens_logged,
    trained_alike,
    weight_digests,
    worker,
)
from torch.utils._pytree import tree_map

from trainer.config import FaultTolerance, load_config
from trainer.planning.job_plan import describe, resolve_job
from trainer.replica_groups import ReplicaGroups, check_lighthouse
from trainer.replica_identity import Meeting
from trainer.runtime.errors import ConfigError, JobError
from trainer.step.expert_balance import BALANCE_LOSS
from trainer.step.group_commit import GroupCommit
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.part import Parts
from trainer.step.train_step import train_step
from trainer.train_state import TrainState

pytest.importorskip("torchft")

STALL_S = 6
EARLY_TOLERANCE = 1e-4
"""The steps up to the first heal (both groups, then one alone): few AdamW steps for round-off to
grow, while a loss averaged over the groups instead of their tokens is off by 1e-2 at once."""
MOE_TOLERANCE = 1e-4
"""The MoE run's 16 steps stay within 1.2e-7 of its reference; its balancing bugs move the loss by
8e-4 to 4.5e-3 (and the balancing loss, checked at 1e-5, by 2x to 4x)."""


@pytest.mark.launcher
def test_a_killed_or_stalled_group_is_left_out_heals_and_every_loss_is_over_the_surviving_batches_then_resumes(
    lighthouse, tmp_path
):
    saving = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]  # the last step only
    survivor = Launched(
        1,
        [*group_args(0, lighthouse, tmp_path / "group0"), *saving, "--metrics.enable_tensorboard"],
        tmp_path / "group0.log",
    )
    # The killed group comes back as torchrun restarts it: a new process that heals from group 0.
    failing = Launched(
        1, [*group_args(1, lighthouse, tmp_path / "group1"), *saving], tmp_path / "group1.log", MAX_RESTARTS="1"
    )
    with ending(survivor, failing):
        failing.wait_for(f"step: 4/{STEPS}")
        for pid in failing.workers():
            os.kill(pid, signal.SIGKILL)
        paced_until(survivor, failing, HEALED_LINE)
        first_heal = int(re.findall(HEALED, failing.output())[0])
        # Paced on until the healed group trains two steps itself: on a loaded machine the survivor
        # could otherwise run ahead again and the group heal past them (seen once in the suite).
        paced_until(survivor, failing, f"step: {first_heal + 2}/{STEPS}")
        # A stall longer than `fault_tolerance.timeout_seconds`, until the survivor has trained a
        # step without it: left out, then it heals again.
        [stalled] = failing.workers()
        alone_before = survivor.output().count(TRAINED_ALONE)
        os.kill(stalled, signal.SIGSTOP)
        time.sleep(STALL_S)
        survivor.wait_for(TRAINED_ALONE, count=alone_before + 1)
        os.kill(stalled, signal.SIGCONT)
        paced_until(survivor, failing, HEALED_LINE, count=2)
        assert survivor.finish(timeout=240) == 0, survivor.output()[-3000:]
        assert failing.finish(timeout=60) == 0, failing.output()[-3000:]
    alive, _ = trained_alike(survivor, failing, STEPS)
    participants = [alive[s][0] for s in range(1, STEPS + 1)]
    tokens = tokens_logged(survivor.output())
    healed = [int(step) for step in re.findall(HEALED, failing.output())]
    alone = [s for s, groups in enumerate(participants, 1) if groups == [0]]
    assert len(healed) == 2 and healed[1] < STEPS - 2, (participants, healed)
    assert 4 < alone[0] <= healed[0] < alone[-1] <= healed[1], (participants, healed)  # left out twice
    digests = weight_digests([survivor.output(), failing.output()])
    assert digests[0] and digests[0][-1:] == digests[1][-1:]
    # The end's line counts what each group trained itself, not the steps it took over by healing.
    taken_over = re.findall(r"done: steps 1-\d+ of \d+ \(0 skipped in all, (\d+) taken over", failing.output())
    assert taken_over and int(taken_over[-1]) >= healed[0] and "taken over" not in survivor.output()
    scalars = tensorboard_scalars(tmp_path / "group0", ("fault_tolerance/groups", "fault_tolerance/tokens"))
    assert scalars["fault_tolerance/groups"] == {s: len(groups) for s, groups in enumerate(participants, 1)}
    assert scalars["fault_tolerance/tokens"] == {s: sum(tokens[s]) for s in range(1, STEPS + 1)}
    [expected] = run_ranks(surviving_batches_reference, 1, participants)
    losses = [alive[s][1] for s in range(1, STEPS + 1)]
    assert losses[: healed[0]] == pytest.approx(expected["loss"][: healed[0]], rel=EARLY_TOLERANCE)
    assert losses == pytest.approx(expected["loss"], rel=TRAJECTORY_TOLERANCE)

    # A full restart of every group resumes each from its own checkpoint, together.
    jobs = [
        worker([*group_args(g, lighthouse, tmp_path / f"group{g}"), *saving, "--training.steps", str(STEPS + 2)])
        for g in range(GROUPS)
    ]
    outputs = [job.communicate(timeout=180)[0] for job in jobs]
    for g, (job, output) in enumerate(zip(jobs, outputs)):
        assert job.returncode == 0, output[-3000:]
        assert f"resuming from {tmp_path / f'group{g}' / 'checkpoint' / f'step-{STEPS}'}" in output
        assert {s: groups for s, (groups, _) in steps_logged(output).items()} == {STEPS + 1: [0, 1], STEPS + 2: [0, 1]}
    digests = weight_digests(outputs)
    assert digests[0] and digests[0] == digests[1]


MOE_STEPS = 16
MOE_LAYERS = (1, 2, 3)
"""The debug MoE's routed blocks (the first is dense)."""


@pytest.mark.launcher
def test_an_moe_step_is_exact_over_the_groups_that_trained_it_and_every_group_moves_its_biases_alike(
    lighthouse, tmp_path
):
    """The debug MoE with a global-batch balancing loss and the aux-loss-free bias: group 1
    stalls until group 0 has trained a step alone, then heals. Every step's loss, balancing
    loss and expert loads equal one process fed the step's surviving micro-batches with that
    batch's global sizes; the groups' weights, routing biases included, end equal."""
    extra = ["--metrics.enable_tensorboard", "--metrics.save_tb_folder", "tb", "--fault_tolerance.timeout_seconds", "2"]
    jobs = [
        Launched(
            1,
            [*group_args(g, lighthouse, tmp_path / f"group{g}", MOE_ARGS, MOE_STEPS), *extra],
            tmp_path / f"group{g}.log",
        )
        for g in range(GROUPS)
    ]
    survivor, stalling = jobs
    with ending(*jobs):
        stalling.wait_for(f"step: 2/{MOE_STEPS}")
        [stalled] = stalling.workers()
        os.kill(stalled, signal.SIGSTOP)
        survivor.wait_for(TRAINED_ALONE, timeout=120)
        os.kill(stalled, signal.SIGCONT)
        paced_until(survivor, stalling, HEALED_LINE)
        for job in jobs:
            assert job.finish(timeout=180) == 0, job.output()[-3000:]
    alive, rejoined = trained_alike(survivor, stalling, MOE_STEPS)
    participants = [alive[s][0] for s in range(1, MOE_STEPS + 1)]
    assert [0] in participants and participants[-1] == [0, 1], participants
    assert re.search(HEALED, stalling.output()), stalling.output()[-3000:]
    digests = weight_digests([job.output() for job in jobs])
    assert digests[0] and digests[0] == digests[1]
    [expected] = run_ranks(surviving_batches_reference, 1, participants, MOE_ARGS)
    tags = (BALANCE_LOSS.tag, *(f"moe/load_max_over_mean/layer_{layer}" for layer in MOE_LAYERS))
    for g in range(GROUPS):
        scalars = tensorboard_scalars(tmp_path / f"group{g}", tags)
        trained = sorted(scalars[BALANCE_LOSS.tag])
        assert trained == sorted(alive if g == 0 else rejoined)
        balance = [scalars[BALANCE_LOSS.tag][s] for s in trained]
        loads = [[scalars[f"moe/load_max_over_mean/layer_{layer}"][s] for layer in MOE_LAYERS] for s in trained]
        assert balance == pytest.approx([expected["balance_loss"][s - 1] for s in trained], rel=1e-5)
        assert loads == [pytest.approx(expected["max_load"][s - 1], rel=1e-6) for s in trained]
    losses = [alive[s][1] for s in range(1, MOE_STEPS + 1)]
    assert losses == pytest.approx(expected["loss"], rel=MOE_TOLERANCE)


@pytest.mark.slow
def test_each_failure_around_the_groups_is_one_line(tmp_path):
    """The lighthouse unreachable, a quorum that never forms, and a group that starts while no
    other does: each ends the group with exit 1 and one line naming the setting, never a
    traceback."""
    from torchft._torchft import LighthouseServer

    waiting_for_two = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=20)
    alone = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20)
    cases = {
        "cannot reach the torchft lighthouse at 'http://127.0.0.1:1'": ["http://127.0.0.1:1"],
        "no quorum formed within `fault_tolerance.quorum_timeout_seconds` = 2 s": [waiting_for_two.address()],
        "only 1 of `fault_tolerance.group_count` = 2 groups joined within": [alone.address()],
    }
    try:
        jobs = {
            expected: worker(
                [
                    *group_args(0, extra[0], tmp_path / str(i)),
                    "--fault_tolerance.connect_timeout_seconds",
                    "1",
                    "--fault_tolerance.quorum_timeout_seconds",
                    "2",
                    *extra[1:],
                ]
            )
            for i, (expected, extra) in enumerate(cases.items())
        }
        outputs = {expected: job.communicate(timeout=120)[0] for expected, job in jobs.items()}
    finally:
        waiting_for_two.shutdown()
        alone.shutdown()
    for expected, job in jobs.items():
        assert job.returncode == 1, outputs[expected][-3000:]
        assert expected in outputs[expected] and "Traceback" not in outputs[expected], outputs[expected][-3000:]


class _Manager:
    """What :meth:`ReplicaGroups.commit` asks of torchft's manager, for a group left alone."""

    def should_commit(self) -> bool:
        return False

    def errored(self) -> None:
        return None

    def num_participants(self) -> int:
        return 1


def groups_without_torchft(**identity: str) -> ReplicaGroups:
    """Group 1 of 2 with the state ``ReplicaGroups.__init__`` gives it, and a stand-in for torchft's
    manager (no lighthouse, no process group)."""
    groups = ReplicaGroups.__new__(ReplicaGroups)
    groups.group, groups.group_count, groups.identity, groups.manager = 1, 2, identity, _Manager()
    groups.meeting = Meeting(1, identity, timedelta(seconds=1), torch.distributed.HashStore())
    groups.config = FaultTolerance(
        enable=True, replica_id=1, group_count=2, min_replica_size=2, max_uncommitted_steps=3
    )
    groups.uncommitted_steps = groups.consecutive_uncommitted = groups.committed_steps = 0
    groups._tokens, groups._present = [0] * groups.group_count, [False] * groups.group_count
    return groups


class _Breaking(_Manager):
    """A quorum that breaks in the given attempts (numbered from 1): their commit is refused."""

    def __init__(self, broken: set[int]):
        self.broken, self.attempts = broken, 0

    def should_commit(self) -> bool:
        self.attempts += 1
        return self.attempts not in self.broken


def steps_with_broken_attempts(broken: set[int], steps: int) -> dict[str, Any]:
    """The debug MoE (moving routing biases) trained ``steps`` steps as the loop trains them, with
    the attempts in ``broken`` not committed: each step's loss, and at the end all of its state."""
    _, training = trainer_for([*MOE_ARGS, "--training.steps", str(steps)])
    groups = groups_without_torchft()
    groups.manager = _Breaking(broken)
    parts = list(training.step.parts.parts)
    at = next(i for i, part in enumerate(parts) if isinstance(part, OptimizerStep))
    step = dataclasses.replace(training.step, parts=Parts([*parts[:at], GroupCommit(groups), *parts[at:]]))
    state, losses = TrainState(), []
    while state.step < steps:
        state.step += 1
        stats = train_step(step, state)
        if not stats.result.committed:
            state.step -= 1
            continue
        losses.append(stats.result.loss_avg)
    found = {
        "loss": losses,
        "model": training.model.state_dict(),
        "optimizer": training.optimizer.optimizer.state_dict(),
        "lr_scheduler": training.optimizer.scheduler.state_dict(),
        "dataloader": training.step.batches.loader.state_dict(),
        "uncommitted": groups.uncommitted_steps,
    }
    return tree_map(lambda leaf: full(leaf) if isinstance(leaf, torch.Tensor) else leaf, found)


@pytest.mark.slow
def test_a_step_that_does_not_commit_keeps_nothing_and_its_rerun_is_the_step_never_broken():
    """Whether a fault breaks a step of the launched groups depends on when it lands; here the
    quorum breaks twice in a row in step 2 and once in step 3. The weights, routing biases,
    optimizer, schedule and data position then equal those of a run never broken, bit for bit."""
    [[broken, whole]] = run_ranks(_each_run, 1, [{2, 3, 5}, set()])
    assert broken["uncommitted"] == 3 and whole["uncommitted"] == 0
    assert_equal(broken, {**whole, "uncommitted": 3})


def _each_run(runs: list[set[int]]) -> list[dict[str, Any]]:
    return [steps_with_broken_attempts(broken, 4) for broken in runs]


def test_a_group_of_another_job_cannot_heal_and_names_what_differs():
    groups = groups_without_torchft(**{"model.flavor": "debugmodel", "optimizer.lr": "0.0008"})
    with pytest.raises(
        ConfigError, match="cannot heal from its peer: `optimizer.lr` is 0.0008 here, 0.002 in the peer; every group"
    ):
        groups._load_state_dict({"identity": {"model.flavor": "debugmodel", "optimizer.lr": "0.002"}})


def test_a_group_left_below_min_replica_size_ends_after_the_allowed_attempts():
    groups = groups_without_torchft()
    assert not groups.commit() and not groups.commit()
    with pytest.raises(
        JobError, match="3 attempts in a row could not commit .last: too few groups.: every other group is gone"
    ):
        groups.commit()


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--fault_tolerance.replica_id", "2"], "`fault_tolerance.replica_id` = 2 must be below"),
        (["--fault_tolerance.min_replica_size", "3"], "no step could ever commit"),
        (["--parallelism.data_parallel_replicate_degree", "2"], "the replica groups are the replicated dimension"),
        (["--debug.layout_invariant"], "the sum over replica groups is outside it"),
    ],
    ids=["replica_id", "min_replica_size", "dp_replicate", "layout_invariant"],
)
def test_a_layout_the_groups_cannot_run_is_refused_before_any_process_group(extra, expected):
    argv = ["--fault_tolerance.enable", "--fault_tolerance.group_count", "2", *extra]
    with pytest.raises(ConfigError, match=re.escape(expected)):
        resolve_job(load_config(argv), world_size=2)


def test_dry_run_describes_one_group_of_the_job():
    plan = resolve_job(load_config(["--fault_tolerance.enable", "--fault_tolerance.group_count", "3"]), world_size=2)
    described = describe(plan, None, "")
    assert "mesh: pp=1 dp_replicate=1 dp_shard=2" in described
    assert "replica groups: this is group 0 of 3, each a job of the mesh above; 3 x 16 sequences per step" in described


@pytest.mark.parametrize(
    "lighthouse, expected",
    [
        ("http://127.0.0.1:1", "cannot reach the torchft lighthouse at 'http://127.0.0.1:1' ("),
        ("", "`fault_tolerance.enable` needs the torchft lighthouse's address"),
    ],
    ids=["unreachable", "unset"],
)
def test_the_launcher_refuses_a_lighthouse_it_cannot_reach_before_any_process_starts(lighthouse, expected, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_lighthouse(FaultTolerance(enable=True, lighthouse=lighthouse, connect_timeout_seconds=1))


@pytest.mark.slow
def test_a_lighthouse_lost_mid_run_is_named_as_lost(tmp_path):
    """The lighthouse SIGKILLed while a group trains: the group's next quorum cannot form, and
    it ends saying the lighthouse is gone (not that too few groups run), exit 1."""
    port = free_port()
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    server = subprocess.Popen(
        [str(binary), "--min_replicas", "1", "--join_timeout_ms", "100", "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        group = worker(
            [
                *group_args(0, f"http://127.0.0.1:{port}", tmp_path / "group", steps=500),
                *("--fault_tolerance.group_count", "1", "--fault_tolerance.quorum_timeout_seconds", "5"),
            ]
        )
        assert group.stdout is not None
        for line in group.stdout:
            if "step: 2/500" in line:
                break
        server.kill()
        output = group.communicate(timeout=120)[0]
    finally:
        server.kill()
        group.kill()
    assert group.returncode == 1, output[-3000:]
    assert f"replica group 0 lost the torchft lighthouse at http://127.0.0.1:{port} (" in output, output[-3000:]
    assert "Traceback" not in output and "fewer groups are running" not in output, output[-3000:]


def wait_for_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.1)
