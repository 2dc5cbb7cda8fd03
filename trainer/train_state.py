"""The training loop's own counters, saved in every checkpoint beside the model and optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from trainer.grad_accumulator import GradAccumulator


class TrainState(Stateful):
    """The loop's own counters, saved with the checkpoint: the last finished step, the
    accumulator's skipped-step count and the RNG."""

    def __init__(self, accumulator: GradAccumulator):
        self.step = 0
        self.accumulator = accumulator

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "n_skipped_steps": self.accumulator.n_skipped_steps,
            "rng_cpu": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.accumulator.n_skipped_steps = int(state_dict["n_skipped_steps"])
        torch.set_rng_state(state_dict["rng_cpu"])
