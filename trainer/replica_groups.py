"""Fault-tolerant replica groups: this job is one of ``fault_tolerance.group_count`` groups that
keep training when another fails, built on torchft (``pip install -e ".[ft]"``).

Each group is its own job (its own mesh, FSDP and any TP/CP/PP inside it); local rank r of every
group meets the others' local rank r in torchft's process group, whose members are the step's
*quorum*, agreed through the lighthouse when the step begins (:meth:`ReplicaGroups.begin_step`).

Exact over the participants: the gradient accumulator sums what a step has in common across the
quorum instead of averaging it over the groups (torchft's default), so the step's N is the valid
tokens of the groups that took part, the gradient is their summed gradient scaled once by
``clip_coef / N``, and the logged loss their token-weighted mean. A group left out of a step
(dead, or too slow for ``fault_tolerance.timeout_seconds``) leaves its shard of that step
untrained: the shards are fixed per (step, group), so the data order is determined by which
groups took part in which step, and nothing is trained twice.

A step during which the quorum broke is not committed (torchft's ``should_commit``): the weights,
optimizer, schedule and data position stay those before it, and the step is run again with the
new quorum. A group that joins behind the others (restarted, or new) heals at the start of a step
from a live peer's same local rank: weights, optimizer state, schedule, data position and train
state. Groups of different jobs never train together: every new quorum compares the groups'
identities before their process group meets (``trainer/replica_identity.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from trainer.config import FaultTolerance
from trainer.replica_healing import HealedParts, load_received, sent_state, weights_digest
from trainer.replica_identity import Meeting, difference_line, meeting_process_group
from trainer.runtime.errors import ConfigError, JobError, UserError

logger = logging.getLogger("meshtrain")

MANAGER_PREFIX = "meshtrain_group_"
"""torchft replica ids are this and the group's index (torchft reads its trailing digits)."""


@dataclass(frozen=True)
class ReplicaStats:
    """Which groups took part in a step and the valid tokens each contributed."""

    group_count: int
    tokens: tuple[int, ...]
    """Per group (0 for a group that did not take part)."""
    present: tuple[bool, ...]
    uncommitted_steps: int
    """Attempts not committed so far in this group's run (each was run again)."""

    @property
    def groups(self) -> list[int]:
        return [g for g, here in enumerate(self.present) if here]


def lighthouse_address(config: FaultTolerance) -> str:
    return config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def check_lighthouse(config: FaultTolerance) -> None:
    """Before the launcher starts any process: the lighthouse answers at its address, so a wrong
    or missing one is one line in seconds, not a group that builds its model and then fails."""
    address = lighthouse_address(config)
    if not address:
        raise ConfigError(
            "`fault_tolerance.enable` needs the torchft lighthouse's address: set `fault_tolerance.lighthouse` "
            "(http://host:port) or TORCHFT_LIGHTHOUSE."
        )
    if unreachable := _unreachable(address, config.connect_timeout_seconds):
        raise ConfigError(
            f"cannot reach the torchft lighthouse at {address!r} ({unreachable}): start it (`torchft_lighthouse "
            "--min_replicas 1`) or fix `fault_tolerance.lighthouse`."
        )


class ReplicaGroups:
    """This group's torchft manager and what the step asks of it."""

    def __init__(
        self,
        config: FaultTolerance,
        parts: HealedParts,
        identity: dict[str, str],
        device: torch.device,
    ):
        # torchft's Rust side logs every quorum at INFO; its warnings are what a user needs.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from torchft.manager import Manager

        self.config, self.parts, self.identity, self.device = config, parts, identity, device
        self.group, self.group_count = config.replica_id, config.group_count
        lighthouse = lighthouse_address(config)
        self.lighthouse = lighthouse
        timeout = timedelta(seconds=config.timeout_seconds)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart's quorums may number anew
        verdicts = dist.PrefixStore(f"meshtrain/attempt-{attempt}/meeting", _group_store())
        self.meeting = Meeting(self.group, identity, timeout, verdicts)
        _forget_an_earlier_attempts_manager()
        try:
            self.manager = Manager(
                pg=meeting_process_group(self.meeting, device, timeout),
                load_state_dict=self._load_state_dict,
                state_dict=self._state_dict,
                min_replica_size=config.min_replica_size,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=config.connect_timeout_seconds),
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                lighthouse_addr=lighthouse,
                replica_id=f"{MANAGER_PREFIX}{self.group}",
                init_sync=False,
            )
        except RuntimeError as e:
            raise JobError(
                f"replica group {self.group} cannot reach the torchft lighthouse at {lighthouse!r} within "
                f"`fault_tolerance.connect_timeout_seconds` = {config.connect_timeout_seconds}: start it "
                f"(`torchft_lighthouse --min_replicas 1`) or fix `fault_tolerance.lighthouse` "
                f"({str(e).splitlines()[0][:160]})."
            ) from None
        self.uncommitted_steps = 0
        self.committed_steps = 0
        """Steps this group trained and committed (a healed group took the others from a peer)."""
        self.consecutive_uncommitted = 0
        self._joined = self._healed = False
        self._tokens: list[int] = [0] * self.group_count
        self._present: list[bool] = [False] * self.group_count

    def resume_at(self, step: int) -> None:
        """After a resume from checkpoint: torchft's step is the loop's last finished step, so a
        group resumed from an older checkpoint than the others' heals from them."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def begin_step(self) -> None:
        """Agree on this step's quorum; a group behind the others heals here, before the step's
        data is fetched (the peer's data position is the one it then reads from).

        A process's first quorum waits for every group unless it healed: a group that starts
        (or resumes from its checkpoint) and finds nobody ahead cannot tell a job that has not
        begun from one whose other groups are still starting, and training alone then would
        fork the run in two."""
        self._quorum()
        deadline = time.monotonic() + self.config.quorum_timeout_seconds
        while not self._joined:
            if self._healed or self.manager.num_participants() >= self.group_count:
                self._joined = True
                break
            if time.monotonic() > deadline:
                raise JobError(
                    f"replica group {self.group}: only {self.manager.num_participants()} of "
                    f"`fault_tolerance.group_count` = {self.group_count} groups joined within "
                    f"`fault_tolerance.quorum_timeout_seconds` = {self.config.quorum_timeout_seconds} s, and none "
                    "is ahead to heal from: start every group (a job starts, or resumes from its checkpoints, "
                    "with all of them)."
                )
            time.sleep(0.05)
            self._quorum()

    def _quorum(self) -> None:
        """One quorum; a group of another job met in it ends this one before anything else
        (what follows from meeting it, a failed transfer or process group, is its consequence)."""
        try:
            self.manager.start_quorum()
        except UserError:
            raise
        except TimeoutError:
            self._raise_conflict()
            if unreachable := _unreachable(self.lighthouse, self.config.connect_timeout_seconds):
                raise self._lost_lighthouse(unreachable) from None
            raise JobError(
                f"replica group {self.group}: no quorum formed within `fault_tolerance.quorum_timeout_seconds` = "
                f"{self.config.quorum_timeout_seconds} s (lighthouse {self.lighthouse}): fewer groups are running "
                f"than the lighthouse's `--min_replicas`; start the missing groups or lower it. Checkpoints "
                "already written are kept."
            ) from None
        except RuntimeError as e:
            self._raise_conflict()
            raise self._lost_lighthouse(str(e).splitlines()[0][:200]) from None
        self._raise_conflict()

    def _raise_conflict(self) -> None:
        if self.meeting.conflict is not None:
            raise self.meeting.conflict

    def _lost_lighthouse(self, why: str) -> JobError:
        return JobError(
            f"replica group {self.group} lost the torchft lighthouse at {self.lighthouse} ({why}): restart the "
            "lighthouse, then this group: it heals from a live group, or resumes from its newest checkpoint. "
            "Checkpoints already written are kept."
        )

    # The sums the gradient accumulator and the experts' balancing ask for
    # (``trainer/step/grad_accumulator.py``, ``trainer/step/expert_balance.py``).

    def participants(self) -> int:
        """The groups in this step's quorum, every one of which trains it (the quorum is
        synchronous, so a healing group takes part once healed); a step whose quorum breaks
        does not commit, so its count never matters."""
        return int(self.manager.num_participants())

    def sum_count(self, count: torch.Tensor) -> torch.Tensor:
        """This group's valid tokens (``(1,)`` int64) -> the step's over the participating groups;
        also learns which groups took part and what each contributed."""
        n = self.group_count
        table = torch.zeros(2 * n, dtype=torch.int64, device=count.device)
        table[self.group] = count[0]
        table[n + self.group] = 1
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        values = table.tolist()
        self._tokens, self._present = values[:n], [bool(v) for v in values[n:]]
        return table[:n].sum().reshape(1)

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum every tensor in place over the participating groups, one collective per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def max_(self, tensor: torch.Tensor) -> None:
        self.manager.allreduce(tensor, reduce_op=ReduceOp.MAX).wait()

    def commit(self) -> bool:
        """Whether every collective of the step reached the same quorum: only then may the
        optimizer step. A step that cannot commit is counted; too many in a row end the group."""
        committed = bool(self.manager.should_commit())
        if committed:
            self.consecutive_uncommitted = 0
            self.committed_steps += 1
            return True
        self.uncommitted_steps += 1
        self.consecutive_uncommitted += 1
        error = self.manager.errored()
        why = str(error.original_exception).splitlines()[0][:160] if error is not None else "too few groups"
        if _rank0():
            logger.warning(
                "replica group %d: the step could not commit (%s; %d of at least %d group(s) in the quorum); "
                "it is run again with the next quorum",
                self.group,
                why,
                self.manager.num_participants(),
                self.config.min_replica_size,
            )
        limit = self.config.max_uncommitted_steps
        if limit and self.consecutive_uncommitted >= limit:
            raise JobError(
                f"replica group {self.group}: {self.consecutive_uncommitted} attempts in a row could not commit "
                f"(last: {why}): every other group is gone, or fewer than `fault_tolerance.min_replica_size` = "
                f"{self.config.min_replica_size} are running. Start the groups again: they heal from a live one "
                "or resume from their newest checkpoints."
            )
        return False

    def stats(self) -> ReplicaStats:
        return ReplicaStats(self.group_count, tuple(self._tokens), tuple(self._present), self.uncommitted_steps)

    def reported(self) -> tuple[int, int, int]:
        """The groups that trained the step, their valid tokens, the attempts run again so far."""
        stats = self.stats()
        return len(stats.groups), sum(stats.tokens), stats.uncommitted_steps

    def log_step(self, step: int, loss: float) -> None:
        """Rank 0's line per step: who trained it, their tokens, the exact loss; a missing group's
        shard of the step is named as skipped."""
        if not _rank0():
            return
        stats = self.stats()
        missing = [g for g in range(self.group_count) if not stats.present[g]]
        logger.info(
            "replica groups: step %d trained by groups %s of %d, tokens %s, loss %r%s",
            step,
            stats.groups,
            self.group_count,
            list(stats.tokens),
            loss,
            f"; skipped the shards ({step}, g) of groups {missing}" if missing else "",
        )

    # Healing (``trainer/replica_healing.py``): what a live group sends and a healing one loads.

    def _state_dict(self) -> dict[str, Any]:
        return sent_state(self.parts, self.identity)

    def _load_state_dict(self, received: dict[str, Any]) -> None:
        self._raise_conflict()
        difference = difference_line(self.identity, received["identity"], "in the peer")
        if difference:
            raise ConfigError(
                f"replica group {self.group} cannot heal from its peer: {difference}; every group must run the same "
                "settings, mesh and versions."
            )
        load_received(self.parts, received)
        self._healed = True
        if _rank0():
            logger.info("replica group %d healed from a live group at step %d", self.group, self.parts.train_state.step)

    def log_digests(self) -> None:
        """Rank 0 logs every local rank's weight digest, for comparing the groups."""
        digests: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, weights_digest(self.parts.model))
        if _rank0():
            logger.info("replica group %d weights: %s", self.group, " ".join(f"{d}" for d in digests))

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _unreachable(address: str, timeout_s: float) -> str:
    """Why the lighthouse at ``address`` does not answer (``""``: it does)."""
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        return str(e)
    return ""


def _group_store() -> dist.Store:
    """This group's torchrun store, where torchft's Manager meets the group's ranks."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
    )


def _forget_an_earlier_attempts_manager() -> None:
    """torchft's Manager publishes the group's rank 0 manager address in torchrun's store, which
    outlives a restart of the group's processes: a restarted group's other ranks could read the
    killed attempt's address and time out connecting to it (they wait for the key, not for a
    new value). Rank 0 deletes it before any rank starts its Manager."""
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if dist.get_rank() == 0:
        store = _group_store()
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
