"""Muon for the blocks' weight matrices, AdamW for every other parameter: one optimizer, the same
update on every mesh.

Muon (``torch.optim.Muon``) keeps one momentum buffer per matrix and steps along the buffer's
orthogonalised direction, which a Newton–Schulz iteration finds from the whole matrix. FSDP, TP,
EP and HSDP leave each rank a shard of it, so the updates of the matrices that share a shape and
a layout are stacked and exchanged (an all-to-all among the ranks holding the shards) until each
rank holds whole matrices, its share of the stack; each rank orthogonalises its share, and the
results go back to the shards' layout. Every matrix is orthogonalised whole, by the same function
as on one process: the update is the one-process update on every mesh (docs/muon.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallelisms.torch_private import dtensor

WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod)\.")
MATRICES = re.compile(
    r"^layers\.\d+\.(attention\.w[qkvo]\.weight"
    r"|feed_forward\.(w[123]\.weight|experts\.w[123]|shared_experts\.w[123]\.weight))$"
)
"""The parameters Muon updates: each block's attention and feed-forward matrices, its routed experts'
(each expert's matrix its own) and its shared experts'. The embedding, the output layer, the
norms and the router take AdamW."""
EPS = 1e-7
"""The floor of the norm the Newton–Schulz iteration divides by (torch.optim.Muon's)."""


def takes_muon(name: str) -> bool:
    """Whether the parameter named ``name`` (wrappers' prefixes aside) takes Muon's update."""
    return bool(MATRICES.match(WRAPPERS.sub("", name)))


@dataclass(frozen=True)
class MuonSettings:
    """``[optimizer]``'s Muon keys (torch.optim.Muon's names)."""

    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    adjust_lr_fn: str


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    """The orthogonalised ``matrix`` in bfloat16: the quintic iteration ``torch.optim.Muon`` runs,
    operation for operation, so that one process's update is torch's to the bit."""
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjustment: str, shape: tuple[int, ...]) -> float:
    """The learning rate of a matrix of ``shape`` (rows, columns: the whole matrix's, never a
    shard's), scaled so that its update's RMS does not depend on its shape."""
    rows, cols = shape
    if adjustment == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """The shape Muon's learning rate is adjusted by: the whole matrix's (an expert's), never a shard's."""
    rows, cols = param.shape[-2:]
    return rows, cols


def orthogonalised(updates: list[torch.Tensor], settings: MuonSettings) -> list[torch.Tensor]:
    """Each update orthogonalised matrix by matrix (a 3-D stack of experts, expert by expert)."""
    out = []
    for update in updates:
        matrices = update.reshape(-1, *update.shape[-2:])
        done = [newton_schulz(m, settings.ns_coefficients, settings.ns_steps) for m in matrices]
        out.append(torch.stack(done).reshape(update.shape) if done else update.bfloat16())
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class _Stage:
    """One all-to-all of the exchange: over ``group``, making the stack's ``dim`` whole from the
    ``sizes`` its ranks hold (``torch.chunk``'s split, as DTensor's)."""

    group: dist.ProcessGroup
    dim: int
    sizes: tuple[int, ...]


def _chunks(length: int, n: int) -> tuple[int, ...]:
    chunk = -(-length // n)
    return tuple(max(0, min(chunk, length - i * chunk)) for i in range(n))


def _stages(param: DTensor, offset: int) -> list[_Stage]:
    """The all-to-alls that make ``param``'s matrices whole, the innermost split first: per tensor
    dimension, the mesh dimensions that split it in the order they were applied (plain shards by
    mesh dimension, then FSDP's strided shard of a TP shard), undone in reverse. A stack of
    experts split by expert stays where it lies (those matrices are whole)."""
    mesh, placements = param.device_mesh, param.placements
    stages: list[_Stage] = []
    for tensor_dim in range(1 if param.ndim == 3 else 0, param.ndim):
        applied = [d for d, p in enumerate(placements) if dtensor.split_dim(p) == tensor_dim]
        applied.sort(key=lambda d: (dtensor.is_strided(placements[d]), d))
        length, splits = param.shape[tensor_dim], []
        for d in applied:
            sizes = _chunks(length, mesh.size(d))
            splits.append(_Stage(mesh.get_group(d), tensor_dim + offset, sizes))
            length = sizes[mesh.get_local_rank(d)]
        stages += reversed(splits)
    return stages


def _gathered(local: torch.Tensor, stage: _Stage) -> tuple[torch.Tensor, tuple[int, torch.Size]]:
    """``stage``'s all-to-all: this rank's share of the stack (padded with zero matrices to a
    multiple of the ranks, so that each takes as many), whole along the stage's dimension."""
    n, dim = len(stage.sizes), stage.dim
    stacked = local.shape[0]
    padded = torch.cat([local, local.new_zeros(-stacked % n, *local.shape[1:])])
    received = padded.new_empty(sum(_numels(padded.shape, stage)))
    dist.all_to_all_single(
        received, padded.reshape(-1), _numels(padded.shape, stage), [padded.numel() // n] * n, group=stage.group
    )
    share = padded.shape[0] // n
    shapes = [(share, *padded.shape[1:dim], size, *padded.shape[dim + 1 :]) for size in stage.sizes]
    pieces = [piece.view(shape) for piece, shape in zip(received.split(_numels(padded.shape, stage)), shapes)]
    return torch.cat(pieces, dim=dim), (stacked, padded.shape)


def _returned(done: torch.Tensor, stage: _Stage, kept: tuple[int, torch.Size]) -> torch.Tensor:
    """The inverse of :func:`_gathered`: each rank's rows or columns of its stack, back."""
    stacked, shape = kept
    back = done.new_empty(shape)
    outgoing = torch.cat([piece.reshape(-1) for piece in done.split(list(stage.sizes), dim=stage.dim)])
    n = len(stage.sizes)
    dist.all_to_all_single(back.view(-1), outgoing, [back.numel() // n] * n, _numels(shape, stage), group=stage.group)
    return back[:stacked]


def _numels(padded: torch.Size, stage: _Stage) -> list[int]:
    """Elements of each rank's piece of a share: the share's matrices, that rank's rows or columns."""
    share = padded[0] // len(stage.sizes)
    others = math.prod(padded[1:]) // padded[stage.dim]
    return [share * others * size for size in stage.sizes]


def distributed_orthogonalised(
    params: list[DTensor], updates: list[torch.Tensor], settings: MuonSettings
) -> list[torch.Tensor]:
    """The local shards ``updates`` of ``params`` (DTensors of one shape and layout) orthogonalised
    whole: stacked, exchanged stage by stage until each rank holds whole matrices (its share of
    the stack), orthogonalised there, and returned. A 3-D parameter (a stack of experts) goes alone."""
    first = params[0]
    experts = first.ndim == 3
    local = updates[0] if experts else torch.stack(updates)
    stages = _stages(first, offset=0 if experts else 1)
    kept = []
    for stage in stages:
        local, shapes = _gathered(local, stage)
        kept.append(shapes)
    done = orthogonalised([local], settings)[0]
    for stage, shapes in zip(reversed(stages), reversed(kept)):
        done = _returned(done, stage, shapes)
    return [done] if experts else list(done.unbind(0))


def _layout(param: torch.Tensor) -> tuple[Any, ...]:
    if not isinstance(param, DTensor):
        return ("local", id(param))
    if param.ndim == 3:
        return ("experts", id(param))
    return ("matrices", param.device_mesh, tuple(param.placements), tuple(param.shape), param.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked ``muon``, AdamW (torch's, sharing this optimizer's groups and
    state) on the others; the LR schedule and checkpoints see one optimizer."""

    def __init__(self, muon_params: list[nn.Parameter], adamw: torch.optim.AdamW, settings: MuonSettings):
        self.settings = settings
        muon = {"params": muon_params, "muon": True, "lr": adamw.defaults["lr"]}
        muon["weight_decay"] = adamw.param_groups[0]["weight_decay"]
        for group in adamw.param_groups:
            group["muon"] = False
        super().__init__([muon, *adamw.param_groups], {"muon": False})
        self.adamw = adamw
        self._link()

    def _link(self) -> None:
        """AdamW steps the groups and keeps the state of this optimizer (also after a load)."""
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        self.adamw.step()
        return None

    def _muon_step(self, group: dict[str, Any]) -> None:
        settings = self.settings
        params = [p for p in group["params"] if p.grad is not None]
        updates: dict[tuple[Any, ...], list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - settings.momentum)
            update = grad.lerp(buffer, settings.momentum) if settings.nesterov else buffer
            updates.setdefault(_layout(param), []).append((param, update))
        lr, decay = group["lr"], group["weight_decay"]
        for members in updates.values():
            shards = [update for _, update in members]
            if isinstance(members[0][0], DTensor):
                done = distributed_orthogonalised([p for p, _ in members], shards, settings)  # type: ignore[misc]
            else:
                done = orthogonalised(shards, settings)
            for (param, _), direction in zip(members, done):
                local = _local(param)
                local.mul_(1 - lr * decay)
                local.add_(direction, alpha=-adjusted_lr(lr, settings.adjust_lr_fn, matrix_shape(param)))
