"""What two replica groups must share to train together, compared whenever torchft forms a new
quorum, before the groups' process group meets in it (:class:`Meeting`): groups of different
jobs (another `optimizer.lr`, seed, batch, group count or process count) stop on every rank in
one line naming the setting, before any step, instead of summing gradients of different models
or training overlapping shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.config import FIELDS
from trainer.runtime.errors import ConfigError

if TYPE_CHECKING:
    from trainer.planning.job_plan import JobPlan

SHARED_SECTIONS = ("model", "optimizer", "lr_scheduler", "training", "parallelism", "moe", "float8", "fault_tolerance")
"""The sections that say what is trained: every key in them must agree, except ``PER_GROUP``."""
PER_GROUP_SECTIONS = (
    *("job", "machine", "comm", "metrics", "checkpoint", "activation_checkpoint", "compile", "profiling"),
    *("validation", "debug"),
)
"""The sections that say how a group runs, saves and reports (their keys in ``SHARED_ELSEWHERE``
excepted): recomputing activations or compiling changes no group's sums beyond round-off."""
PER_GROUP = frozenset(
    {
        "model.tokenizer_path",  # compared by content: the data identity's tokenizer hash
        "training.dataset_path",  # compared by content: the samples' hash
        "training.loss_chunk_tokens",
        "training.defer_gradient_reduction",
        "training.check_memory",
        "training.num_workers",
        "training.prefetch_factor",
        "training.data_timeout_seconds",
        "training.peak_flops",
        "training.max_consecutive_skipped_steps",
        "fault_tolerance.replica_id",
        "fault_tolerance.lighthouse",
        "fault_tolerance.quorum_timeout_seconds",
        "fault_tolerance.timeout_seconds",
        "fault_tolerance.connect_timeout_seconds",
        "fault_tolerance.max_uncommitted_steps",
    }
)
"""Keys of ``SHARED_SECTIONS`` that only say how this group's machine runs (memory, loader,
timeouts, paths whose contents are compared instead)."""
SHARED_ELSEWHERE = (
    "debug.seed",
    "checkpoint.initial_load_path",
    "checkpoint.initial_load_model_only",
    "checkpoint.initial_load_in_hf",
)
"""Keys of ``PER_GROUP_SECTIONS`` that must agree: the initial weights, which torchft does not
synchronise at step 0."""
PROCESSES = "processes per group (NGPU x NNODES)"
DATA_KEYS = {
    "samples_sha256": "the training samples (`training.dataset`, `training.dataset_path`)",
    "tokenizer_sha256": "the tokenizer (`model.tokenizer_path`)",
}
KEY = "meshtrain_identity"
"""The store folder, beside torchft's own ``torchft/<quorum>/<local rank>`` prefixes."""


def shared_keys() -> list[str]:
    """The config keys every group must set alike, in the schema's order."""
    return [
        key
        for key in FIELDS
        if (key.split(".")[0] in SHARED_SECTIONS and key not in PER_GROUP) or key in SHARED_ELSEWHERE
    ]


def job_identity(plan: JobPlan, data_identity: dict[str, str] | None) -> dict[str, str]:
    """What a group must share with the others: the process count, the shared config keys, and
    what they resolve to here (the mesh, the model, the batch, the data's contents, torch)."""
    config, dims = plan.config, plan.dims
    identity = {PROCESSES: str(dims.world_size)}
    identity.update({key: str(config.value(key)) for key in shared_keys()})
    identity["the mesh"] = f"pp={dims.pp} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} ep={dims.ep}"
    identity["the model"] = str(plan.model_args)
    identity["the batch"] = f"{plan.global_batch_size} sequences in {plan.microbatches} micro-batches per rank"
    for key, value in (data_identity or {}).items():
        identity[DATA_KEYS.get(key, key)] = value
    identity["torch"] = torch.__version__
    return identity


def differing(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The keys whose values differ, in ``mine``'s order (then any only ``theirs`` has)."""
    keys = list(mine) + [key for key in theirs if key not in mine]
    return [key for key in keys if mine.get(key) != theirs.get(key)]


def difference_line(mine: dict[str, str], theirs: dict[str, str], there: str) -> str:
    """``"`optimizer.lr` is 0.0008 here, 0.001 in group 1"`` (``there``: ``"in group 1"``) and
    the other keys that differ, or ``""`` when none does."""
    differ = differing(mine, theirs)
    if not differ:
        return ""
    first = differ[0]
    more = f" (also {', '.join(map(_named, differ[1:]))})" if differ[1:] else ""
    return f"{_named(first)} is {_shown(mine.get(first))} here, {_shown(theirs.get(first))} {there}{more}"


def _named(key: str) -> str:
    return f"`{key}`" if key in FIELDS else key


def _shown(value: str | None, limit: int = 120) -> str:
    if value is None:
        return "unset"
    return value if len(value) <= limit else value[: limit - 3] + "..."


@dataclass
class Meeting:
    """This group's identity, compared in each quorum torchft configures (its process group
    calls :meth:`agrees` before it meets the others); a conflict is kept for the main thread to
    raise, as torchft configures in a thread of its own.

    The groups' rank 0 compare through the quorum's store of local rank 0 (torchft spreads the
    local ranks' stores over the groups, and a group of fewer processes has no rank r to meet);
    each rank 0 then leaves its verdict in its own group's store (``group_store``, torchrun's),
    where the group's other ranks read it, so every rank of both groups stops in one line."""

    group: int
    identity: dict[str, str]
    timeout: timedelta
    group_store: dist.Store
    conflict: ConfigError | None = None

    def agrees(self, store_addr: str, quorum_id: int, quorum_rank: int, quorum_size: int, local_rank: int) -> bool:
        """Whether every group in quorum ``quorum_id`` runs this job. ``store_addr`` is torchft's
        ``host:port/torchft/<quorum>/<local rank>`` of this rank's quorum store; ``quorum_rank``
        this group's place among the quorum's ``quorum_size`` groups.

        Each wait is for a member asking for the same quorum at the same moment: one gone makes
        it wait as long as the process group's own meeting would, ``fault_tolerance.timeout_seconds``,
        and fail as that would (torchft leaves the step uncommitted)."""
        verdict = f"verdict/{quorum_id}"
        if local_rank == 0:
            found = "unchecked: a group of the quorum did not say what it runs"
            try:
                self.conflict = self._compare(store_addr, quorum_rank, quorum_size)
                found = "" if self.conflict is None else str(self.conflict)
            finally:
                self.group_store.set(verdict, json.dumps(found))
        else:
            # Rank 0 may take a timeout to connect and one to wait for its peers before it writes the verdict.
            self.group_store.wait([verdict], 3 * self.timeout)
            found = json.loads(self.group_store.get(verdict))
            if found.startswith("unchecked"):
                raise RuntimeError(f"replica group {self.group}: {found}")
            self.conflict = ConfigError(found) if found else None
        return self.conflict is None

    def _compare(self, store_addr: str, quorum_rank: int, quorum_size: int) -> ConfigError | None:
        address, _, prefix = store_addr.partition("/")
        host, _, port = address.rpartition(":")
        client = dist.TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=self.timeout
        )
        store = dist.PrefixStore(f"{prefix.rpartition('/')[0]}/{KEY}", client)
        store.set(str(quorum_rank), json.dumps({"group": self.group, "identity": self.identity}))
        peers = [str(rank) for rank in range(quorum_size) if rank != quorum_rank]
        if peers:
            store.wait(peers, self.timeout)
        for rank in peers:
            record = json.loads(store.get(rank))
            if conflict := self.against(record["group"], record["identity"]):
                return conflict
        return None

    def against(self, group: int, theirs: dict[str, str]) -> ConfigError | None:
        """The error for meeting ``group``, whose identity is ``theirs``, if it cannot train with this one."""
        if group == self.group:
            return ConfigError(
                f"two replica groups run with `fault_tolerance.replica_id` = {group}: each would train the same "
                "data shard; give every group its own id below `fault_tolerance.group_count`."
            )
        difference = difference_line(self.identity, theirs, f"in group {group}")
        if not difference:
            return None
        return ConfigError(
            f"replica group {self.group} cannot train with group {group}: {difference}; start every group with "
            "the same settings (docs/faults.md lists those that may differ)."
        )


def meeting_process_group(meeting: Meeting, device: torch.device, timeout: timedelta) -> Any:
    """torchft's process group between the groups (NCCL on a GPU, else gloo), which compares
    the groups' identities each time a new quorum configures it and meets the others only if
    they agree: a group of another process count would otherwise wait for a peer rank that
    does not exist, and one of another group count would sum tables of another size."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo

    class MeetingProcessGroup(base):  # type: ignore[misc, valid-type]  # torchft's classes are untyped
        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            if meeting.agrees(store_addr, quorum_id or 0, rank, world_size, group_rank or 0):
                super().configure(
                    store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
                )

    return MeetingProcessGroup(timeout=timeout)
