"""Run a function on N CPU processes joined in one gloo group, the way torchrun would.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so the
code under test initialises the process group exactly as in training. The function's return
value on each rank comes back to the caller.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Two cores run up to eight ranks: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    result = fn(*args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, world_size, _free_port(), out_dir, args),
            nprocs=world_size,
            start_method="spawn",
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
