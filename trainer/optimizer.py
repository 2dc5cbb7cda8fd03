"""The optimizer (AdamW, or Muon with AdamW: ``trainer/muon.py``) and its learning-rate schedule (linear warm-up, constant, then decay), which a resume
takes from this run's settings, saying what changed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import LRScheduler, Optimizer
from trainer.muon import Muon, MuonSettings, takes_muon


def build_optimizer(
    model: nn.Module, config: Optimizer, device_type: str, layout_invariant: bool = False
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: decaying norm gains toward 0 only hurts. With
    ``optimizer.name = "Muon"``, the blocks' matrices take Muon's update and AdamW the rest.

    ``layout_invariant`` (``debug.layout_invariant``) resolves ``auto`` to ``foreach``, whose
    update of an element does not depend on the shard it lies in; the fused CPU kernel's does.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    muon: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if config.name == "Muon" and takes_muon(name):
            muon.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = config.implementation
    if impl == "auto":
        impl = "fused" if device_type == "cuda" and not layout_invariant else "foreach"
    adamw = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )
    if config.name != "Muon":
        return adamw
    coefficients = config.ns_coefficients
    settings = MuonSettings(
        config.momentum,
        config.nesterov,
        (coefficients[0], coefficients[1], coefficients[2]),
        config.ns_steps,
        config.adjust_lr_fn,
    )
    return Muon(muon, adamw, settings)


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


class LRSchedule(LambdaLR):
    """:func:`lr_factor`'s schedule over ``total_steps`` of ``config``, times each group's peak LR.

    Resumed, it keeps this run's schedule, which the checkpoint's state would override: torch's
    ``LambdaLR`` restores the peak LRs it was saved with (a new ``optimizer.lr`` would change
    nothing), and the step after the checkpoint would run at the rate the old schedule gave it.
    So loading takes the step count from the checkpoint and the rest from this run; what changed
    is said by the resume (:func:`schedule_change`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, config: LRScheduler):
        self.total_steps, self.config = total_steps, config
        # A plain function, saved as nothing: a callable object's attributes would be saved too.
        super().__init__(optimizer, lambda step: lr_factor(step, total_steps, config))

    def settings(self) -> dict[str, Any]:
        """What decides the rate at every step: recorded beside each checkpoint (``schedule.json``)."""
        return schedule_settings(self.total_steps, float(self.base_lrs[0]), self.config)

    def state_dict(self) -> dict[str, Any]:
        """``LambdaLR``'s, the checkpoint's format: the settings are ``schedule.json``'s."""
        return {key: value for key, value in super().state_dict().items() if key not in ("total_steps", "config")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "base_lrs": list(self.base_lrs)})
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * lr_factor(self.last_epoch, self.total_steps, self.config)

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The rate of the next step, as the optimizer holds it (also right after a load)."""
        return [group["lr"] for group in self.optimizer.param_groups]


def schedule_settings(total_steps: int, peak_lr: float, config: LRScheduler) -> dict[str, Any]:
    """The settings that decide every step's rate, by config key."""
    return {
        "training.steps": total_steps,
        "optimizer.lr": peak_lr,
        **{f"lr_scheduler.{key}": value for key, value in dataclasses.asdict(config).items()},
    }


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, config: LRScheduler) -> LRSchedule:
    return LRSchedule(optimizer, total_steps, config)


def schedule_change(saved: Mapping[str, Any], ours: Mapping[str, Any], step: int) -> str | None:
    """What resuming at ``step`` with this run's schedule (``ours``, :meth:`LRSchedule.settings`)
    changes against the checkpoint's (``saved``): the settings that differ and the next step's
    rate under both; None when nothing does."""
    differ = [key for key in ours if key in saved and saved[key] != ours[key]]
    if not differ:
        return None

    def rate(settings: Mapping[str, Any]) -> float:
        config = LRScheduler(**{k.split(".")[1]: v for k, v in settings.items() if k.startswith("lr_scheduler.")})
        return settings["optimizer.lr"] * lr_factor(step, int(settings["training.steps"]), config)

    both = "; ".join(f"`{key}` {saved[key]} there, {ours[key]} here" for key in differ)
    return (
        f"the LR schedule is this run's, not the checkpoint's ({both}): step {step + 1} trains at LR "
        f"{rate(ours):.3e} where the checkpoint's schedule gave {rate({**ours, **saved}):.3e}"
    )
