"""What the metrics tests share (``test_metrics.py``, ``test_dashboard.py``): the TensorBoard
tags and dashboard aliases a run logs on CPU and only on a GPU, a step's stats, a logger writing
to a temporary folder and its events read back, and the CUDA memory API faked on a CPU machine."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Iterable

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util

from trainer.metrics import MetricsLogger
from trainer.metrics.logger import LogSettings, Throughput, open_sinks
from trainer.metrics.tensorboard_sink import TensorBoardSink
from trainer.step.expert_balance import BALANCE_LOSS, LOAD_CHART
from trainer.step.group_commit import LOGGED as GROUP_LOGGED
from trainer.step.part import StepResult
from trainer.step.sums import Logged
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
    """A rank 0's logger; ``overrides`` name fields of its settings or throughput, ``rank``, and
    ``moe_layers``, ``balance_loss`` and ``replica_groups``, which declare those parts' values as
    the step would."""
    kwargs: dict[str, object] = dict(
        console=True,
        dump_folder=str(tmp_path),
        tb_folder="tb",
        tensorboard=True,
        log_freq=2,
        color=False,
        total_steps=5,
        device=torch.device("cpu"),
        flops_per_token=FLOPS_PER_TOKEN,
        peak_flops=None,
        global_tokens_per_step=GLOBAL_TOKENS,
    )
    kwargs.update({"tensorboard" if k == "enable_tensorboard" else k: v for k, v in overrides.items()})
    moe_layers = tuple(kwargs.pop("moe_layers", ()))  # type: ignore[arg-type]
    loads = tuple(
        Logged(f"moe/load_max_over_mean/layer_{i}", "expert load max/mean per layer", LOAD_CHART, digits=2)
        for i in moe_layers
    )
    logged = ((BALANCE_LOSS,) if kwargs.pop("balance_loss", False) else ()) + loads
    logged += GROUP_LOGGED if kwargs.pop("replica_groups", False) else ()
    rank = int(kwargs.pop("rank", 0))  # type: ignore[call-overload]
    split = {f.name for f in dataclasses.fields(Throughput)}
    throughput = Throughput(**{k: v for k, v in kwargs.items() if k in split})  # type: ignore[arg-type]
    settings = LogSettings(**{k: v for k, v in kwargs.items() if k not in split})  # type: ignore[arg-type]
    return MetricsLogger(settings, throughput, logged, open_sinks(settings, throughput, logged, rank, {}))


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


def _layout(acc: EventAccumulator) -> layout_pb2.Layout:
    (event,) = acc.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())


def _layout_charts(acc: EventAccumulator) -> dict[str, list[str]]:
    """Chart title -> the tags of its series; each is a margin chart whose band is its own line."""
    charts = {}
    for category in _layout(acc).category:
        for chart in category.chart:
            assert chart.WhichOneof("content") == "margin", chart.title
            for series in chart.margin.series:
                assert series.lower == series.upper == series.value, (chart.title, series)
            charts[chart.title] = [series.value for series in chart.margin.series]
    return charts


def tb_dir(logger: MetricsLogger) -> str | None:
    """The TensorBoard run folder ``logger`` writes, None with TensorBoard off."""
    return next((str(s.folder) for s in logger.sinks if isinstance(s, TensorBoardSink)), None)
