"""What the Hugging Face adapters of our Mixture-of-Experts models share (``hf_qwen3_moe.py``,
``hf_deepseek_v3.py``): we stack the routed experts into three 3-D parameters (``w1``/``w3``/``w2``
= ``gate``/``up``/``down``, one slice per expert), a folder stores one 2-D tensor per expert. The
folder's tensors from ours, our layout back, the read of a box of experts, and the check of a
state dict's names and shapes against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer.model.hf_llama3 import InteropError, family_hint, preview_names

EXPERTS = "feed_forward.experts."
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

Piece = tuple[str, int | None, torch.Size]
"""One Hugging Face tensor: our tensor it comes from, the expert (a slice of it) or None, its shape."""


def expert_hf_name(name: str, expert: int) -> str:
    """The folder's tensor of expert ``expert`` of our stacked parameter ``name``."""
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_NAMES[rest.removeprefix(EXPERTS)[:2]]}.weight"


def pieces(
    tensors: Iterable[tuple[str, torch.Size]], n_experts: int, hf_name: Callable[[str], str]
) -> dict[str, Piece]:
    """Hugging Face name -> ``Piece`` of our ``(name, shape)`` tensors, in their order, each
    expert's tensors together; ``hf_name`` names the others."""
    out: dict[str, Piece] = {}
    for name, shape in tensors:
        if EXPERTS in name:
            for e in range(n_experts):
                out[expert_hf_name(name, e)] = (name, e, shape[1:])
        else:
            out[hf_name(name)] = (name, None, shape)
    return out


def layout(hf_pieces: dict[str, Piece], n_experts: int) -> dict[str, tuple[str, torch.Size]]:
    """Our tensor name -> (Hugging Face name, with ``*`` for the expert, shape), in our order."""
    out: dict[str, tuple[str, torch.Size]] = {}
    for hf_name, (name, expert, shape) in hf_pieces.items():
        if expert is None:
            out[name] = (hf_name, shape)
        elif expert == 0:
            out[name] = (hf_name.replace(".experts.0.", ".experts.*."), torch.Size((n_experts, *shape)))
    return out


def read_experts(
    name: str, n_experts: int, box: tuple[slice, ...], read_hf: Callable[[str, tuple[slice, ...]], torch.Tensor]
) -> torch.Tensor:
    """Our stacked parameter ``name``'s ``box``: the box of each expert it covers, stacked."""
    experts = range(*box[0].indices(n_experts))
    return torch.stack([read_hf(expert_hf_name(name, e), box[1:]) for e in experts])


def check_tensors(sd: dict[str, Any], expected: dict[str, torch.Size], what: str, model: str) -> None:
    """Raise ``InteropError`` unless ``what`` (``sd``) holds exactly the ``expected`` names and
    shapes of ``model`` (its description: layers, architecture, experts)."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise InteropError(
            f"{what} does not match {model}: missing keys {preview_names(missing)}, unexpected keys "
            f"{preview_names(unexpected)}." + family_hint(missing, unexpected)
        )
    wrong = [k for k, shape in expected.items() if tuple(sd[k].shape) != tuple(shape)]
    if wrong:
        raise InteropError(
            f"{what}: `{wrong[0]}` has shape {tuple(sd[wrong[0]].shape)} but the model args give "
            f"{tuple(expected[wrong[0]])}; the weights were made with other model args."
        )
