"""Compile's fusion in the simulator's bytes (``trainer/simulation/fusion.py``), checked against
what Inductor's kernels move: a cast to float8 by a scale per row is one kernel that loads the
input once; a scale of the whole tensor needs the reduction's kernel first; an intermediate a
later kernel reads is written after all; every op's own row stays what it moved."""

from __future__ import annotations

import pytest
import torch

from trainer.simulation.cost_model import CostRecorder, TracedCost
from trainer.simulation.memory_tracker import MemoryTracker

pytestmark = pytest.mark.fast

ROWS, COLUMNS = 64, 256
F8 = torch.float8_e4m3fn


def traced(fn, *tensors, compiled: bool = True) -> TracedCost:
    recorder = CostRecorder({})
    recorder.enabled = True
    recorder.where = lambda: ("", compiled)
    with MemoryTracker([recorder]):
        fn(*tensors)
    return recorder.cost


def rowwise(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-448, 448).to(F8)


def tensorwise(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().max().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-448, 448).to(F8)


def bytes_of(dtype: torch.dtype, rows: int = ROWS, columns: int = COLUMNS) -> int:
    return rows * columns * torch.empty((), dtype=dtype).element_size()


def test_a_cast_by_a_scale_per_row_loads_its_input_once():
    x = torch.randn(ROWS, COLUMNS, dtype=torch.bfloat16)
    cost = traced(rowwise, x)
    scales = ROWS * (2 + 4 + 4)  # the row maxima, and the float32 scale the chain makes of them
    assert (
        bytes_of(torch.bfloat16) + bytes_of(F8) <= cost.fused_bytes <= bytes_of(torch.bfloat16) + bytes_of(F8) + scales
    )
    assert cost.memory_bytes > 5 * cost.fused_bytes  # eager: six kernels, each a full pass


def test_a_scale_of_the_whole_tensor_reads_the_input_twice():
    x = torch.randn(ROWS, COLUMNS, dtype=torch.bfloat16)
    cost = traced(tensorwise, x)
    assert (
        2 * bytes_of(torch.bfloat16) + bytes_of(F8)
        <= cost.fused_bytes
        <= 2 * bytes_of(torch.bfloat16) + bytes_of(F8) + 64
    )


def test_an_intermediate_a_later_kernel_reads_is_written():
    x = torch.randn(ROWS, COLUMNS)
    w = torch.randn(COLUMNS, COLUMNS)

    def kept(a):
        y = torch.relu(a)
        z = y * 2
        return z, y @ w  # the matmul reads y after the chain: y is stored

    def dropped(a):
        return torch.relu(a) * 2

    assert traced(kept, x).fused_bytes == 3 * bytes_of(torch.float32)
    assert traced(dropped, x).fused_bytes == 2 * bytes_of(torch.float32)


@pytest.mark.parametrize("cast", [rowwise, tensorwise])
def test_no_op_row_is_negative(cast):
    cost = traced(cast, torch.randn(ROWS, COLUMNS, dtype=torch.bfloat16))
    assert all(row.fused_bytes >= 0 for row in (*cost.by_op.values(), *cost.by_module.values()))
    assert sum(row.fused_bytes for row in cost.by_op.values()) == pytest.approx(cost.fused_bytes)


def test_the_reshape_of_a_matmuls_result_moves_nothing():
    x = torch.randn(2, ROWS, COLUMNS)
    w = torch.randn(COLUMNS, COLUMNS)
    cost = traced(lambda a: a @ w, x, compiled=False)
    assert cost.memory_bytes == 0 and cost.flops == 2 * 2 * ROWS * COLUMNS * COLUMNS
