"""What the metrics logger gives TensorBoard: every torchtitan scalar at the log cadence, the
dashboard aliases without parentheses, and a Custom Scalars layout whose every chart draws
(TensorBoard's chart card cannot colour a series whose tag holds parentheses, and scales no
y-axis for a chart of two values when it ignores outliers, as it does by default)."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from metrics_helpers import (
    CPU_ALIASES,
    CPU_TAGS,
    FLOPS_PER_TOKEN,
    GLOBAL_TOKENS,
    GPU_ONLY_ALIASES,
    GPU_ONLY_CHARTS,
    GPU_ONLY_TAGS,
    LOCAL_TOKENS,
    VALIDATION_TAGS,
    _layout,
    _layout_charts,
    _make_logger,
    _read_events,
    _run,
    _scalars,
    _stats,
    fake_cuda,  # noqa: F401  (a fixture, requested by name below)
    tb_dir,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from trainer.metrics import DASHBOARD_ALIASES
from trainer.metrics.dashboard import DASHBOARD
from trainer.validation import ValidationResult


def test_tensorboard_scalars_on_cpu(tmp_path: os.PathLike[str]) -> None:
    logger = _make_logger(tmp_path, console=False)
    assert tb_dir(logger) is not None
    assert os.path.dirname(tb_dir(logger)) == os.path.join(str(tmp_path), "tb")
    assert re.fullmatch(re.escape(tmp_path.name) + r"-\d{8}-\d{6}", os.path.basename(tb_dir(logger)))
    steps = [_stats(s, n_skipped_steps=int(s >= 3)) for s in range(1, 6)]
    steps[2] = _stats(3, n_skipped_steps=1, local_tokens=2 * LOCAL_TOKENS, data_time_s=0.3)
    _run(logger, steps)

    acc = _read_events(tb_dir(logger))
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


def _chart_values(chart: layout_pb2.Chart, runs: list[EventAccumulator]) -> list[float]:
    """The values a chart card scales its y-axis by: one per point of each series of a multi-line
    chart (smoothing changes them, not their number), three per point of a margin chart (the value
    and the ends of its band)."""
    values = []
    for acc in runs:
        written = acc.Tags()["scalars"]
        if chart.WhichOneof("content") == "multiline":
            matched = {tag for tag in written for pattern in chart.multiline.tag if re.match(pattern, tag)}
            values += [e.value for tag in sorted(matched) for e in acc.Scalars(tag)]
        else:
            for series in chart.margin.series:
                for tag in (series.value, series.lower, series.upper):
                    values += [e.value for e in acc.Scalars(tag)] if tag in written else []
    return values


def _quantile(ordered: list[float], p: float) -> float:
    """d3.quantile: linear between the two nearest ranks."""
    at = (len(ordered) - 1) * p
    low = int(at)
    if low + 1 >= len(ordered):
        return ordered[low]
    return ordered[low] + (ordered[low + 1] - ordered[low]) * (at - low)


def _frontend_y_extent(values: list[float]) -> list[float]:
    """The data extent TensorBoard's line chart scales its y-axis to with "Ignore outliers in chart
    scaling" on (the default): the finite values between their 5th and 95th percentile.

    Mirrors vz_line_chart2's linear scale (``extentOfValues``): an empty extent leaves the axis at
    0 to 1, away from a line of any other values, and the chart shows an empty frame.
    """
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return []
    low, high = _quantile(ordered, 0.05), _quantile(ordered, 0.95)
    kept = [v for v in ordered if low <= v <= high]
    return [min(kept), max(kept)] if kept else []


def test_frontend_model_reproduces_the_two_value_bug() -> None:
    assert _frontend_y_extent([628.3, 380.4]) == []
    assert _frontend_y_extent([628.3]) == [628.3, 628.3]
    assert _frontend_y_extent([628.3, 380.4, 300.0]) == [380.4, 380.4]
    assert _frontend_y_extent([5.0, 5.0]) == [5.0, 5.0]
    assert _frontend_y_extent(3 * [628.3, 380.4]) == [380.4, 628.3]


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


MOE_TAGS = {"moe/balance_loss", "moe/load_max_over_mean/layer_1", "moe/load_max_over_mean/layer_3"}
MOE_CHARTS = ("balancing loss", "expert load max/mean per layer")
MOE_VALUES = {"moe/balance_loss": 1.01, "moe/load_max_over_mean/layer_1": 1.5, "moe/load_max_over_mean/layer_3": 1.25}


@pytest.mark.parametrize(
    ("on_gpu", "validation", "moe"),
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
    ids=["cpu", "cuda", "validation", "moe"],
)
def test_custom_scalars_layout_charts_every_written_tag_drawably(
    request: pytest.FixtureRequest, tmp_path: os.PathLike[str], on_gpu: bool, validation: bool, moe: bool
) -> None:
    if on_gpu:
        request.getfixturevalue("fake_cuda")
        logger = _make_logger(tmp_path, console=False, device=torch.device("cuda", 0), peak_flops=1e12)
    elif moe:
        logger = _make_logger(tmp_path, console=False, moe_layers=(1, 3), balance_loss=True)
    else:
        logger = _make_logger(tmp_path, console=False, validation=validation)
    assert tb_dir(logger) is not None
    if validation:
        logger.log_validation(1, ValidationResult(loss=2.0, n_valid_tokens=100, batches=2, seconds=0.5))
    _run(logger, [_stats(1, values=MOE_VALUES if moe else {})])

    acc = _read_events(tb_dir(logger))
    charts = _layout_charts(acc)
    written = set(acc.Tags()["scalars"])
    assert written == (
        CPU_TAGS
        | CPU_ALIASES
        | (GPU_ONLY_TAGS | GPU_ONLY_ALIASES if on_gpu else set())
        | (VALIDATION_TAGS if validation else set())
        | (MOE_TAGS if moe else set())
    )
    if moe:
        assert _scalars(acc, "moe/balance_loss") == {1: pytest.approx(1.01)}
        assert _scalars(acc, "moe/load_max_over_mean/layer_3") == {1: 1.25}
        assert charts["expert load max/mean per layer"] == [
            "moe/load_max_over_mean/layer_1",
            "moe/load_max_over_mean/layer_3",
        ]
    # Every chart is there that has data on this device, and no other; the MoE's come from the
    # values its balancing declares.
    laid_out = {**DASHBOARD, "moe": dict.fromkeys(MOE_CHARTS, ())}
    optional = {"validation": validation, "moe": moe}
    assert set(charts) == {
        title for name, category in laid_out.items() for title in category if optional.get(name, True)
    } - (set() if on_gpu else GPU_ONLY_CHARTS)
    # Written last first, as TensorBoard shows margin charts last first (see layout_summary).
    for category in _layout(acc).category:
        assert [chart.title for chart in category.chart][::-1] == [
            title for title in laid_out[category.title] if title in charts
        ]

    charted = {tag for tags in charts.values() for tag in tags}
    assert charted <= written
    # Every torchtitan tag is on the dashboard, itself or through its alias.
    assert charted == {DASHBOARD_ALIASES.get(tag, tag) for tag in written - set(DASHBOARD_ALIASES.values())}
    assert {"dashboard/throughput_tps", "n_tokens_seen"} <= charted
    for tag in charted:
        assert "(" not in tag and ")" not in tag, tag
        assert _frontend_run_name(tag, ".") == ".", tag


def _write_run(dump: os.PathLike[str], steps: int, scale: float = 1.0) -> EventAccumulator:
    """A run that logs and validates at each of its ``steps`` steps, its values times ``scale``."""
    logger = _make_logger(dump, console=False, validation=True, total_steps=steps, log_freq=1)
    assert tb_dir(logger) is not None
    for step in range(1, steps + 1):
        logger.log(
            _stats(
                step,
                loss_avg=scale * 10 / step,
                loss_max=scale * 12 / step,
                grad_norm=scale * step,
                lr=scale * 1e-3 * step,
                n_valid_tokens=int(scale * 400) + step,
                step_time_s=scale * 0.5 * step,
                data_time_s=scale * 0.01 * step,
            )
        )
        loss, seconds = scale * 6.5 / step, scale * 10 / step
        logger.log_validation(step, ValidationResult(loss=loss, n_valid_tokens=100, batches=2, seconds=seconds))
    logger.close()
    return _read_events(tb_dir(logger))


@pytest.mark.parametrize("runs", [[1], [2], [3], [1, 1]], ids=["1-point", "2-points", "3-points", "2-runs-of-1"])
def test_every_chart_scales_its_y_axis_to_its_points(tmp_path, runs: list[int]) -> None:
    """Two points, two runs of one point: validation evaluated twice (``validation.freq`` half the
    steps), a run that logs only its first and last step, two such runs compared. Each chart card
    ignores outliers by default, which leaves a chart of two values in all without a y-axis."""
    written = [_write_run(tmp_path / f"run{i}", steps, scale=1 + i) for i, steps in enumerate(runs)]
    layout = _layout(written[0])
    for category in layout.category:
        for chart in category.chart:
            values = _chart_values(chart, written)
            assert len(values) >= sum(runs), chart.title
            assert _frontend_y_extent(values), (chart.title, values)


def test_dashboard_aliases_have_no_parentheses_and_keep_the_name() -> None:
    assert set(DASHBOARD_ALIASES) == {t for t in CPU_TAGS | GPU_ONLY_TAGS if "(" in t}
    for tag, alias in DASHBOARD_ALIASES.items():
        assert re.fullmatch(r"dashboard/[A-Za-z0-9_]+", alias), alias
        assert re.sub(r"\W", "", tag.split("(")[0].split("/")[-1]) in alias, (tag, alias)
    assert len(set(DASHBOARD_ALIASES.values())) == len(DASHBOARD_ALIASES)


def test_no_tensorboard_on_other_ranks_or_when_disabled(tmp_path: os.PathLike[str]) -> None:
    for logger in (
        _make_logger(tmp_path, rank=1, console=False),
        _make_logger(tmp_path, enable_tensorboard=False, console=False),
    ):
        assert tb_dir(logger) is None
        _run(logger, [_stats(1), _stats(2)])
    assert not os.path.exists(os.path.join(str(tmp_path), "tb"))
