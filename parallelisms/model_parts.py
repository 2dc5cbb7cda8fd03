"""The parts of a torchtitan-style Llama that the parallelisms reach by name.

The parallelisms never import the model's class (the trainer depends on them, not the other
way round): they rely on its names. ``tok_embeddings``, ``norm`` and ``output`` (None on a
pipeline stage that lacks them), ``layers`` (a ModuleDict of blocks keyed "0".."L-1") and the
model's ``attention_mask``; a block's ``layer_id``, ``checkpoint_fn`` and
``attention.attention_fn``. ``nn.Module`` types every attribute it does not declare as
``Tensor | Module``; these functions give the names their types, in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn


class AttentionSettings(Protocol):
    attention_fn: Callable[..., torch.Tensor]


class BlockSettings(Protocol):
    """A block's plain attributes that the parallelisms read or set."""

    layer_id: int
    checkpoint_fn: Callable[..., torch.Tensor] | None
    attention: AttentionSettings


class ModelSettings(Protocol):
    """The model's plain attributes that the parallelisms set."""

    attention_mask: Callable[[torch.Tensor, torch.dtype], object]


def blocks(model: nn.Module) -> nn.ModuleDict:
    """``model.layers``: the blocks by name."""
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleDict)
    return layers


def end(model: nn.Module, name: str) -> nn.Module | None:
    """``model``'s ``tok_embeddings``, ``norm`` or ``output``; None on a pipeline stage that lacks it."""
    child = getattr(model, name)  # a name registered with None reads as None
    assert child is None or isinstance(child, nn.Module)
    return child


def tied_ends(model: nn.Module) -> bool:
    """Whether the output projection's weight is the token embedding's (a model that ties them,
    holding both ends)."""
    embedding, output = end(model, "tok_embeddings"), end(model, "output")
    return (
        embedding is not None
        and output is not None
        and output.get_parameter("weight") is embedding.get_parameter("weight")
    )


def retie_ends(model: nn.Module) -> None:
    """Make the output's weight the embedding's again, after a parallelism gave each its own."""
    embedding, output = end(model, "tok_embeddings"), end(model, "output")
    assert embedding is not None and output is not None
    output.register_parameter("weight", embedding.get_parameter("weight"))


def set_end(model: nn.Module, name: str, module: nn.Module | None) -> None:
    """Set ``model``'s ``tok_embeddings``, ``norm`` or ``output``; None keeps the name without the module."""
    model.register_module(name, module)


def block_settings(block: nn.Module) -> BlockSettings:
    # Plain attributes the model's blocks define in __init__; nn.Module cannot declare them.
    return cast(BlockSettings, block)


def model_settings(model: nn.Module) -> ModelSettings:
    # A plain attribute the model defines in __init__; nn.Module cannot declare it.
    return cast(ModelSettings, model)


def is_moe(module: nn.Module) -> bool:
    """A Mixture-of-Experts feed-forward: routed ``experts`` with a swappable token ``dispatch``
    (``trainer/model/moe.py``'s ``MoE``)."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and hasattr(experts, "dispatch")


def moe_layers(model: nn.Module) -> list[Any]:
    """The Mixture-of-Experts feed-forwards (:func:`is_moe`)."""
    return [m for m in model.modules() if is_moe(m)]
