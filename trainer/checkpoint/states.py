"""What a checkpoint holds of the model and the optimizer: DCP ``Stateful`` views keyed by
parameter name, so that both reshard onto any mesh on load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint.expert_shards import ExpertShards, optimizer_fqn
from trainer.checkpoint.location import Location, dcp_reader
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.optimizer import LRSchedule
from trainer.train_state import TrainState


@dataclass(frozen=True)
class Checkpointed:
    """What a checkpoint holds of a run, and what a checkpoint must match to resume it."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRSchedule
    dataloader: Stateful
    train_state: TrainState
    model_args: ModelArgs
    total_steps: int
    data_identity: dict[str, str] = field(default_factory=dict)


class ModelState(Stateful):
    """The model's parameters by name, as (sharded) DTensors of their global shape: DCP
    reshards them on load (expert-parallel ones through ``ExpertShards``). A tied matrix is
    saved once, under its first name (``tok_embeddings.weight``), and given back to both."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype
        self.experts = ExpertShards(model)
        self.aliases = tied_names(model)

    def state_dict(self) -> dict[str, Any]:
        state = self.experts.to_global(get_model_state_dict(self.model), lambda key: key)
        state = {k: v for k, v in state.items() if k not in self.aliases}
        if self.dtype is not None:
            state = {k: v.to(self.dtype) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = {**state_dict, **{alias: state_dict[name] for alias, name in self.aliases.items()}}
        set_model_state_dict(self.model, self.experts.to_fsdp(state))


def tied_names(model: nn.Module) -> dict[str, str]:
    """A parameter's second name -> its first, for each parameter the model holds twice."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name, so it reshards like the parameters.

    The parameter groups' hyperparameters are saved per parameter name too (``flatten``):
    a list of groups, each naming its parameters, would be saved once, from the rank that
    wins DCP's deduplication, and a pipeline stage's groups name only its own parameters, so
    a run on another pipeline degree would lose the others'. Checkpoints from before pipeline
    parallelism hold the list form; ``flatten = False`` loads them.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.flatten = True
        self.experts = ExpertShards(model)

    def state_dict(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.model, self.optimizer, options=self._options())
        return self.experts.to_global(state, optimizer_fqn)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = self.experts.to_fsdp(state_dict)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self._options())

    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=self.flatten)


def optimizer_name(path: Location) -> str | None:
    """The optimizer whose state a checkpoint holds: Muon where it holds Muon's momentum buffers,
    AdamW otherwise; None for a checkpoint without optimizer state."""
    keys = dcp_reader(path).read_metadata().state_dict_metadata
    if not any(k.startswith("optimizer.state.") for k in keys):
        return None
    return "Muon" if any(k.endswith(".momentum_buffer") for k in keys) else "AdamW"


def optimizer_groups_flattened(path: Location) -> bool:
    """Whether the checkpoint at ``path`` keys parameter-group settings by parameter name
    (``optimizer.param_groups.<fqn>.lr``) rather than by group index (``...param_groups.0.lr``)."""
    keys = dcp_reader(path).read_metadata().state_dict_metadata
    prefix = "optimizer.param_groups."
    return not any(k.startswith(prefix) and k[len(prefix) :].split(".")[0].isdigit() for k in keys)
