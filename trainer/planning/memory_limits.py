"""How much memory one rank may use where the job runs: this machine's available RAM shared by
its ranks, one GPU's memory, or one GPU of a kind named by ``--target-gpu`` (planned from any
machine). The estimate it is compared with is ``memory_plan.py``'s."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from parallelisms.parallel_dims import device_type
from trainer.hardware import GIB, GPUS
from trainer.runtime.errors import ConfigError

TARGET_MEMORY_BYTES = {name: gpu.memory_bytes for name, gpu in GPUS.items()}
"""``--target-gpu``: one GPU's memory as ``torch.cuda.get_device_properties().total_memory``
reports it (``trainer/hardware.py``); ``cpu`` is this machine's available memory."""


def _meminfo(field: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _own_rss() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def cpu_limit_per_rank(local_ranks: int, started: bool) -> int | None:
    """This machine's available memory shared by its ranks (None where unknown).

    ``started``: called by a rank, whose siblings have started too and already hold about as
    much as this process (the estimate counts that as runtime), so it is added back.
    """
    available = _meminfo("MemAvailable")
    if available is None:
        return None
    if started:
        available += local_ranks * _own_rss()
    return available // max(local_ranks, 1)


def gpu_limit(device_index: int | None) -> int | None:
    """Total memory of one GPU: from torch in a rank (which owns a CUDA context anyway), from
    ``nvidia-smi`` in the launcher (so that it does not hold a CUDA context for the whole job)."""
    if device_index is not None:
        import torch

        return torch.cuda.get_device_properties(device_index).total_memory
    if not shutil.which("nvidia-smi"):
        return None
    query = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    sizes = [int(line) for line in query.stdout.split() if line.strip().isdigit()]
    return min(sizes) * 1024**2 if query.returncode == 0 and sizes else None


def memory_limit(
    local_ranks: int,
    device_index: int | None,
    started: bool,
    target: str | None = None,
    figures: dict[str, float] | None = None,
) -> tuple[int | None, str]:
    """The memory one rank may use, and what it is: on this machine (see
    ``trainer/planning/memory_plan.py``), or on one GPU of kind ``target`` (``--target-gpu``), as
    ``--target.memory_gib`` states it when given."""
    if target is not None and figures and "memory_gib" in figures:
        stated = figures["memory_gib"]
        return int(stated * GIB), f"one {target.upper()} with `--target.memory_gib {stated:g}`"
    if target in TARGET_MEMORY_BYTES:
        return TARGET_MEMORY_BYTES[target], f"one {target.upper()}'s memory (`--target-gpu {target}`)"
    if device_type() == "cuda" and target is None:
        return gpu_limit(device_index), "the GPU's memory"
    return cpu_limit_per_rank(local_ranks, started), f"this machine's available memory shared by {local_ranks} rank(s)"


def target_device(target: str) -> str:
    """The device type a ``--target-gpu`` name plans for; :class:`ConfigError` for an unknown name."""
    if target == "cpu":
        return "cpu"
    if target in TARGET_MEMORY_BYTES:
        return "cuda"
    raise ConfigError(f"--target-gpu {target}: unknown; use one of {', '.join([*TARGET_MEMORY_BYTES, 'cpu'])}.")
