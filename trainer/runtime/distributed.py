"""The job's process group: joining it, its collective timeouts, and surviving restarts.

**Timeouts.** A rank that hangs, is stopped or dies leaves the others blocked inside a
collective. Without a deliberate timeout that is a silent wait of 30 minutes (gloo) or 10
(NCCL). The group starts with ``comm.init_timeout_seconds`` (start-up, building, loading and
the first step may legitimately be slow) and every group the training step uses is switched to
``comm.train_timeout_seconds`` once the first step has finished; a collective that waits longer
raises, and ``trainer/train.py`` turns that into a message naming the setting.

**Restarts.** torchrun (``MAX_RESTARTS``) restarts every worker of a job after one fails, and
the new workers meet in the *same* TCP store as the old ones (torchrun shares its rendezvous
store with the workers). The default group's keys carry no attempt number, so a new rank can
read a dead rank's gloo address from the previous attempt and fail with ``Gloo connectFullMesh
failed ... Connection refused``. Here the store is prefixed with torchrun's restart count, so
every attempt meets in a namespace of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from parallelisms.torch_private import process_group
from trainer.runtime.errors import JobError, UserError


def init_distributed(device_type: str, timeout_s: float) -> torch.device:
    """Join the job's process group (one of world size 1 when not launched by torchrun), once."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device_type == "cuda" else None
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return device
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"meshtrain/attempt-{attempt}", store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )
    return device


def set_collective_timeout(groups: Iterable[dist.ProcessGroup], seconds: float) -> None:
    """Give ``groups`` (and the default group) a new collective timeout (private torch API,
    as torchtitan uses it)."""
    timeout = timedelta(seconds=seconds)
    seen: set[int] = set()
    for group in [dist.group.WORLD, *groups]:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        process_group.set_timeout(group, timeout)


class CollectiveTimeouts:
    """Which collective timeout applies now, and what a timeout means to the user.

    ``comm.init_timeout_seconds`` until :meth:`start_training` (called after the first step),
    ``comm.train_timeout_seconds`` after it.
    """

    def __init__(self, init_timeout_s: float, train_timeout_s: float):
        self.train_timeout_s = train_timeout_s
        self.key, self.seconds = "comm.init_timeout_seconds", init_timeout_s

    def start_training(self, groups: Iterable[dist.ProcessGroup]) -> None:
        set_collective_timeout(groups, self.train_timeout_s)
        self.key, self.seconds = "comm.train_timeout_seconds", self.train_timeout_s

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Turn a collective that timed out inside into a :class:`JobError` naming the setting."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            if isinstance(error, UserError) or not is_collective_timeout(error):
                raise
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            raise JobError(
                f"a collective waited more than `{self.key}` = {self.seconds:g} s for another rank "
                f"({first_line}). A rank has stalled, hung or died: the job stops instead of waiting "
                f"silently (checkpoints already written are kept). If a step, data loading or a checkpoint "
                f"load legitimately takes longer, raise `{self.key}`."
            ) from error


_TIMEOUT_WORDS = ("timed out", "timeout", "watchdog")


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective that gave up waiting for a peer.

    gloo raises ``RuntimeError`` ("Timed out waiting 5000ms for recv operation to complete"),
    NCCL's watchdog a ``DistBackendError``; neither has a dedicated exception type.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, UserError):
            continue  # explained already; its words ("timeout") are not a collective's
        if isinstance(found, (RuntimeError, dist.DistError)):
            text = str(found).lower()
            if any(word in text for word in _TIMEOUT_WORDS):
                return True
        if isinstance(found, CheckpointException):  # a checkpoint collective, wrapped per rank
            pending.extend(exc for exc, _ in found.failures.values())
        pending.extend((found.__cause__, found.__context__))
    return False
