"""Gradient reduction whose bits do not depend on the data-parallel layout (``debug.layout_invariant``).

With a fixed micro-batch size every global micro-batch ``g`` (``g = i x dp + dp rank`` for a
rank's micro-batch ``i``, see ``trainer/data/loader.py``) runs the same kernels on the same
shapes wherever it runs, from the same weights, so its gradient has the same bits on every
layout. What differs between 1 process with 8 micro-batches and FSDP on 4 ranks with 2 is the
order of the sums: autograd accumulating micro-batches, the reduce-scatter adding ranks in its
own order, HSDP's all-reduce, the norm's partial sums. Float addition is not associative, so
each of those changes the last bits. Here every sum has one order, fixed by the global batch:

- FSDP does not reduce (``set_requires_gradient_sync(False)``); in each micro-batch's backward
  every unit's unsharded gradient is taken out of FSDP and each shard is sent, with one
  all-to-all over the data-parallel ranks (the bytes of a reduce-scatter), to the ranks that own
  it: every rank receives, for its own shard, the contributions of micro-batches
  ``g = i x dp + 0 .. dp - 1`` in ``g`` order, and adds them into a :class:`PairwiseSum` whose
  tree depends on ``g`` only. Under HSDP each shard goes to every replica holding it, so the
  replicas compute the same sums instead of all-reducing.
- The gradient norm adds squares per row (FSDP shards along rows, so a row never straddles two
  ranks) with a fixed tree, gathers the row sums and adds them in global row order.
- The logged loss sum adds the per-micro-batch sums in ``g`` order (``sums.py``, ordered).

Each addition is an elementwise IEEE add, whose result does not depend on where the element
sits in a tensor (vectorised body or scalar tail). AdamW's ``foreach`` and ``for-loop`` kernels
have the same property on CPU (``tests/test_layout_invariant.py`` checks it), ``fused`` does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle

from parallelisms.torch_private import fsdp
from trainer.step.ordered_sums import PairwiseSum, pairwise_rows
from trainer.step.part import StepPart, StepResult

logger = logging.getLogger("meshtrain")


@dataclass
class _Param:
    """One parameter's FSDP rows: which rows each shard holds, and where this rank's are kept."""

    param: DTensor
    fsdp_param: Any
    """FSDP's ``FSDPParam``, whose unsharded parameter receives the micro-batch's gradient."""
    row_len: int
    rows: list[tuple[int, int]]
    """``[start, end)`` rows of shard ``s`` (``torch.chunk`` along dim 0, as FSDP cuts them)."""
    offset: int
    """Where this rank's shard starts in its unit's flat buffer."""

    def numel(self, shard: int) -> int:
        start, end = self.rows[shard]
        return (end - start) * self.row_len


@dataclass
class _Unit:
    """One FSDP unit's parameters, exchanged together: one all-to-all per unit and micro-batch."""

    group: Any
    """FSDP's ``FSDPParamGroup`` of the unit."""
    params: list[_Param]
    sum: PairwiseSum = field(default_factory=PairwiseSum)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """This micro-batch's unsharded gradients so far, by index in ``params``."""
    sent: int = 0
    """Micro-batches of this step already sent."""
    pending: tuple[torch.Tensor, dist.Work | None] | None = None
    """The last all-to-all's receive buffer and its handle, not yet added to ``sum``."""


class LayoutInvariantReduction(StepPart):
    """The step's gradient sums in one order: each micro-batch's gradient sent to its owners
    after its backward, the sums and their norm after the step (:meth:`reduced`).

    A unit's exchange starts during the backward, as soon as autograd has produced the gradients
    of all its parameters (a post-accumulate-grad hook on FSDP's unsharded parameters), and runs
    while the backward goes on, as FSDP's reduce-scatter would; every rank runs the same graph,
    so the units' all-to-alls start in the same order everywhere. ``add_microbatch`` sends what
    the hooks did not (a parameter the micro-batch did not use sends zeros).
    """

    def __init__(self, model: nn.Module, batch_group: dist.ProcessGroup | None, dp_shard: int) -> None:
        if not isinstance(model, FSDPModule):
            raise TypeError("the layout-invariant reduction takes gradients out of FSDP: shard the model first")
        model.set_requires_gradient_sync(False)
        self.model = model
        self.group = batch_group
        self.dp = dist.get_world_size(batch_group) if batch_group is not None else 1
        self.dp_shard = dp_shard
        self.shard = (dist.get_rank(batch_group) if batch_group is not None else 0) % dp_shard
        self._units: list[_Unit] | None = None
        self._params: list[_Param] = []
        """Every parameter in the model's order: the order of the norm's rows."""
        self._sent = 0
        """Micro-batches of this step whose backward has run."""
        self._hooks: dict[int, list[RemovableHandle]] = {}
        for module in model.modules():
            if (group := fsdp.param_group(module)) is not None:
                handle = module.register_forward_hook(partial(self._install_grad_hooks, id(group)))
                self._hooks.setdefault(id(group), []).append(handle)

    def begin(self, batch: object) -> None:
        self._sent = 0
        for unit in self._layout():
            unit.sum, unit.grads, unit.sent, unit.pending = PairwiseSum(), {}, 0, None

    def _install_grad_hooks(self, group_id: int, *_: Any) -> None:
        """After the unit's first forward, when FSDP has made its unsharded parameters."""
        for handle in self._hooks.pop(group_id, []):
            handle.remove()
        (unit,) = [unit for unit in self._layout() if id(unit.group) == group_id]
        for index, p in enumerate(unit.params):
            unsharded = fsdp.unsharded_param(p.fsdp_param)
            assert unsharded is not None  # made by the unit's first all-gather, before this hook
            unsharded.register_post_accumulate_grad_hook(partial(self._on_grad, unit, index))

    def _on_grad(self, unit: _Unit, index: int, unsharded: torch.Tensor) -> None:
        if unsharded.grad is None:
            return
        unit.grads[index] = unsharded.grad
        unsharded.grad = None
        if len(unit.grads) == len(unit.params):
            self._send(unit)

    def after_backward(self, microbatch: int, loss: torch.Tensor) -> None:
        """After the micro-batch's backward: send what its hooks did not."""
        self._sent += 1
        for unit in self._layout():
            if unit.sent == self._sent:
                continue
            for index, p in enumerate(unit.params):
                grad = fsdp.take_unsharded_grad(p.fsdp_param)
                if index not in unit.grads:
                    unit.grads[index] = torch.zeros(p.param.shape, device=p.param.device) if grad is None else grad
            self._send(unit)

    def _send(self, unit: _Unit) -> None:
        """Start sending each shard of the unit's micro-batch gradient to the ranks that own it."""
        self._receive(unit)
        pieces = []
        for q in range(self.dp):  # rank q owns shard q % dp_shard (dp ranks are replica-major)
            shard = q % self.dp_shard
            for index, p in enumerate(unit.params):
                start, end = p.rows[shard]
                pieces.append(unit.grads[index].reshape(-1, p.row_len)[start:end].reshape(-1).float())
        send = torch.cat(pieces)
        unit.grads, unit.sent = {}, unit.sent + 1
        if self.dp == 1:
            unit.pending = (send, None)
            return
        mine = sum(p.numel(self.shard) for p in unit.params)
        recv = torch.empty(self.dp * mine, dtype=torch.float32, device=send.device)
        splits = [sum(p.numel(q % self.dp_shard) for p in unit.params) for q in range(self.dp)]
        work = dist.all_to_all_single(recv, send, [mine] * self.dp, splits, group=self.group, async_op=True)
        unit.pending = (recv, work)

    def _receive(self, unit: _Unit) -> None:
        """Add the unit's last exchange to its sum: the contributions of ``g = i x dp + 0 .. dp - 1``."""
        if unit.pending is None:
            return
        recv, work = unit.pending
        if work is not None:
            work.wait()
        for contribution in recv.view(self.dp, -1):
            unit.sum.add(contribution)
        unit.pending = None

    def reduced(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Set every parameter's gradient (its shard of the summed micro-batch gradients);
        return the gradients and their norm over the whole model, ``(1,)``."""
        flats = {}
        for unit in self._layout():
            self._receive(unit)
            flats[id(unit)] = unit.sum.total()
        grads: list[torch.Tensor] = []
        row_sums = []
        for unit in self._layout():
            for p in unit.params:
                local = flats[id(unit)][p.offset : p.offset + p.numel(self.shard)]
                param = p.param
                param.grad = DTensor.from_local(
                    local.view(param.to_local().shape),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                grads.append(param.grad)
        for p in self._params:
            local = p.param.grad.to_local()  # type: ignore[union-attr]  # set just above
            row_sums.append(pairwise_rows(local.reshape(-1, p.row_len).square()))
        squares = self._global_rows(torch.cat(row_sums))
        return grads, pairwise_rows(squares.view(1, -1))[0].sqrt().reshape(1)

    def finish(self, result: StepResult) -> None:
        """The step's exact values in hexadecimal, for comparing runs line by line."""
        if self.group is None or dist.get_rank() == 0:
            logger.info(
                "exact step values: loss %s, tokens %d, grad norm %s",
                result.loss_avg.hex(),
                result.n_valid_tokens,
                result.grad_norm.hex(),
            )

    def _global_rows(self, mine: torch.Tensor) -> torch.Tensor:
        """Every parameter's row sums, from every shard, in the model's row order."""
        if self.dp_shard == 1:
            return mine
        counts = [sum(p.rows[s][1] - p.rows[s][0] for p in self._params) for s in range(self.dp_shard)]
        padded = torch.zeros(max(counts), dtype=mine.dtype, device=mine.device)
        padded[: mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.dp)]
        dist.all_gather(gathered, padded, group=self.group)
        pieces, starts = [], [0] * self.dp_shard
        for p in self._params:
            for s in range(self.dp_shard):  # ranks 0 .. dp_shard - 1: the first replica's shards
                n = p.rows[s][1] - p.rows[s][0]
                pieces.append(gathered[s][starts[s] : starts[s] + n])
                starts[s] += n
        return torch.cat(pieces)

    def _layout(self) -> list[_Unit]:
        """The FSDP units with their parameters' rows, in the model's order (found once)."""
        if self._units is not None:
            return self._units
        entries: dict[int, _Param] = {}
        self._units = []
        for module in self.model.modules():
            group = fsdp.param_group(module)
            if group is None or any(id(fp.sharded_param) in entries for fp in group.fsdp_params):
                continue  # not a unit, or a unit of several modules already seen
            unit, offset = _Unit(group, []), 0
            for fsdp_param in group.fsdp_params:
                entry = self._rows(fsdp_param, offset)
                entries[id(fsdp_param.sharded_param)] = entry
                unit.params.append(entry)
                offset += entry.numel(self.shard)
            self._units.append(unit)
        for param in self.model.parameters():
            if id(param) not in entries:
                raise RuntimeError("a parameter outside FSDP: the layout-invariant reduction needs every one sharded")
            self._params.append(entries[id(param)])
        return self._units

    def _rows(self, fsdp_param: Any, offset: int) -> _Param:
        param = fsdp_param.sharded_param
        assert isinstance(param, DTensor) and param.numel() > 0  # fully_shard registers DTensors
        n_rows = param.shape[0]
        chunk = -(-n_rows // self.dp_shard)
        rows = [(min(s * chunk, n_rows), min((s + 1) * chunk, n_rows)) for s in range(self.dp_shard)]
        entry = _Param(param, fsdp_param, param.numel() // n_rows, rows, offset)
        sharded = [placement for placement in param.placements if not placement.is_replicate()]
        if sharded not in ([Shard(0)], []) or param.to_local().numel() != entry.numel(self.shard):
            raise RuntimeError(f"FSDP's shard of a {tuple(param.shape)} parameter is not rows {rows[self.shard]}")
        return entry
