"""AdamW and its learning-rate schedule (linear warm-up, constant, then decay)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, config: Optimizer, device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying norm gains toward 0 only hurts."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" else "foreach"
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(step: int, total_steps: int, config: LRScheduler) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Warm-up is linear from 1/(warmup+1) so the very first step already moves; the decay phase
    covers the last ``decay_ratio`` of the steps (all steps after warm-up when -1), starts at
    the peak and reaches ``min_lr_factor`` on the last step.
    """
    warmup = min(config.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total_steps - warmup
    if config.decay_ratio >= 0:
        decay_steps = min(decay_steps, round(total_steps * config.decay_ratio))
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / max(decay_steps - 1, 1)
    if config.decay_type == "linear":
        remaining = 1.0 - progress
    elif config.decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, config: LRScheduler) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
