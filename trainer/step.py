"""One training step, whole: what it is made of, what it does, what it reports.

:func:`train_step` fetches this rank's micro-batches (:meth:`StepParts.place` puts each on the
device, its sequence shard under context parallelism), runs forward and backward on each
(:func:`forward_backward`; under pipeline parallelism the schedule runs them,
:func:`pipeline_forward_backward`), lets the gradient accumulator normalise and clip
(``trainer/grad_accumulator.py``), steps the optimizer and returns the step's
:class:`StepStats`. The loss is ``trainer/loss.py``'s, the model ``trainer/model/llama3.py``;
the loop around the steps is ``trainer/train.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from parallelisms.context_parallel import ContextParallel
from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline_parallel import Pipeline
from parallelisms.tensor_parallel import loss_context
from trainer.data.documents import split_documents
from trainer.data.loader import MicroBatchLoader
from trainer.expert_balance import BalanceStats, ExpertBalance
from trainer.grad_accumulator import GradAccumulator, StepResult
from trainer.host_offload import HostOffload
from trainer.loss import ModelLoss
from trainer.model.llama3 import Transformer
from trainer.optimizer import LRSchedule
from trainer.replica_groups import ReplicaGroups, ReplicaStats
from trainer.train_state import TrainState

logger = logging.getLogger("meshtrain")


class MicroBatch(NamedTuple):
    """What one forward takes: this rank's tokens, labels and their RoPE positions (None:
    ``0..seq-1``), and the tokens' document ids under document masking (else None)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None
    document_ids: torch.Tensor | None


@dataclass
class StepParts:
    """What a training step uses, built once with every parallelism already applied."""

    device: torch.device
    meshes: Meshes
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: LRSchedule
    loader: MicroBatchLoader
    accumulator: GradAccumulator
    loss_parallel: bool
    model_loss: ModelLoss
    context_parallel: ContextParallel | None
    positions: torch.Tensor | None
    """Sequence positions of this rank's tokens under context parallelism (else 0..seq-1)."""
    document_bos_id: int | None = None
    """With ``training.document_mask``: the BOS that opens each packed document (else None)."""

    def place(self, inputs: torch.Tensor, labels: torch.Tensor) -> MicroBatch:
        """Whole samples -> this rank's micro-batch (its sequence shard under CP), on the device.

        Documents are split on the whole sequences, before CP takes its shard: a shard alone
        cannot tell where the document of its first token began.
        """
        positions, document_ids = self.positions, None
        cp = self.context_parallel
        if self.document_bos_id is not None:
            labels, positions, document_ids = split_documents(inputs, labels, self.document_bos_id)
            if cp:
                positions, document_ids = cp.shard(positions), cp.shard(document_ids)
        if cp:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
        device = self.device
        return MicroBatch(
            inputs.to(device, non_blocking=True),
            labels.to(device, non_blocking=True),
            None if positions is None else positions.to(device, non_blocking=True),
            None if document_ids is None else document_ids.to(device, non_blocking=True),
        )

    pipeline: Pipeline | None = None
    """This rank's pipeline stages and their schedule (None without pipeline parallelism);
    ``model`` then holds only these stages' modules."""
    balance: ExpertBalance | None = None
    """A Mixture-of-Experts model's balancing over the step (None for a dense model)."""
    after_optimizer_step: Callable[[], None] | None = None
    """What must follow each optimizer step that changed the weights (float8's precomputed scales)."""
    offload: HostOffload | None = None
    """Where exact MoE balancing's held forwards wait in host memory (``moe.held_forwards``), else None."""

    @contextlib.contextmanager
    def compute_context(self) -> Iterator[None]:
        """Where every forward and backward runs, in training and validation alike: loss
        parallel's sharded logits, and under the ring backend PyTorch's patched attention."""
        cp = self.context_parallel
        with loss_context(self.loss_parallel), cp.attention_context() if cp else contextlib.nullcontext():
            yield


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one optimizer step measured: the accumulator's result (losses and ``n_valid_tokens``
    reduced across ranks, the same on every rank) and what only the loop knows; ``local_tokens``
    stays per process, because throughput is reported per device."""

    step: int
    result: StepResult
    lr: float
    local_tokens: int
    n_skipped_steps: int
    """Steps skipped so far in the run (counted by the train state, restored on resume)."""
    data_time_s: float
    step_time_s: float
    balance: BalanceStats | None = None
    """A Mixture-of-Experts model's balancing loss and expert loads of the step."""
    replicas: ReplicaStats | None = None
    """With fault-tolerant replica groups: which groups trained the step, and their tokens."""
    committed: bool = True
    """False when the replica groups' quorum broke during the step: nothing of it was kept (the
    weights, optimizer, schedule and data position are those before it) and it is run again."""


def train_step(
    parts: StepParts,
    state: TrainState,
    local_tokens: int,
    stop_requested: Callable[[], bool] = lambda: False,
    replicas: ReplicaGroups | None = None,
) -> StepStats:
    """Fetch the step's micro-batches, forward and backward each, finalize, step.
    ``stop_requested`` is asked while the data is late (see :meth:`MicroBatchLoader.next_step`).
    ``replicas``: this group's fault-tolerant replica groups, which decide whether the step commits."""
    step_start = time.perf_counter()
    position = parts.loader.state_dict() if replicas is not None else None
    microbatches = fetch_step(parts, stop_requested)
    data_time = time.perf_counter() - step_start
    result = forward_backward(parts, microbatches)
    balance = parts.balance.finish_step(result.skipped) if parts.balance else None
    if parts.balance is not None and parts.balance.bias_skipped:
        result = skip_for_routing_bias(result, parts.balance.bias_update_rate)
    committed = replicas is None or replicas.commit()
    if not committed:
        assert position is not None  # saved above whenever there are replica groups
        parts.optimizer.zero_grad(set_to_none=True)
        parts.loader.load_state_dict(position)
        if parts.balance is not None:
            parts.balance.undo_bias_move()
        lr = float(parts.scheduler.get_last_lr()[0])
    else:
        lr = optimizer_step(parts, result)
        state.record_step(result.skipped)
    return StepStats(
        step=state.step,
        result=result,
        lr=lr,
        local_tokens=local_tokens,
        n_skipped_steps=state.n_skipped_steps,
        data_time_s=data_time,
        step_time_s=time.perf_counter() - step_start,
        balance=balance,
        replicas=replicas.stats() if replicas is not None else None,
        committed=committed,
    )


def skip_for_routing_bias(result: StepResult, rate: float) -> StepResult:
    """The step whose routing-bias move would not be finite: skipped like a non-finite gradient,
    so the weights and the biases both stay those of the last good step."""
    reason = f"non-finite routing bias after its move by `moe.bias_update_rate` = {rate:g}"
    logger.warning("skipping the optimizer step: %s", reason)
    return dataclasses.replace(result, skipped=True, skip_reason=reason)


def fetch_step(parts: StepParts, stop_requested: Callable[[], bool] = lambda: False) -> list[MicroBatch]:
    """This rank's micro-batches of the next step, on the device."""
    return [parts.place(inputs, labels) for inputs, labels in parts.loader.next_step(stop_requested)]


def forward_backward(parts: StepParts, microbatches: list[MicroBatch]) -> StepResult:
    """Accumulate summed-loss gradients over the micro-batches; finalize normalises and clips."""
    if parts.pipeline is not None:
        return pipeline_forward_backward(parts, parts.pipeline, microbatches)
    accumulator = parts.accumulator
    accumulator.begin_step([mb.labels for mb in microbatches])
    if parts.balance is not None:
        parts.balance.begin_step(lambda: counting_prepass(parts, microbatches), accumulator.global_count)
        if parts.balance.hold_forwards:
            return forwards_then_backwards(parts, parts.balance, microbatches)
    with parts.compute_context():
        for i, (inputs, labels, positions, document_ids) in enumerate(microbatches):
            accumulator.prepare_backward(i)
            loss = parts.model_loss(parts.model, inputs, positions, document_ids, labels)
            loss.backward()
            accumulator.record_loss(loss)
    return accumulator.finalize()


def forwards_then_backwards(parts: StepParts, balance: ExpertBalance, microbatches: list[MicroBatch]) -> StepResult:
    """The step's forwards, all of them, then its backwards: what the forwards route gives the
    exact balancing loss its global counts before the first backward, with no forward run twice
    (``trainer/expert_balance.py``). Under full checkpointing a held forward keeps its blocks'
    inputs and the final hidden states or its loss's gradients; with ``parts.offload`` in host
    memory, each micro-batch's brought back while the one before it runs its backward."""
    accumulator, offload = parts.accumulator, parts.offload
    if offload is not None:
        offload.begin_step()
    with parts.compute_context():
        losses = []
        for i, (inputs, labels, positions, document_ids) in enumerate(microbatches):
            with offload.saving(i) if offload is not None else contextlib.nullcontext():
                losses.append(parts.model_loss(parts.model, inputs, positions, document_ids, labels))
        balance.count_forwards()
        for i, loss in enumerate(losses):
            if offload is not None:
                offload.fetch(i)
                offload.fetch(i + 1)
            accumulator.prepare_backward(i)
            loss.backward()
            accumulator.record_loss(loss)
    return accumulator.finalize()


def counting_prepass(parts: StepParts, microbatches: list[MicroBatch]) -> None:
    """Every micro-batch's forward, without autograd: the MoE layers count the step's routing
    (``trainer/expert_balance.py``)."""
    with parts.compute_context():
        for inputs, labels, positions, document_ids in microbatches:
            parts.model_loss(parts.model, inputs, positions, document_ids, labels)


def pipeline_forward_backward(parts: StepParts, pipeline: Pipeline, microbatches: list[MicroBatch]) -> StepResult:
    """The rank's micro-batches are one batch for the pipeline schedule, which cuts it into
    pipeline micro-batches and runs every forward and backward on summed losses; finalize
    normalises and clips as without PP. A Mixture-of-Experts' counting pre-pass runs the same
    batch forward-only through the pipeline, each stage counting its own layers."""
    accumulator = parts.accumulator
    accumulator.begin_step([mb.labels for mb in microbatches])
    inputs, labels = torch.cat([mb.inputs for mb in microbatches]), torch.cat([mb.labels for mb in microbatches])
    # Under document masking, each sample's positions and document ids go through the schedule.
    positions = document_ids = None
    if microbatches[0].document_ids is not None:
        positions = torch.cat([mb.positions for mb in microbatches if mb.positions is not None])
        document_ids = torch.cat([mb.document_ids for mb in microbatches if mb.document_ids is not None])
    if parts.balance is not None:

        def prepass() -> None:
            with parts.compute_context():
                pipeline.forward_only(inputs, labels, positions, document_ids)

        parts.balance.begin_step(prepass, accumulator.global_count)
    with parts.compute_context():
        losses = pipeline.step(inputs, labels, positions, document_ids)
    accumulator.record_pipeline_losses(losses)
    return accumulator.finalize()


def optimizer_step(parts: StepParts, result: StepResult) -> float:
    """Step (unless the step was skipped), clear the gradients, advance the schedule; return the LR used."""
    if not result.skipped:
        parts.optimizer.step()
        if parts.after_optimizer_step is not None:
            parts.after_optimizer_step()
    parts.optimizer.zero_grad(set_to_none=True)
    lr = float(parts.scheduler.get_last_lr()[0])
    parts.scheduler.step()
    return lr
