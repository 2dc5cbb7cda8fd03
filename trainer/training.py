"""What the training loop trains with, built once by ``trainer/build.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelisms.parallel_dims import Meshes
from parallelisms.pipeline_parallel import Pipeline
from trainer.model.llama3 import Transformer
from trainer.replica_groups import ReplicaGroups
from trainer.step.forward import Forward
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.train_step import Step
from trainer.train_state import TrainState


@dataclass(frozen=True)
class Training:
    """The sharded model and its meshes, the optimizer and its schedule, the train state, the
    step, the forward it and validation run, and this rank's pipeline stages and replica groups
    where the job has them."""

    device: torch.device
    meshes: Meshes
    model: Transformer
    """Under pipeline parallelism, only this rank's stages' modules."""
    optimizer: OptimizerStep
    state: TrainState
    step: Step
    forward: Forward
    pipeline: Pipeline | None = None
    replicas: ReplicaGroups | None = None
