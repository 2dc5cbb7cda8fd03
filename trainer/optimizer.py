"""AdamW and its learning-rate schedule (linear warm-up, constant, then decay)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import LRScheduler, Optimizer


def build_optimizer(
    model: nn.Module, config: Optimizer, device_type: str, layout_invariant: bool = False
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying norm gains toward 0 only hurts.

    ``layout_invariant`` (``debug.layout_invariant``) resolves ``auto`` to ``foreach``, whose
    update of an element does not depend on the shard it lies in; the fused CPU kernel's does.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" and not layout_invariant else "foreach"
    return torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def lr_factor(step: int, total_steps: int, config: LRScheduler) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based) of ``total_steps``.

    Three phases: ``W = min(warmup_steps, total_steps)`` warm-up steps climb linearly towards
    the peak, ``(i + 1) / (W + 1)`` on step i, so the very first step already moves; then the
    steps before the decay hold the peak; the last ``D`` steps decay, where ``D`` is
    ``round(decay_ratio x total_steps)`` capped at the steps left after warm-up (all of them when
    ``decay_ratio`` is -1). Decay step k (k = 1 .. D) has progress ``k / D``, so the decay leaves
    the peak on its first step and reaches ``min_lr_factor`` exactly on the last step, however
    few decay steps there are (one decay step runs at ``min_lr_factor``).
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
    # min(): the scheduler also evaluates the step after the last one, which never runs.
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    if config.decay_type == "linear":
        remaining = 1.0 - progress
    elif config.decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_factor + (1.0 - config.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, config: LRScheduler) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
