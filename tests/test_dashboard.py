"""What the metrics logger gives TensorBoard: every torchtitan scalar at the log cadence, the
dashboard aliases without parentheses, and a Custom Scalars layout whose every chart draws
(TensorBoard's chart card cannot colour a series whose tag holds parentheses)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util
from test_metrics import (
    CPU_ALIASES,
    CPU_TAGS,
    FLOPS_PER_TOKEN,
    GLOBAL_TOKENS,
    GPU_ONLY_ALIASES,
    GPU_ONLY_CHARTS,
    GPU_ONLY_TAGS,
    LOCAL_TOKENS,
    VALIDATION_TAGS,
    _make_logger,
    _read_events,
    _run,
    _scalars,
    _stats,
    fake_cuda,  # noqa: F401  (a fixture, requested by name below)
)

from trainer import metrics
from trainer.metrics import DASHBOARD_ALIASES
from trainer.validation import ValidationResult


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
        assert logger.tb_dir is None
        _run(logger, [_stats(1), _stats(2)])
    assert not os.path.exists(os.path.join(str(tmp_path), "tb"))
