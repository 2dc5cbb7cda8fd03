"""Stopping on request: SIGTERM (SLURM, Kubernetes, a preempted node) and SIGINT (Ctrl-C).

A signal only sets a flag: the step in flight finishes. After every step the ranks' flags are
combined by one all-reduce (MAX) of a single integer on a CPU group (tens of microseconds, and
no GPU synchronisation), so every rank sees a request after the same step, saves a checkpoint
there (when checkpointing is on) and returns normally; the next run resumes from it as if
nothing had happened.

Under ``./run_train.sh`` the signal reaches the launcher, not the workers: it writes the
request into the file named by :data:`STOP_FILE_ENV`, which every worker reads with its flag.
The file outlives any worker, so a request is never lost: workers that do not exist yet, are
still importing, or are restarted by torchrun (``MAX_RESTARTS``) find it at their first check
and stop before their first step, instead of being killed mid-import and restarted.

Signals may arrive twice for one request (the terminal's SIGINT and torchrun's SIGTERM reach a
worker together), so repeats within ``GRACE_S`` seconds are ignored; a repeat after that aborts
at once, for a user who does not want to wait for the step and the checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("meshtrain")

GRACE_S = 3.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_FILE_ENV = "MESHTRAIN_STOP_FILE"
"""Set by the launcher for its workers: the file it writes a stop request into (the signal's name)."""


class StopRequests:
    """Each rank's stop flag, agreed on by all ranks once per step."""

    def __init__(self, group: dist.ProcessGroup | None = None, stop_file: str | None = None):
        self.group = group
        self.signal_name: str | None = None
        self.checkpointing = True
        """Whether a stop saves a checkpoint (``checkpoint.enable``), for what the request's log line promises."""
        stop_file = stop_file or os.environ.get(STOP_FILE_ENV)
        self._stop_file = Path(stop_file) if stop_file else None
        self._first_at = 0.0

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self._record(name, "received")
        elif time.monotonic() - self._first_at > GRACE_S:
            raise KeyboardInterrupt(f"a second {name}")

    def _record(self, name: str, how: str) -> None:
        self.signal_name, self._first_at = name, time.monotonic()
        then = (
            "with a checkpoint"
            if self.checkpointing
            else "without a checkpoint (`checkpoint.enable` is off: a rerun starts from the beginning)"
        )
        logger.warning("%s %s: stopping after this step, %s; send it again to stop at once", how, name, then)

    def requested(self) -> bool:
        """Whether this rank has been asked to stop: by a signal, or by the launcher's stop file."""
        if self.signal_name is None and self._stop_file is not None:
            try:
                name = self._stop_file.read_text().strip()
            except FileNotFoundError:
                return False
            self._record(name or "a stop request", "the launcher received")
        return self.signal_name is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        """Handle SIGTERM and SIGINT inside, restore the previous handlers after."""
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_after_step(self) -> bool:
        """Whether any rank has been asked to stop (a collective: every rank calls it after every step)."""
        flag = torch.tensor([int(self.requested())], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have this process sent ``signum`` when its parent dies (Linux): a child of a job killed with
    SIGKILL, which can clean nothing up, must not live on as an orphan."""
    if _LIBC is not None:
        _LIBC.prctl(1, signum)  # PR_SET_PDEATHSIG


WAIT_SLICE_S = 0.1
"""How long a main thread waits in one call before it lets the interpreter run pending signal handlers."""


def wait_process(process: subprocess.Popen) -> int:
    """``process.wait()``, in slices, so that a signal handler runs while this thread waits.

    A signal sent to the process may be delivered to any of its threads (``import torch`` starts
    one); its C handler there only flags it, and Python runs the handler when the main thread next
    executes bytecode, which one blocking ``waitpid`` would put off until the child has ended: a
    SIGTERM to the launcher would then reach the workers after they finished the job."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=WAIT_SLICE_S)


def wait_result(result: AsyncResult) -> Any:
    """``result.get()``, in slices, for the reason :func:`wait_process` gives."""
    while not result.ready():
        result.wait(WAIT_SLICE_S)
    return result.get()


class Stopped(Exception):
    """A SIGTERM or SIGINT that ends a job that has no step to finish (``--simulate``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_held: list[int] | None = None
"""While :func:`stops_held` is open, the signals that arrived inside it."""


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGINT raise :class:`Stopped` in the main thread, so that the ``with``
    blocks around it end their processes and pools on the way out."""

    def stop(signum: int, frame: object) -> None:
        if _held is not None:
            _held.append(signum)
            return
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Inside :func:`stopped_by_signals`, a stop waits until this block ends and is raised there
    (at the outermost such block's end when they nest).

    For starting processes: a :class:`Stopped` raised while a process is half started (forked,
    its pid not yet known to its parent) leaves a child that nobody ends, which then fails to
    unpickle the locks its parent took down on the way out and prints a traceback after the
    job's last line."""
    global _held
    outer, _held = _held, []
    try:
        yield
    finally:
        arrived, _held = _held, outer
        if arrived and outer is not None:
            outer.extend(arrived)
        elif arrived:
            raise Stopped(arrived[0])
