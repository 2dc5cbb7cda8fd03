"""Process-group internals: changing a group's collective timeout after it was made."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

FEATURE = "collective timeouts (comm.init_timeout_seconds, comm.train_timeout_seconds)"
CHECKED_ON = ("2.11.0", "2.13.0", "2.14.1")
NAMES = ("_rank_not_in_group", "_set_pg_timeout")


def set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> bool:
    """Give ``group`` a new collective timeout; False when this rank is not in it."""
    if distributed_c10d._rank_not_in_group(group):
        return False
    distributed_c10d._set_pg_timeout(timeout, group)
    return True
