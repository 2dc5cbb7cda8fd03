"""The training loop's own counters, checkpointed with the run."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    """The last finished step, how many steps were skipped (no valid token or a non-finite
    gradient) in all and in a row, and the RNG: the one owner of each, advanced by the loop.

    The streak of skipped steps is not checkpointed (the keys of a checkpoint are its format;
    DCP refuses to load a state with a key the checkpoint lacks): a resumed run counts afresh.
    """

    def __init__(self) -> None:
        self.step = 0
        self.n_skipped_steps = 0
        self.consecutive_skipped_steps = 0

    def record_step(self, skipped: bool) -> None:
        """Count the step that just finished."""
        if skipped:
            self.n_skipped_steps += 1
            self.consecutive_skipped_steps += 1
        else:
            self.consecutive_skipped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "n_skipped_steps": self.n_skipped_steps,
            "rng_cpu": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.n_skipped_steps = int(state_dict["n_skipped_steps"])
        torch.set_rng_state(state_dict["rng_cpu"])
