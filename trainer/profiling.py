"""Where the time and the memory go: torch.profiler traces and CUDA memory snapshots.

Traces: every ``profiling.profile_freq`` steps one step is recorded (after one warm-up step)
and written per rank as ``{dump}/{save_traces_folder}/iteration_N/rankR_trace.json``.
Memory snapshots (CUDA): the allocator's history is recorded from the start and dumped every
``profile_freq`` steps, and once more when the job runs out of memory, as
``{dump}/{save_memory_snapshot_folder}/iteration_N/rankR_memory_snapshot.pickle``.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

from parallelisms.torch_private import kernels
from trainer.config import Profiling

logger = logging.getLogger("meshtrain")


class Profiler:
    """Call ``step(step)`` after every training step."""

    def __init__(self, config: Profiling, dump_folder: str, rank: int):
        self.config, self.rank, self.step_num = config, rank, 0
        self.traces = Path(dump_folder) / config.save_traces_folder
        self.snapshots = Path(dump_folder) / config.save_memory_snapshot_folder
        self.torch_profiler: torch.profiler.profile | None = None
        if config.enable_profiling:
            freq = config.profile_freq
            self.torch_profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                schedule=torch.profiler.schedule(wait=freq - 2, warmup=1, active=1),
                on_trace_ready=self._save_trace,
            )

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        folder = self.traces / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        logger.info("profiler trace written to %s", folder)

    def step(self, step: int) -> None:
        """After training step ``step`` (the run's step count, so traces are named by it)."""
        self.step_num = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.config.enable_memory_snapshot and self.step_num % self.config.profile_freq == 0:
            self.dump_memory_snapshot(f"iteration_{self.step_num}")

    def dump_memory_snapshot(self, name: str) -> None:
        folder = self.snapshots / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(kernels.cuda_memory_snapshot(), f)
        logger.info("memory snapshot written to %s", folder)


@contextlib.contextmanager
def profiling(config: Profiling, dump_folder: str, rank: int) -> Iterator[Profiler]:
    """Profile the training loop inside; on CUDA out-of-memory, leave a snapshot behind."""
    profiler = Profiler(config, dump_folder, rank)
    if config.enable_memory_snapshot:
        kernels.record_cuda_memory_history()
    try:
        if profiler.torch_profiler is not None:
            with profiler.torch_profiler:
                yield profiler
        else:
            yield profiler
    except torch.OutOfMemoryError:
        if config.enable_memory_snapshot:
            profiler.dump_memory_snapshot(f"iteration_{profiler.step_num + 1}_out_of_memory")
        raise
