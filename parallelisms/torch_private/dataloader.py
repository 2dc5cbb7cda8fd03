"""The multiprocessing data loader's own workers (torch's and torchdata's iterator alike)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

FEATURE = "the data loader's worker processes (data.num_workers)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = ("_shutdown_workers", "_workers")


def shut_down_workers(iterator: Iterator[Any]) -> list[Any]:
    """torch's own shutdown of ``iterator``'s workers (it waits a few seconds for each, then
    sends SIGTERM); the worker processes, for whoever must make sure they end."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    return list(getattr(iterator, "_workers", []))
