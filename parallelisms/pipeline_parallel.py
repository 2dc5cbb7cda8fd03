"""Pipeline parallelism at run time: this rank's stages and the schedule that runs a step's
micro-batches through them (how the model is cut into stages, and which schedules allow which
cuts: ``parallelisms/pipeline_split.py``).

**Exactness.** The schedule runs with ``scale_grads=False`` and a *summed* loss: the gradients
it leaves are sums over the rank's tokens, which ``GradAccumulator`` normalises by the global
valid-token count N, as without PP. Every schedule here (``PipelineStage``'s FSDP handling)
reduces once per step after the last backward: one reduce-scatter, and under HSDP one
cross-replica all-reduce, per FSDP unit and step.

**Document masking.** Each sample's own positions and document ids go to ``schedule.step`` as
keyword arguments cut along the batch, so every stage builds the unsplit model's masks; without
masking one ``positions`` is replicated to every micro-batch.

**Layers that count what passes through them** (a Mixture-of-Experts' routing): torch's stages
learn their shapes by running their modules on a micro-batch before the first step and at every
switch between :meth:`Pipeline.forward_only` and :meth:`Pipeline.step`;
``torch_private.pipelining.in_metadata_inference`` is true during that pass, which counts for
nothing (torch 2.15's stages also put their modules' buffers back after it; 2.11 to 2.14's do not).

This module knows nothing of the trainer; it expects torchtitan's Llama module names and a
model whose ``forward`` accepts a missing embedding (hidden states in) and output (hidden states
out). With ``labels_to_model`` the last stage returns the summed loss itself (the chunked loss of
``trainer/loss.py``) instead of logits.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from parallelisms.pipeline_split import PipelineSplit
from parallelisms.torch_private import pipelining


@dataclass(frozen=True)
class PipelineFeed:
    """How a step's batch enters the pipeline."""

    microbatches: int
    microbatch_size: int
    positions: torch.Tensor
    """The RoPE positions of every sample without document masking; with it each call of
    :meth:`Pipeline.step` and :meth:`Pipeline.evaluate` passes its samples' own."""
    labels_to_model: bool = False
    """The last stage takes the labels and returns the summed loss itself."""
    document_mask: bool = False


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through them.

    Every rank of a pipeline calls :meth:`step` with the same inputs and labels (the data
    loader gives them to every stage); the first stage feeds the inputs, the last computes
    the summed loss of each micro-batch, the others exchange activations and gradients.
    """

    def __init__(
        self,
        stage_modules: list[nn.Module],
        split: PipelineSplit,
        pp_mesh: DeviceMesh,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        feed: PipelineFeed,
    ):
        self.pp_rank = pp_mesh.get_local_rank()
        self.group = pp_mesh.get_group()
        stage_ids = split.rank_stages(self.pp_rank)
        self.holds_first = 0 in stage_ids
        self.holds_last = split.num_stages - 1 in stage_ids
        self.schedule_name = split.schedule
        self.microbatches = feed.microbatches
        self.microbatch_size = feed.microbatch_size
        self.positions = feed.positions
        self._rows: int | None = None
        self.labels_to_model = labels_to_model = feed.labels_to_model
        self.document_mask = document_mask = feed.document_mask
        self.stages = [
            PipelineStage(module, index, split.num_stages, device, group=self.group)
            for module, index in zip(stage_modules, stage_ids)
        ]
        pipelining.no_warmup_with_itself(self.stages)
        pipelining.split_backward_on_unsharded(self.stages)
        pipelining.mark_metadata_inference(self.stages)
        schedule_class = get_schedule_class(split.schedule)
        first = self.stages[0] if issubclass(schedule_class, PipelineScheduleSingle) else self.stages
        self.schedule = schedule_class(
            first,
            feed.microbatches,
            loss_fn=_output_is_the_loss if labels_to_model else loss_fn,
            kwargs_chunk_spec={
                **(
                    {"positions": TensorChunkSpec(0), "document_ids": TensorChunkSpec(0)}
                    if document_mask
                    else {"positions": pipelining.Replicate()}
                ),
                **({"labels": TensorChunkSpec(0)} if labels_to_model else {}),
            },
            scale_grads=False,
        )
        self._forward_order = _forward_only_order(self.schedule)
        # Logits of every micro-batch would otherwise be kept until the step returns (and merged:
        # a last stage returning its loss returns scalars, which do not concatenate).
        self._step_kwargs = (
            {"return_outputs": False} if "return_outputs" in inspect.signature(self.schedule.step).parameters else {}
        )

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch; the last stage's summed micro-batch
        losses (other stages: an empty list). Gradients are left summed, not normalised.
        ``positions`` and ``document_ids`` (``batch, seq``): the samples' own, under document
        masking."""
        losses: list[torch.Tensor] = []
        if self._rows is not None:  # a shortened trace (:meth:`shorten`)
            inputs, labels = inputs[: self._rows], labels[: self._rows]
            positions, document_ids = (t[: self._rows] if t is not None else None for t in (positions, document_ids))
        self.schedule.step(
            *self._inputs(inputs),
            target=self._target(labels),
            losses=losses,
            **self._stage_kwargs(positions, document_ids),
            **self._labels(labels),
            **self._step_kwargs,
        )
        return losses

    def shorten(self, count: int, real: int) -> None:
        """Run the first ``count`` of the step's ``real`` micro-batches while each stage still
        holds what it holds for ``real`` of them (``--simulate`` traces one rank alone: torch's
        stages allocate every micro-batch's receive buffers before the step, and keep them)."""
        pipelining.run_fewer_microbatches(self.schedule, self.stages, count, real)
        self.microbatches = count
        self._rows = count * self.microbatch_size

    def observe_chunks(self, running: Callable[[int], None], after_backward: Callable[[], None]) -> None:
        """``running(chunk)`` before each stage computes micro-batch ``chunk``, ``after_backward()``
        after each backward (``--simulate`` attributes the step's costs to micro-batches)."""
        pipelining.observe_chunks(self.stages, running, after_backward)

    @torch.no_grad()
    def evaluate(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward only: the summed loss of ``inputs`` / ``labels`` (any number of sequences of
        the training length), on every rank of the pipeline.

        It equals ``loss_fn(model(inputs), labels)`` of the unsplit model, so a validation
        pass reduces it over the data-parallel ranks exactly as without PP. The schedule
        runs whole steps of its training shape: sequences are fed in groups of that many, and
        a last short group is padded with ignored labels, which add nothing to the sum. Call it,
        as :meth:`step`, inside the loss context (``loss_parallel()`` for a sharded vocabulary).
        """
        step_batch = self.microbatches * self.microbatch_size
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        for start in range(0, inputs.shape[0], step_batch):
            rows = slice(start, start + step_batch)
            chunk_inputs, chunk_labels = _padded(inputs[rows], labels[rows], step_batch)
            losses = self.forward_only(
                chunk_inputs,
                chunk_labels,
                None if positions is None else _padded_rows(positions[rows], step_batch),
                None if document_ids is None else _padded_rows(document_ids[rows], step_batch),
            )
            for loss in losses:
                total += (loss.to_local() if hasattr(loss, "to_local") else loss).float()
        dist.all_reduce(total, group=self.group)  # only the last stage holds a non-zero sum
        return total

    @torch.no_grad()
    def forward_only(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """One step's batch forward through every stage, without autograd: the last stage's
        summed micro-batch losses (other stages: an empty list). Each stage's activations reach
        the next by the schedule's own sends, so a pass that only needs what the stages see (a
        Mixture-of-Experts' counting pre-pass) runs the training step's micro-batches exactly."""
        losses: list[torch.Tensor] = []
        with self._running_forward_only():
            self.schedule.eval(
                *self._inputs(inputs),
                target=self._target(labels),
                losses=losses,
                **self._stage_kwargs(positions, document_ids),
                **self._labels(labels),
                **self._step_kwargs,
            )
        return losses

    def _stage_kwargs(
        self, positions: torch.Tensor | None, document_ids: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """What every stage's forward takes besides the hidden states."""
        if not self.document_mask:
            return {"positions": self.positions}
        if positions is None or document_ids is None:
            raise ValueError("a pipeline built for document masking needs each sample's positions and document ids")
        return {"positions": positions, "document_ids": document_ids}

    @contextlib.contextmanager
    def _running_forward_only(self) -> Iterator[None]:
        """Swap the forward-only order in for an evaluation (see :func:`_forward_only_order`)."""
        if self._forward_order is None:
            yield
            return
        training_order = self.schedule.pipeline_order_with_comms
        self.schedule.pipeline_order_with_comms = self._forward_order
        try:
            yield
        finally:
            self.schedule.pipeline_order_with_comms = training_order

    def _inputs(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (inputs,) if self.holds_first else ()

    def _target(self, labels: torch.Tensor) -> torch.Tensor | None:
        return labels if self.holds_last else None

    def _labels(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The labels as the model's own argument (every stage gets it; the last, holding the
        output projection, returns the summed loss)."""
        return {"labels": labels} if self.labels_to_model else {}


def _output_is_the_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss when the last stage computed it (``labels_to_model``)."""
    return output


_FORWARD_ACTIONS = frozenset({"F", "SEND_F", "RECV_F", "WAIT_SEND_F", "UNSHARD", "RESHARD"})
"""Action kinds of a forward pass in torch's schedule IR (``_ComputationType`` values; from 2.15 a
send is waited for by an action of its own, ``WAIT_SEND_F``, which the forward-only order keeps)."""


def _forward_only_order(schedule: object) -> dict[int, list] | None:
    """The multi-stage schedule's own action order with every backward action removed, or None
    for a single-stage schedule (whose ``eval`` already runs forwards only).

    ``eval`` of a multi-stage schedule replays the training order with backward turned off,
    and the zero-bubble schedules' split backward actions then fail ("can't steal_bwd_input if
    this stage doesn't have backward"). Each rank's forward actions, kept in their training
    order, are a valid schedule on their own (dropping actions adds no dependency), over the
    same stages and their placement, so every schedule evaluates the same way.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        return None
    return {
        rank: [action for action in actions if action is not None and action.computation_type.value in _FORWARD_ACTIONS]
        for rank, actions in order.items()
    }


def _padded(inputs: torch.Tensor, labels: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    missing = rows - inputs.shape[0]
    if missing == 0:
        return inputs, labels
    pad_inputs = inputs.new_zeros((missing, *inputs.shape[1:]))
    pad_labels = labels.new_full((missing, *labels.shape[1:]), IGNORE_LABEL)
    return torch.cat([inputs, pad_inputs]), torch.cat([labels, pad_labels])


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Positions or document ids of padded evaluation rows: zeros; their labels are all ignored."""
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))]) if x.shape[0] < rows else x


IGNORE_LABEL = -100
"""PyTorch's ``ignore_index``: padded evaluation rows add no loss and no token."""
