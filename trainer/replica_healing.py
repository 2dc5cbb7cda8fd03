"""Healing a replica group that joins behind the others: what a live group sends, and how the
joining group loads it (``trainer/replica_groups.py`` asks torchft for the transfer).

The state is each rank's local shards, keyed by parameter name: the same local rank of every
group holds the same shards, so no resharding is needed, and the transfer is torchft's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.data.loader import MicroBatchLoader
from trainer.train_state import TrainState


@dataclass(frozen=True)
class HealedParts:
    """What a healing group receives from its peer and what a live group sends."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: MicroBatchLoader
    train_state: TrainState


def sent_state(parts: HealedParts, identity: dict[str, str]) -> dict[str, Any]:
    """What a live group sends: this rank's weights, optimizer state, schedule, data position
    and train state, with the job's identity for the receiver to compare."""
    optimizer_state = {
        name: {key: _local(value) for key, value in parts.optimizer.state[param].items()}
        for name, param in parts.model.named_parameters()
        if param in parts.optimizer.state
    }
    return {
        "identity": identity,
        "model": {name: _local(t) for name, t in parts.model.state_dict().items()},
        "optimizer": optimizer_state,
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in parts.optimizer.param_groups],
        "scheduler": parts.scheduler.state_dict(),
        "loader": parts.loader.state_dict(),
        "train_state": parts.train_state.state_dict(),
    }


def load_received(parts: HealedParts, received: dict[str, Any]) -> None:
    """Copy a peer's :func:`sent_state` into this rank's shards; optimizer slots this rank has
    not created yet are created like the parameter."""
    with torch.no_grad():
        for name, t in parts.model.state_dict().items():
            _local(t).copy_(received["model"][name])
        for name, param in parts.model.named_parameters():
            slots = received["optimizer"].get(name)
            if slots is None:
                parts.optimizer.state.pop(param, None)
                continue
            mine = parts.optimizer.state.setdefault(param, {})
            for key, value in slots.items():
                if key in mine and isinstance(mine[key], torch.Tensor):
                    _local(mine[key]).copy_(value)
                elif isinstance(value, torch.Tensor) and value.shape == _local(param).shape:
                    mine[key] = torch.zeros_like(param)
                    _local(mine[key]).copy_(value)
                else:
                    mine[key] = value.clone() if isinstance(value, torch.Tensor) else value
    for group, values in zip(parts.optimizer.param_groups, received["param_groups"]):
        group.update(values)
    parts.scheduler.load_state_dict(received["scheduler"])
    parts.loader.load_state_dict(received["loader"])
    parts.train_state.load_state_dict(received["train_state"])


def weights_digest(model: nn.Module) -> str:
    """A hash of this rank's weights: equal on the same local rank of every group that trained
    the same steps (the end of the run logs it)."""
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode())
        digest.update(_local(t).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
