"""What the metrics tests share (``test_metrics.py``, ``test_dashboard.py``): the TensorBoard
tags and dashboard aliases a run logs on CPU and only on a GPU, a step's stats, a logger writing
to a temporary folder and its events read back, and the CUDA memory API faked on a CPU machine."""

from __future__ import annotations

import os
import types
from collections.abc import Iterable

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.metrics import MetricsLogger
from trainer.step.part import StepResult
from trainer.step.train_step import StepStats

CPU_TAGS = {
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "n_valid_tokens",
    "n_tokens_seen",
    "throughput(tps)",
    "tflops",
    "memory/max_active(GiB)",
    "time_metrics/end_to_end(s)",
    "time_metrics/data_loading(%)",
    "n_skipped_steps",
}
CPU_ALIASES = {
    "dashboard/throughput_tps",
    "dashboard/memory_max_active_GiB",
    "dashboard/end_to_end_s",
    "dashboard/data_loading_pct",
}
GPU_ONLY_TAGS = {
    "mfu(%)",
    "memory/max_reserved(GiB)",
    "memory/max_active(%)",
    "memory/max_reserved(%)",
    "memory/num_alloc_retries",
    "memory/num_ooms",
}
GPU_ONLY_ALIASES = {
    "dashboard/mfu_pct",
    "dashboard/memory_max_reserved_GiB",
    "dashboard/memory_max_active_pct",
    "dashboard/memory_max_reserved_pct",
}
GPU_ONLY_CHARTS = {"MFU %", "peak memory (% of device)", "allocator retries and OOMs"}
VALIDATION_TAGS = {"validation/loss", "validation/perplexity", "validation/seconds"}
GIB = 1024**3

FLOPS_PER_TOKEN = 1_000_000
GLOBAL_TOKENS = 512
LOCAL_TOKENS = 128


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Fakes the CUDA memory API so the GPU-only branches run on a CPU-only machine; returns the resets."""
    resets: list[object] = []
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda device=None: {
            "active_bytes.all.peak": 2 * GIB,
            "reserved_bytes.all.peak": 4 * GIB,
            "num_alloc_retries": 3,
            "num_ooms": 1,
        },
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(total_memory=80 * GIB),
    )
    return resets


def _stats(step: int, **overrides: object) -> StepStats:
    """A step's stats; ``overrides`` name fields of the stats or of the accumulator's result."""
    result: dict[str, object] = dict(
        loss_avg=10.0 / step,
        loss_max=12.0 / step,
        grad_norm=1.5,
        n_valid_tokens=400 + step,
        skipped=False,
        skip_reason="",
        lr=1e-3 * step,
        values={},
    )
    fields: dict[str, object] = dict(
        step=step, local_tokens=LOCAL_TOKENS, n_skipped_steps=0, data_time_s=0.1, step_time_s=0.5
    )
    for name, value in overrides.items():
        (result if name in result else fields)[name] = value
    return StepStats(result=StepResult(**result), **fields)  # type: ignore[arg-type]


def _make_logger(tmp_path: os.PathLike[str], **overrides: object) -> MetricsLogger:
    kwargs: dict[str, object] = dict(
        rank=0,
        console=True,
        dump_folder=str(tmp_path),
        tb_folder="tb",
        enable_tensorboard=True,
        log_freq=2,
        color=False,
        device=torch.device("cpu"),
        total_steps=5,
        flops_per_token=FLOPS_PER_TOKEN,
        peak_flops=None,
        global_tokens_per_step=GLOBAL_TOKENS,
    )
    kwargs.update(overrides)
    return MetricsLogger(**kwargs)  # type: ignore[arg-type]


def _run(logger: MetricsLogger, steps: Iterable[StepStats]) -> None:
    for stats in steps:
        logger.log(stats)
    logger.close()


def _read_events(tb_dir: str) -> EventAccumulator:
    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return acc


def _scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in acc.Scalars(tag)}
