"""Tests for trainer.metrics: FLOPs/MFU accounting, log cadence, console and TensorBoard output."""

from __future__ import annotations

import io
import logging
import math
import os
import re
import types
from collections.abc import Iterable

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util

from trainer import metrics
from trainer.metrics import (
    CONSOLE_TTY_ENV,
    DASHBOARD_ALIASES,
    MetricsLogger,
    StepStats,
    flops_per_token,
    peak_flops,
    use_color,
)
from trainer.validation import ValidationResult

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


def test_flops_per_token_matches_hand_count() -> None:
    n_params, n_layers, dim, seq_len = 1000, 2, 8, 16
    # Weights: 2 FLOPs/param forward (multiply + add), 4 backward.
    weight_flops = (2 + 4) * n_params
    # Attention per layer and token: Q·K^T and A·V are each 2·S·d forward,
    # and backward costs twice the forward.
    attention_flops = n_layers * 3 * (2 * seq_len * dim + 2 * seq_len * dim)
    result = flops_per_token(n_params, n_layers, dim, seq_len)
    assert result == weight_flops + attention_flops == 9072
    assert isinstance(result, int)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA B200", 2.25e15),
    ],
)
def test_peak_flops_by_device_name(monkeypatch: pytest.MonkeyPatch, name: str, expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == expected


def test_peak_flops_unknown_gpu_warns_and_override_wins(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unknown = "NVIDIA GeForce RTX 4090"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: unknown)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert peak_flops(torch.device("cuda", 0)) is None
    assert "RTX 4090" in caplog.text
    assert peak_flops(torch.device("cuda", 0), override=165e12) == 165e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0), override=500e12) == 500e12


def test_peak_flops_is_none_on_cpu() -> None:
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), override=1e12) is None


def test_peak_flops_rejects_non_positive_override() -> None:
    with pytest.raises(ValueError, match="positive"):
        peak_flops(torch.device("cpu"), override=0.0)


def test_device_memory_cpu_reports_rss_only() -> None:
    memory = metrics.device_memory(torch.device("cpu"))
    assert 0 < memory.active_gib < 1024
    # No device total, allocator or counters on CPU: nothing is made up.
    assert memory == metrics.MemoryStats(active_gib=memory.active_gib)


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


def test_device_memory_cuda_reports_torchtitan_memory_stats(fake_cuda: list[object]) -> None:
    memory = metrics.device_memory(torch.device("cuda", 0))
    assert memory == metrics.MemoryStats(
        active_gib=2.0,
        reserved_gib=4.0,
        active_pct=2.5,
        reserved_pct=5.0,
        num_alloc_retries=3,
        num_ooms=1,
    )
    assert fake_cuda == [torch.device("cuda", 0)]


def _stats(step: int, **overrides: object) -> StepStats:
    fields: dict[str, object] = dict(
        step=step,
        loss_avg=10.0 / step,
        loss_max=12.0 / step,
        grad_norm=1.5,
        lr=1e-3 * step,
        n_valid_tokens=400 + step,
        local_tokens=LOCAL_TOKENS,
        n_skipped_steps=0,
        data_time_s=0.1,
        step_time_s=0.5,
    )
    fields.update(overrides)
    return StepStats(**fields)  # type: ignore[arg-type]


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


def test_tensorboard_scalars_on_cpu(tmp_path: os.PathLike[str]) -> None:
    logger = _make_logger(tmp_path, console=False)
    assert logger.tb_dir is not None
    assert os.path.dirname(logger.tb_dir) == os.path.join(str(tmp_path), "tb")
    assert re.fullmatch(re.escape(tmp_path.name) + r"-\d{8}-\d{6}", os.path.basename(logger.tb_dir))
    steps = [_stats(s, n_skipped_steps=int(s >= 3)) for s in range(1, 6)]
    steps[2] = _stats(3, n_skipped_steps=1, local_tokens=2 * LOCAL_TOKENS, data_time_s=0.3)
    _run(logger, steps)

    acc = _read_events(logger.tb_dir)
    assert set(acc.Tags()["scalars"]) == CPU_TAGS | CPU_ALIASES
    # log_freq=2 with total_steps=5: first step, multiples of 2, last step.
    for tag in CPU_TAGS | CPU_ALIASES:
        assert sorted(_scalars(acc, tag)) == [1, 2, 4, 5], tag
    for tag in CPU_TAGS & DASHBOARD_ALIASES.keys():
        assert _scalars(acc, DASHBOARD_ALIASES[tag]) == _scalars(acc, tag), tag

    assert _scalars(acc, "n_tokens_seen") == {s: GLOBAL_TOKENS * s for s in (1, 2, 4, 5)}
    assert _scalars(acc, "n_skipped_steps") == {1: 0, 2: 0, 4: 1, 5: 1}
    assert _scalars(acc, "n_valid_tokens") == {s: 400 + s for s in (1, 2, 4, 5)}
    assert _scalars(acc, "lr")[4] == pytest.approx(4e-3)
    assert _scalars(acc, "loss_metrics/global_max_loss")[2] == pytest.approx(6.0)

    # Window for step 4 is steps 3-4: 3·128 tokens over 1.0 s, 0.4 s of it waiting for data.
    tps = _scalars(acc, "throughput(tps)")
    assert tps[4] == pytest.approx(3 * LOCAL_TOKENS / 1.0)
    assert tps[1] == pytest.approx(LOCAL_TOKENS / 0.5)
    assert _scalars(acc, "tflops")[4] == pytest.approx(FLOPS_PER_TOKEN * tps[4] / 1e12)
    data_pct = _scalars(acc, "time_metrics/data_loading(%)")
    assert data_pct[4] == pytest.approx(40.0)
    assert all(0 <= v <= 100 for v in data_pct.values())
    assert _scalars(acc, "time_metrics/end_to_end(s)")[4] == pytest.approx(0.5)
    assert all(v > 0 for v in _scalars(acc, "memory/max_active(GiB)").values())


def _layout_charts(acc: EventAccumulator) -> dict[str, list[str]]:
    """Chart title -> tag regexes of the Custom Scalars layout written to the events file."""
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())
    return {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}


def _frontend_run_name(tag: str, run: str) -> str:
    """The run TensorBoard's Custom Scalars chart card reads back from its series name for the colour.

    Mirrors tf-custom-scalar-multi-line-chart-card: the series is named ``f"{tag} ({run})"`` and
    the run is parsed with ``/\\((.*)\\)$/``; a run that is not a run throws in the colour scale
    and the chart draws nothing.
    """
    found = re.search(r"\((.*)\)$", f"{tag} ({run})")
    return found[1] if found else ""


def test_frontend_model_reproduces_the_parentheses_bug() -> None:
    assert _frontend_run_name("tflops", ".") == "."
    assert _frontend_run_name("throughput(tps)", ".") == "tps) (."
    assert _frontend_run_name("memory/max_active(GiB)", "20260101-000000") != "20260101-000000"


@pytest.mark.parametrize(
    ("on_gpu", "validation"), [(False, False), (True, False), (False, True)], ids=["cpu", "cuda", "validation"]
)
def test_custom_scalars_layout_charts_every_written_tag_drawably(
    request: pytest.FixtureRequest, tmp_path: os.PathLike[str], on_gpu: bool, validation: bool
) -> None:
    if on_gpu:
        request.getfixturevalue("fake_cuda")
        logger = _make_logger(tmp_path, console=False, device=torch.device("cuda", 0), peak_flops=1e12)
    else:
        logger = _make_logger(tmp_path, console=False, validation=validation)
    assert logger.tb_dir is not None
    if validation:
        logger.log_validation(1, ValidationResult(loss=2.0, n_valid_tokens=100, batches=2, seconds=0.5))
    _run(logger, [_stats(1)])

    acc = _read_events(logger.tb_dir)
    charts = _layout_charts(acc)
    written = set(acc.Tags()["scalars"])
    assert written == (
        CPU_TAGS
        | CPU_ALIASES
        | (GPU_ONLY_TAGS | GPU_ONLY_ALIASES if on_gpu else set())
        | (VALIDATION_TAGS if validation else set())
    )
    # Every chart is there that has data on this device, and no other.
    assert set(charts) == {
        title
        for name, category in metrics.logger._DASHBOARD.items()
        for title in category
        if validation or name != "validation"
    } - (set() if on_gpu else GPU_ONLY_CHARTS)

    # TensorBoard matches each layout tag as a regex from the start of the tag name.
    charted: set[str] = set()
    for title, patterns in charts.items():
        for pattern in patterns:
            matches = {tag for tag in written if re.match(pattern, tag)}
            assert len(matches) == 1, (title, pattern, matches)
            charted |= matches
    # Every torchtitan tag is on the dashboard, itself or through its alias.
    assert charted == {DASHBOARD_ALIASES.get(tag, tag) for tag in written - set(DASHBOARD_ALIASES.values())}
    assert {"dashboard/throughput_tps", "n_tokens_seen"} <= charted
    for tag in charted:
        assert "(" not in tag and ")" not in tag, tag
        assert _frontend_run_name(tag, ".") == ".", tag


def test_validation_is_logged_to_console_and_tensorboard(tmp_path: os.PathLike[str], caplog) -> None:
    logger = _make_logger(tmp_path, validation=True)
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        logger.log_validation(10, ValidationResult(loss=math.log(50.0), n_valid_tokens=1234, batches=3, seconds=1.25))
    assert "validation: step 10  loss: 3.9120  perplexity: 50.00  (1,234 tokens, 3 batches, 1.2s)" in caplog.text
    logger.close()
    scalars = _read_events(logger.tb_dir)
    assert scalars.Scalars("validation/perplexity")[0].value == pytest.approx(50.0)
    assert [e.step for e in scalars.Scalars("validation/loss")] == [10]


def test_dashboard_aliases_have_no_parentheses_and_keep_the_name() -> None:
    assert set(DASHBOARD_ALIASES) == {t for t in CPU_TAGS | GPU_ONLY_TAGS if "(" in t}
    for tag, alias in DASHBOARD_ALIASES.items():
        assert re.fullmatch(r"dashboard/[A-Za-z0-9_]+", alias), alias
        assert re.sub(r"\W", "", tag.split("(")[0].split("/")[-1]) in alias, (tag, alias)
    assert len(set(DASHBOARD_ALIASES.values())) == len(DASHBOARD_ALIASES)


def test_devices_per_replica_scales_throughput(tmp_path: os.PathLike[str]) -> None:
    logger = _make_logger(tmp_path, console=False, devices_per_replica=2)
    assert logger.tb_dir is not None
    _run(logger, [_stats(1)])
    tps = _scalars(_read_events(logger.tb_dir), "throughput(tps)")
    assert tps[1] == pytest.approx(LOCAL_TOKENS / (0.5 * 2))


def test_no_tensorboard_on_other_ranks_or_when_disabled(tmp_path: os.PathLike[str]) -> None:
    for logger in (
        _make_logger(tmp_path, rank=1, console=False),
        _make_logger(tmp_path, enable_tensorboard=False, console=False),
    ):
        assert logger.tb_dir is None
        _run(logger, [_stats(1), _stats(2)])
    assert not os.path.exists(os.path.join(str(tmp_path), "tb"))


def _console_lines(caplog: pytest.LogCaptureFixture, logger: MetricsLogger, steps: Iterable[StepStats]) -> list[str]:
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        _run(logger, steps)
    return [r.getMessage() for r in caplog.records if r.name == "meshtrain"]


def test_console_plain_line(tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    logger = _make_logger(tmp_path, enable_tensorboard=False, total_steps=10, log_freq=4)
    lines = _console_lines(caplog, logger, [_stats(s) for s in range(1, 5)])
    assert len(lines) == 2  # steps 1 and 4
    first, fourth = lines
    assert "\033[" not in first
    assert first.startswith("step: 1/10")
    for field in ("loss: 10.0000", "max loss: 12.0000", "grad norm: 1.5000", "memory: ", "GiB"):
        assert field in first
    assert "tps/device: 256" in first
    assert "tflops: " in first
    assert "mfu" not in first
    assert "skipped" not in first
    # 6 steps left at 0.5 s each.
    assert "eta: 0:00:03" in fourth


def test_console_colored_line_with_skips_and_non_finite_values(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    logger = _make_logger(tmp_path, enable_tensorboard=True, color=True, total_steps=3, log_freq=10)
    steps = [
        _stats(1),
        _stats(2, n_skipped_steps=1, loss_avg=math.nan, grad_norm=math.inf),
        _stats(3, n_skipped_steps=1, loss_avg=math.nan, loss_max=math.nan, grad_norm=math.nan),
    ]
    lines = _console_lines(caplog, logger, steps)
    assert len(lines) == 2  # steps 1 and 3 (the last one)
    last = lines[-1]
    assert "\033[" in last
    assert last.endswith("\033[0m")
    assert "loss: nan" in last
    assert "grad norm: nan" in last
    assert "skipped steps: 1" in last
    assert logger.tb_dir is not None
    assert math.isnan(_scalars(_read_events(logger.tb_dir), "grad_norm")[3])


def test_console_disabled_emits_nothing(tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture) -> None:
    logger = _make_logger(tmp_path, console=False, enable_tensorboard=False)
    assert _console_lines(caplog, logger, [_stats(1), _stats(2)]) == []


def test_gpu_path_reports_mfu_and_torchtitan_memory_tags(
    fake_cuda: list[object],
    tmp_path: os.PathLike[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    peak = 1e9
    logger = _make_logger(tmp_path, device=torch.device("cuda", 0), peak_flops=peak, total_steps=2)
    assert logger.tb_dir is not None
    lines = _console_lines(caplog, logger, [_stats(1), _stats(2)])

    assert len(fake_cuda) == 2
    assert "memory: 4.00GiB (5.0%)" in lines[0]
    assert "mfu: " in lines[0]
    acc = _read_events(logger.tb_dir)
    assert set(acc.Tags()["scalars"]) == CPU_TAGS | CPU_ALIASES | GPU_ONLY_TAGS | GPU_ONLY_ALIASES
    tflops = _scalars(acc, "tflops")[1]
    expected = {
        "mfu(%)": 100 * tflops * 1e12 / peak,
        "memory/max_active(GiB)": 2.0,
        "memory/max_reserved(GiB)": 4.0,
        "memory/max_active(%)": 2.5,
        "memory/max_reserved(%)": 5.0,
        "memory/num_alloc_retries": 3,
        "memory/num_ooms": 1,
    }
    for tag, value in expected.items():
        assert _scalars(acc, tag) == {1: pytest.approx(value), 2: pytest.approx(value)}, tag
        if tag in DASHBOARD_ALIASES:
            assert _scalars(acc, DASHBOARD_ALIASES[tag]) == _scalars(acc, tag), tag


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(
    ("disabled", "tty", "environ", "expected"),
    [
        (False, True, {}, True),
        (False, False, {}, False),  # a file or a pipe: plain text
        (True, True, {}, False),  # the flag forces plain text on a terminal too
        (False, False, {CONSOLE_TTY_ENV: "1"}, True),  # run_train.sh's tee file, launcher on a terminal
        (False, True, {CONSOLE_TTY_ENV: "0"}, False),  # launcher piped to a file
        (True, False, {CONSOLE_TTY_ENV: "1"}, False),
    ],
)
def test_color_only_on_a_terminal(disabled: bool, tty: bool, environ: dict[str, str], expected: bool) -> None:
    assert use_color(disabled, _Stream(tty), environ) is expected
