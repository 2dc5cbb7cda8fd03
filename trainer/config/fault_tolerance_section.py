"""The ``[fault_tolerance]`` section: replica groups that keep training through a failure
(``trainer/replica_groups.py``, docs/faults.md)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.fields import setting
from trainer.config.limits import MAX_TIMEOUT_SECONDS


@dataclass
class FaultTolerance:
    enable: bool = setting(
        False,
        'Run this job as one replica group of a fault-tolerant job (torchft, `pip install -e ".[ft]"`): the '
        "groups agree on a quorum through a lighthouse every step, a failed group is left out, a restarted one "
        "heals from a live peer. Each group is its own `./run_train.sh` with its own dump folder.",
    )
    replica_id: int = setting(
        0, "This group's index, 0 to `group_count` - 1: it reads data shard (step, replica_id) every step.", ge=0
    )
    group_count: int = setting(
        1,
        "Replica groups the data is sharded over; the job's global batch is `group_count` x this group's. "
        "A group missing from a step leaves its shard untrained (docs/faults.md).",
        ge=1,
    )
    min_replica_size: int = setting(
        1, "Fewest groups a step may commit with; a step with fewer is not committed and is retried.", ge=1
    )
    lighthouse: str = setting(
        "",
        "Address of the torchft lighthouse (`http://host:port`, started with `torchft_lighthouse`); "
        "empty: the `TORCHFT_LIGHTHOUSE` environment variable.",
    )
    quorum_timeout_seconds: int = setting(
        60,
        "Longest wait for a quorum at the start of a step (a restarted group's build counts against the "
        "others' wait only up to the lighthouse's join timeout).",
        ge=1,
        le=MAX_TIMEOUT_SECONDS,
    )
    timeout_seconds: int = setting(
        30,
        "Longest wait for a collective between groups or a healing transfer: a group that stalls longer is "
        "left out of the step.",
        ge=1,
        le=MAX_TIMEOUT_SECONDS,
    )
    connect_timeout_seconds: int = setting(
        10, "Longest wait to reach the lighthouse or a peer's manager.", ge=1, le=MAX_TIMEOUT_SECONDS
    )
    max_uncommitted_steps: int = setting(
        10,
        "End the group after this many attempts in a row that could not commit (too few groups, a quorum "
        "that keeps changing); 0 never ends it for this.",
        ge=0,
    )
