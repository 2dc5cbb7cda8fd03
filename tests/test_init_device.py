"""One model per seed on every device: the initial weights against the plain draw rule
(``init_reference``), bit for bit, whichever device holds them, however many threads draw them
and however expert parallelism splits a stack.

A seed meant other weights on a GPU than on the CPU while each tile was drawn by a generator on
the parameter's device. Here the device is a stand-in that holds its values in CPU memory and
records every operation run on it: it must receive copies only, never a draw."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from harness import MODEL_SEED
from init_reference import reference_draw, reference_state
from torch import nn
from torch.utils._pytree import tree_map

from trainer.model import tiled_init
from trainer.model.llama3 import Transformer
from trainer.model.moe import FLAVORS, moe_layers
from trainer.model.tiled_init import TILE, fill_local_

SHAPE = (5 * TILE[0] + 7, TILE[1] + 300)
"""Partial tiles at both far edges."""


class Elsewhere(torch.Tensor):
    """A tensor that says it is on another device ('meta') and keeps its values in a CPU tensor,
    ``inner``; ``ops`` lists the ATen operations run on it."""

    inner: torch.Tensor
    ops: list[str]

    @staticmethod
    def __new__(cls, inner: torch.Tensor, ops: list[str]) -> Elsewhere:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device="meta"
        )
        wrapper.inner, wrapper.ops = inner, ops
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        ops = next(a.ops for a in args if isinstance(a, Elsewhere))
        ops.append(str(func))
        unwrap = lambda x: x.inner if isinstance(x, Elsewhere) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Elsewhere(x, ops) if isinstance(x, torch.Tensor) else x, out)


def test_each_rank_draws_with_its_share_of_the_host(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert tiled_init.draw_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert tiled_init.draw_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert tiled_init.draw_threads() == 16
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 10)
    assert tiled_init.draw_threads() == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "trunc_normal"])
def test_a_device_receives_copies_of_the_cpu_draws(monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype):
    """A box cut inside tiles, on a device that is not the CPU, in bands of a few tile rows: the
    reference's bits (rounded once for bfloat16), copied in several bands, with no random draw
    and no ``erfinv`` on the device and no tile drawn twice."""
    full = reference_draw(SHAPE, kind, 0.02, MODEL_SEED, "w")
    monkeypatch.setattr(tiled_init, "BAND_VALUES", 2 * TILE[0] * 600)
    drawn = []
    original = torch.Tensor.normal_ if kind == "normal" else torch.Tensor.uniform_

    def counted(self, *args, **kwargs):
        drawn.append((self.device.type, self.numel()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_" if kind == "normal" else "uniform_", counted)
    (r, c), (h, w) = (20, 900), (SHAPE[0] - 20, SHAPE[1] - 900)
    ops: list[str] = []
    local = Elsewhere(torch.zeros(h, w, dtype=dtype), ops)
    fill_local_(local, SHAPE, (r, c), kind, 0.02, MODEL_SEED, "w")
    assert torch.equal(local.inner, full[r : r + h, c : c + w].to(dtype))
    assert {op.split(".")[1] for op in ops} <= {"slice", "copy_"}, ops
    assert sum("copy_" in op for op in ops) == 3  # rows 20..64, 64..128, 128..167
    assert {device for device, _ in drawn} == {"cpu"}
    assert sum(n for _, n in drawn) == SHAPE[0] * SHAPE[1]  # the box touches every tile, once each


def test_threads_draw_the_same_bits(monkeypatch: pytest.MonkeyPatch):
    """Tiles shared between two threads give the single thread's bits, drawn by the pool's
    threads, not the caller's, into a parameter that requires grad as the model's do (grad mode
    is per thread)."""
    drawers, pools, original = set(), [], torch.Tensor.uniform_

    def recorded(self, *args, **kwargs):
        drawers.add(threading.get_ident())
        return original(self, *args, **kwargs)

    class Pool(ThreadPoolExecutor):
        def map(self, fn, *iterables, **kwargs):
            shares = list(iterables[0])
            pools.append((self._max_workers, len(shares)))
            return super().map(fn, shares, **kwargs)

    monkeypatch.setattr(torch.Tensor, "uniform_", recorded)
    monkeypatch.setattr(tiled_init, "ThreadPoolExecutor", Pool)
    values = nn.Parameter(torch.empty(SHAPE[0] * 4, SHAPE[1]))
    with torch.no_grad():
        fill_local_(values, values.shape, (0, 0), "trunc_normal", 0.02, MODEL_SEED, "w", threads=2)
    assert pools == [(2, 2)]
    assert drawers and threading.get_ident() not in drawers
    assert torch.equal(values, reference_draw(tuple(values.shape), "trunc_normal", 0.02, MODEL_SEED, "w"))


def debug_moe_args():
    return replace(FLAVORS["debugmoe"], vocab_size=300, max_seq_len=32)


def test_every_layer_of_the_moe_is_the_reference():
    """The MoE model (stacked experts, router, shared expert) initialised in one process."""
    args = debug_moe_args()
    model = Transformer(args)
    model.init_weights(MODEL_SEED)
    reference = reference_state(args, MODEL_SEED)["state"]
    assert [n for n, p in model.named_parameters() if not torch.equal(p, reference[n])] == []


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_hold_their_slices_of_the_reference(ep: int):
    """Each EP rank keeps its experts of every stack (as ``apply_expert_parallel`` cuts them) and
    draws the tiles of their place in the whole stack."""
    args = debug_moe_args()
    reference = reference_state(args, MODEL_SEED)["state"]
    for rank in range(ep):
        with torch.device("meta"):
            model = Transformer(args)
        for moe in moe_layers(model):
            experts, local = moe.experts, moe.experts.n_experts // ep
            for name in ("w1", "w2", "w3"):
                whole = getattr(experts, name)
                setattr(experts, name, nn.Parameter(torch.empty((local, *whole.shape[1:]), device="meta")))
            experts.first_expert = rank * local
        model.to_empty(device="cpu")
        model.init_weights(MODEL_SEED)
        for name, param in model.named_parameters():
            expected = reference[name]
            if ".experts." in name:
                local = expected.shape[0] // ep
                expected = expected[rank * local : (rank + 1) * local]
            assert torch.equal(param, expected), (ep, rank, name)
