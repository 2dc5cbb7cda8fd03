"""How many CPU threads each training process gets: ``OMP_NUM_THREADS``, chosen by the launcher.

PyTorch's CPU kernels split their work over OpenMP threads that wait for each other at the end of
every parallel region, spinning. Left alone, each process takes one thread per core; torchrun
sets 1 only when it starts more than one process. Both go wrong on a CPU shared with other work:
when a thread of a region is descheduled, all the others spin until it runs again, and a step
crawls (a 1-process debug run took 136 s with the default threads against 12 s with one, on two
cores that other jobs kept busy). The launcher therefore gives each of a node's processes an
equal share of the cores that are idle when it starts (the usable cores less the one-minute load
average), at least one. A value the user set is kept as it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

THREADS_ENV = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, math.floor(int(quota) / int(period))))


def busy_cores() -> float:
    """Cores other work keeps busy: the one-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def threads_per_process(local_processes: int, cores: int, busy: float) -> int:
    """An equal share of the idle cores for each of this node's processes, at least one."""
    idle = cores - round(busy)
    return max(1, min(cores, idle) // max(1, local_processes))


def thread_env(environ: Mapping[str, str], local_processes: int) -> dict[str, str]:
    """The ``OMP_NUM_THREADS`` the workers get: the user's, or the share chosen here."""
    if environ.get(THREADS_ENV):
        return {THREADS_ENV: environ[THREADS_ENV]}
    return {THREADS_ENV: str(threads_per_process(local_processes, usable_cores(), busy_cores()))}
