"""The simulator's calibration (``trainer/simulation/calibration.py``): each kernel kind timed at
its measured rate, a kind not measured at a stated stand-in, a figure the user states ruling,
and compile's fusion counted from the ops the step runs."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.simulation.calibration import ENV, Calibration, gemm_class, load
from trainer.simulation.cost_model import CostRecorder, TracedCost, compute_s, memory_bandwidth, step_time
from trainer.simulation.memory_tracker import MemoryTracker
from trainer.simulation.targets import resolve_target

pytestmark = pytest.mark.fast


def _calibration(**changes) -> Calibration:
    figures = {
        "gpu": "test GPU",
        "torch": "2.x",
        "measured": "today",
        "gemm_flops": {"large": 800e12, "medium": 600e12, "small": None},
        "attention_flops": 400e12,
        "grouped_gemm_flops": None,
        "hbm_bytes_per_s": 4e12,
    }
    return Calibration(**{**figures, **changes})


def test_shape_classes_follow_the_smallest_dimension():
    assert gemm_class(8192, 8192, 8192) == "large"
    assert gemm_class(8192, 4096, 1024) == gemm_class(8192, 2048, 2048) == "medium"
    assert gemm_class(65536, 768, 2048) == "small" == gemm_class(8192, 4096, 512)


def test_each_kind_at_its_rate_and_the_unmeasured_at_a_named_stand_in():
    c = _calibration()
    assert c.flops("gemm_large") == (800e12, "measured")
    assert c.flops("gemm_small") == (600e12, "not measured: the medium class's")
    assert c.flops("attention") == (400e12, "measured")
    assert c.flops("grouped_gemm")[0] is None  # the cost model's peak x efficiency then
    target = resolve_target("h200", {}, 1)
    target = type(target)(**{**target.__dict__, "calibration": c})
    cost = TracedCost(
        flops=10**15, flops_by_kind={"gemm_large": 8 * 10**14, "attention": 10**14, "grouped_gemm": 10**14}
    )
    seconds = compute_s(cost, target)
    assert seconds["gemm_large"] == pytest.approx(1.0) and seconds["attention"] == pytest.approx(0.25)
    assert seconds["grouped_gemm"] == pytest.approx(1e14 / (target.bf16_flops * target.efficiency))
    assert memory_bandwidth(target) == 4e12


@pytest.mark.parametrize(
    ("measured", "bf16_large", "expected_fraction_of_fp8_peak", "source"),
    [
        (1500e12, 800e12, None, "measured"),
        (None, 791e12, 791 / 989, "not measured: the float8 peak x the large bf16 matmul's fraction"),
        (None, None, 0.5, "not measured: peak x efficiency"),
    ],
    ids=["probed", "at the bf16 matmul's fraction", "no matmul measured"],
)
def test_float8_matmuls_at_their_probe_else_at_the_fraction_the_bf16_matmul_reached(
    measured, bf16_large, expected_fraction_of_fp8_peak, source
):
    """Timed at the float8 peak x a guessed efficiency beside bf16 matmuls at their measured
    rate, float8 came out 1.24x faster instead of the tensor cores' 2x (an H100: 990 against 798)."""
    c = _calibration(float8_gemm_flops=measured, gemm_flops={"large": bf16_large, "medium": None, "small": None})
    target = resolve_target("h100", {}, 1)
    target = type(target)(**{**target.__dict__, "calibration": c})
    assert c.float8_flops(target.bf16_flops, target.fp8_flops)[1] == source
    rate = measured or target.fp8_flops * expected_fraction_of_fp8_peak
    assert target.float8_flops() == pytest.approx(rate)
    seconds = compute_s(TracedCost(flops=3 * 10**15, fp8_flops=10**15), target)
    assert seconds["float8"] == pytest.approx(1e15 / rate)
    assert f"float8 matmuls {rate / 1e12:.0f} TFLOP/s ({source})" in target.calibration_line()
    uncalibrated = type(target)(**{**target.__dict__, "calibration": None})
    assert uncalibrated.float8_flops() == target.fp8_flops * target.efficiency


def test_the_stored_h200_figures_are_read_and_a_stated_rate_rules(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    stored = resolve_target("h200", {}, 1)
    assert stored.calibration is not None and stored.calibration_file.endswith("calibrations/h200.json")
    assert stored.calibration.flops("gemm_large")[0] == pytest.approx(798.9e12, rel=1e-3)  # the second check's probe
    assert "measured" in stored.calibration_line() and "h200.json" in stored.calibration_line()
    stated = resolve_target("h200", {"efficiency": 0.6}, 1)
    assert stated.calibration is None and "stated with --target" in stated.calibration_line()
    assert resolve_target("cpu", {}, 1).calibration is None
    cost = TracedCost(flops=10**15, memory_bytes=10**12, flops_by_kind={"gemm_large": 10**15})
    # the plain constants: what --simulate gave before any calibration
    plain = step_time(cost, stated, 1, "1F1B", 1, 1).step_s
    assert plain == pytest.approx(1e15 / (989e12 * 0.6) + 1e12 / (4.8e12 * 0.7))


def test_a_file_named_by_the_environment_stands_for_the_stored_one(tmp_path, monkeypatch):
    path = tmp_path / "probed.json"
    fields = _calibration().to_json()
    path.write_text(json.dumps({"target": "h100", **fields}))
    monkeypatch.setenv(ENV, str(path))
    calibration, where = load("h100")
    assert where == str(path) and calibration == _calibration()
    assert load("h200") == (None, "")  # measured on another GPU: not used for this one


def _traced(fn, *tensors):
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.where = lambda: ("", True)  # inside a compiled region
    with MemoryTracker([recorder]):
        fn(*tensors)
    return recorder.cost


def test_compile_fusion_saves_the_reads_of_elementwise_intermediates_only():
    """RMSNorm's chain reads the input once when fused; a matmul between elementwise ops still
    reads what they wrote, and an op alone moves the same bytes fused or not."""
    x = torch.randn(64, 256)
    w = torch.randn(256, 256)

    def rms(x):
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    chain = _traced(rms, x)
    assert chain.fused_bytes < chain.memory_bytes
    lone = _traced(lambda a: a * 2, x)
    assert lone.fused_bytes == lone.memory_bytes
    through_matmul = _traced(lambda a: torch.relu(torch.relu(a) @ w), x)
    # the second relu reads the matmul's output: not fused; the first reads the input
    assert through_matmul.fused_bytes == through_matmul.memory_bytes
    assert chain.flops_by_kind == {} and through_matmul.flops_by_kind == {"gemm_small": 2 * 64 * 256 * 256}
