"""How a step's forwards and backwards run: one schedule per step, chosen by the plan.

- :class:`Interleaved`: each micro-batch's forward then its backward; with ``prepass``, first
  every micro-batch's forward without autograd (exact MoE balancing counts the step's routing).
- :class:`HeldForwards`: every forward first, then every backward (exact MoE balancing counts the
  routing in the step's own forwards, under full activation checkpointing); with an ``offload``
  what they save waits in host memory, each micro-batch's brought back a backward ahead.
- :class:`Pipelined`: the pipeline schedule runs the rank's micro-batches as one batch.

Each calls the parts at the step's phases (``part.py``).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from parallelisms.pipeline_parallel import Pipeline
from trainer.step.batches import MicroBatch
from trainer.step.forward import Forward
from trainer.step.host_offload import HostOffload
from trainer.step.part import Parts


class StepSchedule(Protocol):
    def run(self, parts: Parts, batch: list[MicroBatch]) -> None: ...


class Interleaved:
    def __init__(self, forward: Forward, prepass: bool = False):
        self.forward = forward
        self.prepass = prepass

    def run(self, parts: Parts, batch: list[MicroBatch]) -> None:
        with self.forward.context():
            if self.prepass:
                with torch.no_grad():
                    for i, mb in enumerate(batch):
                        parts.before_forward(i)
                        self.forward(mb)
            parts.forwards_done()
            for i, mb in enumerate(batch):
                parts.before_forward(i)
                parts.backward(i, self.forward(mb))


class HeldForwards:
    def __init__(self, forward: Forward, offload: HostOffload | None = None):
        self.forward = forward
        self.offload = offload

    def run(self, parts: Parts, batch: list[MicroBatch]) -> None:
        offload = self.offload
        if offload is not None:
            offload.begin_step()
        with self.forward.context():
            losses = []
            for i, mb in enumerate(batch):
                parts.before_forward(i)
                with offload.saving(i) if offload is not None else contextlib.nullcontext():
                    losses.append(self.forward(mb))
            parts.forwards_done()
            for i, loss in enumerate(losses):
                if offload is not None:
                    offload.fetch(i)
                    offload.fetch(i + 1)
                parts.backward(i, loss)


class Pipelined:
    """The rank's micro-batches are one batch for the pipeline schedule, which cuts it into
    pipeline micro-batches and runs every forward and backward on summed losses; with
    ``prepass`` the same batch first runs forward-only through the pipeline."""

    def __init__(self, pipeline: Pipeline, forward: Forward, prepass: bool = False):
        self.pipeline = pipeline
        self.forward = forward
        self.prepass = prepass

    def run(self, parts: Parts, batch: list[MicroBatch]) -> None:
        inputs, labels = torch.cat([mb.inputs for mb in batch]), torch.cat([mb.labels for mb in batch])
        positions = document_ids = None
        if batch[0].document_ids is not None:  # each sample's positions and document ids go through the schedule
            positions = torch.cat([mb.positions for mb in batch if mb.positions is not None])
            document_ids = torch.cat([mb.document_ids for mb in batch if mb.document_ids is not None])
        with self.forward.context():
            if self.prepass:
                self.pipeline.forward_only(inputs, labels, positions, document_ids)
            parts.forwards_done()
            losses = self.pipeline.step(inputs, labels, positions, document_ids)
        for i, loss in enumerate(losses):
            parts.after_backward(i, loss)
