"""Process-group internals: changing a group's collective timeout after it was made, and the
process groups' names, which torch.compile's on-disk caches must be scoped by."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

FEATURE = "collective timeouts (comm.init_timeout_seconds, comm.train_timeout_seconds) and torch.compile's caches"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
NAMES = ("_rank_not_in_group", "_set_pg_timeout", "_inductor", "_world", "pg_names")
CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
_cache_base: list[str] = []
"""The caches' folder as the process found it, before :func:`scope_compile_cache` chose one below it."""


def set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> bool:
    """Give ``group`` a new collective timeout; False when this rank is not in it."""
    if distributed_c10d._rank_not_in_group(group):
        return False
    public = getattr(dist, "set_timeout", None)  # from 2.15, which deprecates the private one
    if public is not None:
        public(timeout, group)
    else:
        distributed_c10d._set_pg_timeout(timeout, group)
    return True


def scope_compile_cache() -> str:
    """Give torch.compile's on-disk caches a folder of their own for the process groups that exist
    now, and return it.

    The FX graph and AOT autograd caches key a compiled graph without the names of the process
    groups its collectives run over: a graph compiled in another job (or, in one process, for
    groups since destroyed) comes back with their names, and its collectives then run over a group
    that does not exist, or over another group that has the name. The names follow the order the
    groups were made in, so the same job on the same ranks finds its own folder again: a restart
    keeps its warm cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if not _cache_base:
        _cache_base.append(os.environ.get(CACHE_DIR) or default_cache_dir())
    groups = sorted(
        (name, tuple(dist.get_process_group_ranks(group))) for group, name in distributed_c10d._world.pg_names.items()
    )
    digest = hashlib.sha256(repr(groups).encode()).hexdigest()[:16]
    folder = os.path.join(_cache_base[0], f"groups-{digest}")
    os.environ[CACHE_DIR] = folder
    return folder
