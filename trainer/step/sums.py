"""The one owner of a step's sums over ranks.

Every value a step adds up, or takes the largest of, across processes is reduced here, over the
ranks it is declared over (:class:`Ranks`), then over the replica groups that take part in the
step: the valid-token count N (started as the step begins, so it overlaps the forwards and
backwards), the values declared as :class:`Total` (the loss, the largest rank loss, any term a
loss adds), the MoE tables the balancing needs mid-step, and the gradients over the groups.
Adding a logged, exactly normalised value to the step is one more :class:`Total`
(docs/architecture.md, "Adding a term to the loss").

With ``ordered`` (``debug.layout_invariant``) every float sum of a :class:`Total` adds the
micro-batches' contributions of all ranks in global micro-batch order, ``g = i x dp + rank``,
by a tree fixed by their count (``ordered_sums.py``): the same bits on every layout.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.step.ordered_sums import pairwise_rows


class Ranks(enum.Enum):
    """The processes a value is reduced over (the meshes of ``parallelisms/parallel_dims.py``)."""

    TOKENS = "tokens"
    """Every rank that holds different label tokens: data-parallel x CP (the loss mesh)."""
    STAGES = "stages"
    """``TOKENS`` x the pipeline stages: only the last stage computes a loss."""
    ROUTING = "routing"
    """Every rank that routes different tokens through an MoE layer: ``TOKENS`` x TP."""
    MODEL = "model"
    """``ROUTING`` x the pipeline stages: the whole model's MoE tables."""
    PIPELINE = "pipeline"
    """The pipeline stages of one data-parallel rank (the same data: never over replica groups)."""
    WORLD = "world"
    """Every rank of this job (replica group)."""

    @property
    def holds_data(self) -> bool:
        """Whether the ranks hold different data: such a sum goes on over the replica groups."""
        return self in (Ranks.TOKENS, Ranks.STAGES, Ranks.ROUTING, Ranks.MODEL)


@dataclass(frozen=True)
class Logged:
    """How a value of the step is reported: its TensorBoard tag, and where the console line and
    the dashboard show it (the metrics logger writes every declared value, ``trainer/metrics``)."""

    tag: str
    label: str = ""
    """Its name on the console line (values of one label share a field); "": TensorBoard only."""
    chart: str = ""
    """``category/title`` of its Custom Scalars chart; "": the Scalars tab only."""
    every_step: bool = False
    """Written at every step, not only on log steps."""
    digits: int = 4


@dataclass(frozen=True)
class Total:
    """A value of the step reduced over ranks, declared once: contributed by :meth:`StepSums.add`
    (each micro-batch's, or the step's), reduced with the others at the step's end, and with
    ``logged`` on the console and TensorBoard."""

    name: str
    op: str = "sum"
    """``sum`` or ``max``."""
    over: Ranks = Ranks.STAGES
    per_token: bool = True
    """Reported divided by the step's valid tokens N: a sum over tokens becomes their mean."""
    logged: Logged | None = None


LOSS = Total("loss")
"""The summed token losses; reported as the token-weighted mean loss of the global batch."""
WORST = Total("max_loss", op="max", per_token=False)
"""Each rank's own mean loss, the largest of them (-inf from a rank that holds no loss)."""


class AcrossGroups(Protocol):
    """The fault-tolerant replica groups of the step (``trainer/replica_groups.py``)."""

    def participants(self) -> int: ...

    def sum_count(self, count: torch.Tensor) -> torch.Tensor: ...

    def sum_(self, tensors: list[torch.Tensor]) -> None: ...

    def max_(self, tensor: torch.Tensor) -> None: ...


class StepTotals:
    """The reduced values of one step: N, and each :class:`Total` (normalised if ``per_token``)."""

    def __init__(self, n: int, raw: dict[str, float], declared: Sequence[Total]):
        self.n = n
        self.raw = raw
        """Every reduced value as summed, the extra tensors of :meth:`StepSums.reduce` included."""
        self._declared = declared
        self._per_token = {t.name for t in declared if t.per_token}

    def __getitem__(self, name: str) -> float:
        value = self.raw[name]
        if name in self._per_token:
            return value / self.n if self.n else math.nan
        return value

    def logged(self) -> dict[str, float]:
        """Every declared total that is reported, by its tag."""
        return {t.logged.tag: self[t.name] for t in self._declared if t.logged is not None}


class StepSums:
    """Per step: :meth:`begin` with the rank's valid tokens, contributions by :meth:`add`, then
    :meth:`reduce`; :meth:`sum_` for a part that needs a sum mid-step."""

    def __init__(
        self,
        groups: Mapping[Ranks, dist.ProcessGroup | None],
        totals: Sequence[Total] = (LOSS, WORST),
        replicas: AcrossGroups | None = None,
        ordered: bool = False,
    ):
        """``groups``: the process group of each :class:`Ranks` (None: this process alone)."""
        self.groups = dict(groups)
        self.totals = tuple(totals)
        self.replicas = replicas
        self.ordered = ordered
        self._values: dict[str, list[torch.Tensor]] = {}
        self._count: torch.Tensor | None = None
        self._count_work: dist.Work | None = None
        self._counted = False

    @classmethod
    def alone(cls, totals: Sequence[Total] = (LOSS, WORST)) -> StepSums:
        """The sums of one process (a unit test, a tool)."""
        return cls(dict.fromkeys(Ranks), totals)

    def participants(self) -> int:
        """How many replica groups take part in the step (1 without them)."""
        return self.replicas.participants() if self.replicas is not None else 1

    def begin(self, local_count: torch.Tensor) -> None:
        """Start the step: this rank's valid tokens (``(1,)`` int64), summed asynchronously."""
        self._values = {t.name: [] for t in self.totals}
        self._count, self._counted = local_count.clone(), False
        group = self.groups[Ranks.TOKENS]
        self._count_work = dist.all_reduce(self._count, group=group, async_op=True) if group is not None else None

    def count(self) -> torch.Tensor:
        """The step's N, summed over the ranks and the participating replica groups (once)."""
        if self._count is None:
            raise RuntimeError("StepSums.begin must come before the step's count")
        if self._count_work is not None:
            self._count_work.wait()
            self._count_work = None
        if not self._counted:
            if self.replicas is not None:
                self._count = self.replicas.sum_count(self._count)
            self._counted = True
        return self._count

    def add(self, total: Total, value: torch.Tensor) -> None:
        """A contribution of this rank to ``total``: added to (or, for a maximum, compared with)
        those before it; ordered, kept as one micro-batch's, every rank adding as many."""
        value = value.detach().float().reshape(1)
        kept = self._values[total.name]
        if self.ordered or not kept:
            kept.append(value.clone())
        elif total.op == "sum":
            kept[0] += value
        else:
            torch.maximum(kept[0], value, out=kept[0])

    def sum_(self, tensors: list[torch.Tensor], over: Ranks) -> None:
        """Sum each tensor in place over ``over``, then, for data, over the participating groups."""
        group = self.groups[over]
        if group is not None:
            for t in tensors:
                dist.all_reduce(t, group=group)
        if over.holds_data:
            self.sum_groups_(tensors)

    def sum_groups_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor in place over the participating replica groups alone (the gradients,
        which FSDP has summed over the ranks of one group)."""
        if self.replicas is not None:
            self.replicas.sum_(tensors)

    def reduce(self, also: Mapping[str, torch.Tensor] | None = None) -> StepTotals:
        """Every declared total reduced, and N; ``also``: tensors already reduced (a gradient
        norm) read back in the same host synchronisation."""
        pending = [self._start(total) for total in self.totals if not (self.ordered and total.op == "sum")]
        reduced = {total.name: value for total, value, _ in pending}
        if self.ordered:
            reduced.update(self._ordered([t for t in self.totals if t.op == "sum"]))
        for total, value, work in pending:
            if work is not None:
                work.wait()
            if self.replicas is not None and total.over.holds_data:
                self.replicas.sum_([value]) if total.op == "sum" else self.replicas.max_(value)
        names = ["n", *reduced, *(also or {})]
        tensors = [self.count(), *reduced.values(), *(also or {}).values()]
        values = torch.cat([t.double().reshape(1).to(tensors[0].device) for t in tensors]).tolist()
        raw = dict(zip(names, values))
        return StepTotals(int(raw.pop("n")), raw, self.totals)

    def _start(self, total: Total) -> tuple[Total, torch.Tensor, dist.Work | None]:
        kept = self._values[total.name]
        if kept:
            value = kept[0]
        else:
            value = torch.full((1,), 0.0 if total.op == "sum" else -math.inf, device=self._device())
        group = self.groups[total.over]
        op = dist.ReduceOp.SUM if total.op == "sum" else dist.ReduceOp.MAX
        work = dist.all_reduce(value, op=op, group=group, async_op=True) if group is not None else None
        return total, value, work

    def _ordered(self, totals: list[Total]) -> dict[str, torch.Tensor]:
        """The sum totals added in global micro-batch order: ``(micro-batches, totals)`` from each
        rank, gathered and read as ``g = i x dp + rank``, each column summed by a fixed tree."""
        if not totals:
            return {}
        local = torch.stack([torch.cat(self._values[t.name]) for t in totals], dim=1)
        group = self.groups[Ranks.TOKENS]
        if group is not None and dist.get_world_size(group) > 1:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            local = torch.stack(gathered, dim=1).reshape(-1, len(totals))  # (i, rank) -> g = i x dp + rank
        sums = pairwise_rows(local.t().contiguous())
        return {t.name: sums[k].reshape(1) for k, t in enumerate(totals)}

    def _device(self) -> torch.device:
        return self._count.device if self._count is not None else torch.device("cpu")
