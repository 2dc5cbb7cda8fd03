"""Stopping on request: SIGTERM (SLURM, Kubernetes, a preempted node) and SIGINT (Ctrl-C).

A signal only sets a flag: the step in flight finishes. After every step the ranks' flags are
combined by one all-reduce (MAX) of a single integer on a CPU group (tens of microseconds, and
no GPU synchronisation), so every rank sees a request after the same step, saves a checkpoint
there (when checkpointing is on) and returns normally; the next run resumes from it as if
nothing had happened.

Signals may arrive twice for one request (the terminal's SIGINT and torchrun's SIGTERM reach a
worker together), so repeats within ``GRACE_S`` seconds are ignored; a repeat after that aborts
at once, for a user who does not want to wait for the step and the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger("meshtrain")

GRACE_S = 3.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Each rank's stop flag, agreed on by all ranks once per step."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.signal_name: str | None = None
        self._first_at = 0.0

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name, self._first_at = name, time.monotonic()
            logger.warning(
                "received %s: stopping after this step (with a checkpoint when checkpointing is on); "
                "send it again to stop at once",
                name,
            )
        elif time.monotonic() - self._first_at > GRACE_S:
            raise KeyboardInterrupt(f"a second {name}")

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
        flag = torch.tensor([int(self.signal_name is not None)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
