"""The model families ``model.name`` chooses, each with its flavors, and which family a model's
arguments belong to (a checkpoint's or a Hugging Face folder's, which carry no name)."""

from __future__ import annotations

from collections.abc import Mapping

from trainer.model import deepseek_v3, llama3, moe, qwen3
from trainer.model.deepseek_v3 import DeepSeekV3Args
from trainer.model.llama3 import ModelArgs
from trainer.model.moe import MoEArgs

FAMILIES: dict[str, Mapping[str, ModelArgs]] = {
    "llama3": llama3.FLAVORS,
    "qwen3": qwen3.FLAVORS,
    "moe": moe.FLAVORS,
    "deepseek_v3": deepseek_v3.FLAVORS,
}
"""``model.name`` -> its ``model.flavor`` presets."""


def family_of(args: ModelArgs) -> str:
    """The ``model.name`` that builds a model of ``args``: DeepSeek-V3 by its latent attention, the
    MoE, else Qwen3 by its q/k norms."""
    if isinstance(args, DeepSeekV3Args):
        return "deepseek_v3"
    if isinstance(args, MoEArgs):
        return "moe"
    return "qwen3" if args.qk_norm else "llama3"
