"""Rank 0 decides what the file system holds; every rank acts on its answer.

Ranks may see a shared folder differently for a moment (caches, a slow mount), and a rank that
decided alone could load another checkpoint or wait in a collective the others never enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def agree(decide: Callable[[], Any], group: dist.ProcessGroup) -> Any:
    """Rank 0's ``decide()`` on every rank of ``group``; rank 0's error, whatever it is, is raised
    on every rank, so no rank is left waiting."""
    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except Exception as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0, group=group)
    if box[1] is not None:
        raise box[1]
    return box[0]
