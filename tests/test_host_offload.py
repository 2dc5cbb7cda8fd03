"""Held forwards in host memory (``trainer/step/host_offload.py``): what moves (each block's input and
what the forward saves outside the checkpointed blocks, a tensor saved by every block once, no
parameter, nothing an inner graph of the forward uses at once), that the forward's own tensors
are then freed, and that the gradients are bit for bit those held in place, whether a fetch
announced each micro-batch's backward or not; what the plan says of them. The CUDA copy streams are not exercised here (no
GPU); the step's exactness on a mesh is ``test_moe_activation_checkpoint.py``'s."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ConfigError, load_config
from trainer.config.validate import cautions
from trainer.loss import linear_cross_entropy_sum_with_gradients
from trainer.planning.job_plan import held_forwards_line, resolve_job
from trainer.step.host_offload import HostOffload

FULL = ["--activation_checkpoint.mode", "full"]

MICRO_BATCHES, BLOCKS, ROWS, DIM = 3, 3, 8, 64


def _block(h: torch.Tensor, weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ weight.t()) * table + h


def _step(offload: HostOffload | None, fetch: bool = True) -> tuple[dict[str, torch.Tensor], int, int]:
    """Every micro-batch's forward through checkpointed blocks (each saving its input, its
    parameter and a table every block shares, as RoPE's), then every backward; the gradients and
    how many of the forward's block outputs' storages were still alive between the two, and how
    many of the host's copies after the backwards."""
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5) for _ in range(BLOCKS)]
    table = torch.randn(DIM)
    inputs = [torch.randn(ROWS, DIM, requires_grad=True) for _ in range(MICRO_BATCHES)]
    outputs, losses = [], []
    for i, x in enumerate(inputs):
        with offload.saving(i) if offload is not None else contextlib.nullcontext():
            h = x
            for weight in weights:
                h = checkpoint(_block, h, weight, table, use_reentrant=False)
                outputs.append(weakref.ref(h.untyped_storage()))
            losses.append(h.square().sum())
    del h
    alive = sum(ref() is not None for ref in outputs)
    pending = offload._pending.values() if offload is not None else []
    copies = [weakref.ref(ref().host.untyped_storage()) for microbatch in pending for ref in microbatch]
    for i, loss in enumerate(losses):
        if offload is not None and fetch:
            offload.fetch(i)
            offload.fetch(i + 1)
        loss.backward()
    grads = {f"w{i}": w.grad for i, w in enumerate(weights)} | {f"x{i}": x.grad for i, x in enumerate(inputs)}
    return grads, alive, sum(ref() is not None for ref in copies)


@pytest.mark.parametrize("fetch", [True, False], ids=["fetched", "read unannounced"])
def test_held_forwards_in_host_memory_free_the_forward_and_give_the_same_gradients(fetch):
    held, alive, _ = _step(None)
    offload = HostOffload(torch.device("cpu"), min_bytes=0)
    moved, moved_alive, copies_left = _step(offload, fetch)
    assert held.keys() == moved.keys()
    for name, grad in held.items():
        assert torch.equal(grad, moved[name]), name
    assert alive == MICRO_BATCHES * BLOCKS and moved_alive == 0 and copies_left == 0
    # Per micro-batch: each block's input and the loss's (the last output), the shared table once.
    row_block = ROWS * DIM * 4
    assert offload.moved_bytes == MICRO_BATCHES * ((BLOCKS + 1) * row_block + DIM * 4)


def test_small_tensors_parameters_and_subclasses_stay():
    offload = HostOffload(torch.device("cpu"), min_bytes=ROWS * DIM * 4)
    _step(offload)
    assert offload.moved_bytes == MICRO_BATCHES * (BLOCKS + 1) * ROWS * DIM * 4  # not the table
    assert not offload._moves(nn.Parameter(torch.zeros(ROWS, DIM)))
    assert not offload._moves(torch.zeros(ROWS, DIM, device="meta"))


def test_the_losss_inner_graph_stays_and_only_its_gradients_move():
    """The loss that computes its gradients in the forward (held forwards' loss) runs a graph of
    its own at once: its logits are not sent to the host and back, only the two gradients it
    keeps for the step's backward are."""
    torch.manual_seed(0)
    hidden = torch.randn(32, DIM, requires_grad=True)
    weight = torch.randn(100, DIM, requires_grad=True)
    labels = torch.randint(0, 100, (32,))
    expected = linear_cross_entropy_sum_with_gradients(hidden, weight, labels, chunk_tokens=8)
    expected.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    offload = HostOffload(torch.device("cpu"), min_bytes=0)
    with offload.saving(0):
        loss = linear_cross_entropy_sum_with_gradients(hidden, weight, labels, chunk_tokens=8)
    assert offload.moved_bytes == (hidden.numel() + weight.numel()) * 4
    offload.fetch(0)
    loss.backward()
    assert torch.equal(loss, expected) and torch.equal(hidden.grad, grads[0]) and torch.equal(weight.grad, grads[1])


def test_the_plan_says_where_the_forwards_wait_and_refuses_them_where_they_would_not_be_held():
    """Held forwards without full checkpointing or without the exact scope would change nothing:
    refused as the config loads (every such case: ``tests/test_config_dependent.py``)."""
    config = load_config(["--config", "debug_moe.toml", "--moe.held_forwards", "host", *FULL])
    lines = held_forwards_line(resolve_job(config, 1).workload)
    assert len(lines) == 1 and "held in pinned host memory" in lines[0] and not cautions(config)
    (auto,) = held_forwards_line(resolve_job(load_config(["--config", "debug_moe.toml"]), 1).workload)
    assert "pre-pass of the step (`moe.held_forwards`): held forwards need full activation checkpointing" in auto
    for extra in ([], ["--moe.balance_loss_scope", "micro_batch", *FULL]):
        with pytest.raises(ConfigError, match=r"^`moe.held_forwards` = 'host' would change nothing: "):
            load_config(["--config", "debug_moe.toml", "--moe.held_forwards", "host", *extra])
