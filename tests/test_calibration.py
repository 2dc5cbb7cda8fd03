"""The simulator's calibration (``trainer/simulation/calibration.py``): each kernel kind timed at
its measured rate, a kind not measured at a stated stand-in, a figure the user states ruling,
compile's fusion counted from the ops the step runs, and the eager kernels that cast each element
told from the vectorized ones (``eager_kernels.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from parallelisms.torch_private.fsdp import FSDP_SOURCE, autograd_engine_op, called_from_fsdp
from trainer.simulation import cost_model
from trainer.simulation.calibration import ENV, Calibration, gemm_class, load
from trainer.simulation.cost_model import CostRecorder, TracedCost
from trainer.simulation.memory_tracker import MemoryTracker
from trainer.simulation.step_time import compute_s, memory_bandwidth, memory_s, step_time
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


def _traced(fn, *tensors, compiled: bool = True):
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.where = lambda: ("", compiled)  # inside a compiled region, or not
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


BF16, FP32 = torch.bfloat16, torch.float32
CASTS: dict[str, tuple[Callable[..., object], tuple[tuple[int, torch.dtype], ...], bool]] = {
    "fp32 += bf16 (a gradient's accumulation)": (lambda a, g: a.add_(g), ((64, FP32), (64, BF16)), True),
    "bf16 + bf16": (torch.add, ((64, BF16), (64, BF16)), False),
    "fp32 x a bf16 weight, broadcast": (torch.mul, ((64, FP32), (1, BF16)), True),
    "bf16 x a 0-dim fp32 tensor (a scalar to CUDA)": (torch.mul, ((64, BF16), (0, FP32)), False),
    "bf16 -> fp32 copy": (lambda x: x.float(), ((64, BF16),), True),
    "bf16 -> fp16 copy": (lambda x: x.half(), ((64, BF16),), True),
    "int64 -> fp32 copy": (lambda x: x.float(), ((64, torch.int64),), True),
    "fp32 -> bf16 copy (a kernel of its own)": (lambda x: x.bfloat16(), ((64, FP32),), False),
    "fp32 -> fp16 copy": (lambda x: x.half(), ((64, FP32),), False),
    "fp32 -> float8 copy": (lambda x: x.to(torch.float8_e4m3fn), ((64, FP32),), False),
    "copy_ of bf16 into fp32": (lambda t, s: t.copy_(s), ((64, FP32), (64, BF16)), True),
    "copy_ of fp32 into bf16": (lambda t, s: t.copy_(s), ((64, BF16), (64, FP32)), False),
    "foreach copy of bf16 into fp32": (lambda t, s: torch._foreach_copy_([t], [s]), ((64, FP32), (64, BF16)), True),
    "a gather of bf16 rows (not elementwise)": (
        lambda x: x.index_select(0, torch.arange(0, 64, 2)),
        ((64, BF16),),
        False,
    ),
}


def _tensor(rows: int, dtype: torch.dtype) -> torch.Tensor:
    if not rows:
        return torch.tensor(2.0, dtype=dtype)
    return torch.ones(rows, 32).to(dtype)


@pytest.mark.parametrize("name", list(CASTS))
def test_eager_kernels_that_cast_each_element_are_told_from_the_vectorized_ones(name):
    """CUDA vectorizes an elementwise op whose operands share its dtype; mixed dtypes and copies
    that convert (but float32 -> half types and into float8) run the unrolled kernel, whose bytes
    the cost model times at the casting rate: eager only, a compiled region converts in registers."""
    fn, shapes, casts = CASTS[name]
    tensors = [_tensor(rows, dtype) for rows, dtype in shapes]
    eager = _traced(fn, *tensors, compiled=False)
    assert eager.memory_bytes > 0
    assert eager.casting_bytes == (eager.memory_bytes if casts else 0)
    assert eager.fused_casting_bytes == eager.casting_bytes
    compiled = _traced(fn, *tensors)
    assert compiled.casting_bytes == eager.casting_bytes and compiled.fused_casting_bytes == 0


def test_eager_casting_kernels_at_their_probed_rate_else_at_the_copys():
    target = resolve_target("h200", {}, 1)
    probed = type(target)(**{**target.__dict__, "calibration": _calibration(casting_bytes_per_s=1e12)})
    unprobed = type(target)(**{**target.__dict__, "calibration": _calibration()})
    cost = TracedCost(memory_bytes=10**12, casting_bytes=4 * 10**11, fused_bytes=6 * 10**11, fused_casting_bytes=10**11)
    assert memory_s(cost, probed, compiled=False) == pytest.approx(6e11 / 4e12 + 4e11 / 1e12)
    assert memory_s(cost, probed, compiled=True) == pytest.approx(5e11 / 4e12 + 1e11 / 1e12)
    assert memory_s(cost, unprobed, compiled=False) == pytest.approx(1e12 / 4e12)
    assert step_time(cost, probed, 1, "1F1B", 1, 1).memory_s == pytest.approx(memory_s(cost, probed, False))
    assert "casting kernels 1 TB/s (measured)" in probed.calibration_line()
    assert "casting kernels not measured: the copy's" in unprobed.calibration_line()


def test_ops_called_by_fsdp_are_told_from_the_blocks_own():
    """FSDP's hooks (gathers, casts, the fp32 accumulation of each micro-batch's gradient) run
    eagerly around a compiled block: the simulator finds them by FSDP's frames on the stack."""
    namespace: dict[str, Callable[..., bool]] = {}
    exec(compile("def hook(f):\n    return f()\n", str(Path(FSDP_SOURCE) / "hook.py"), "exec"), namespace)
    assert namespace["hook"](called_from_fsdp) is True
    assert called_from_fsdp() is False


def test_autograd_s_own_gradient_ops_are_eager_casting_kernels():
    """The engine's cast of a gradient to its leaf's ``grad_dtype``, and ``AccumulateGrad``'s add
    into ``.grad``, run after a compiled backward graph, eagerly: torch 2.15's FSDP has autograd
    accumulate each micro-batch's bf16 gradient into the fp32 one so, with no FSDP frame."""
    weight = torch.nn.Parameter(torch.randn(64, 256, dtype=torch.bfloat16))
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.where = lambda: ("", True)  # inside a compiled block
    recorder.after_graph = autograd_engine_op
    with MemoryTracker([recorder]):
        weight.grad_dtype = torch.float32
        (weight * x).sum().backward()  # the engine casts the bf16 gradient to fp32
        weight.grad_dtype = None
        (weight * x).sum().backward()  # AccumulateGrad adds the bf16 one into it
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    elements = weight.numel()
    assert recorder.cost.fused_casting_bytes == elements * (2 + 4) + elements * (4 + 2 + 4)


def test_a_cast_recomputed_in_backward_stays_the_blocks():
    """Activation checkpointing recomputes a block's forward inside a backward node, with grad
    mode on: its casts of the weight are the block's, not the engine's."""
    weight = torch.nn.Parameter(torch.randn(256, dtype=torch.bfloat16))
    weight.grad_dtype = torch.float32
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    flagged: list[str] = []
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.after_graph = lambda func, out: autograd_engine_op(func, out) and not flagged.append(func.__name__)
    with MemoryTracker([recorder]):
        # ``a * weight``'s node, an edge to the weight's ``AccumulateGrad``, recomputes ``weight.float()``.
        checkpoint(lambda a: weight.float() + (a * weight).float(), x, use_reentrant=False).sum().backward()
    assert flagged == ["_to_copy.default"] * 2  # the engine's casts of the weight's two gradients alone


@pytest.mark.parametrize("counted_by_torch", [False, True], ids=["torch 2.13", "torch 2.15"])
def test_causal_attention_counts_half_its_products_whoever_else_counts_it(monkeypatch, counted_by_torch):
    """The score and value products of a causal SDPA, forward and backward: half of 4 and 10
    x batch x heads x queries x keys x head width. torch 2.15's FLOP counter holds the CPU flash
    kernels too, counting the masked half; the simulator's count is the one taken."""
    if counted_by_torch:
        for op in (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward):  # fmt: skip
            monkeypatch.setitem(cost_model.flop_registry, op, lambda *args, **kwargs: 10**15)
    q = torch.randn(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    recorder = CostRecorder({})
    recorder.enabled = True
    with MemoryTracker([recorder]):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    products = 2 * 4 * 64 * 64 * 32
    assert recorder.cost.flops_by_kind["attention"] == (4 + 10) * products // 2
