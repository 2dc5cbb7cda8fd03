"""One training step: what it is made of (``train_step.py``), how it normalises the loss
(``grad_accumulator.py``) and the parts that take part in it."""

from trainer.step.train_step import (
    MicroBatch,
    StepParts,
    StepStats,
    fetch_step,
    forward_backward,
    optimizer_step,
    train_step,
)

__all__ = ["MicroBatch", "StepParts", "StepStats", "fetch_step", "forward_backward", "optimizer_step", "train_step"]
