"""Starting weights from a Hugging Face Llama folder (``checkpoint.initial_load_in_hf``).

Every rank reads the whole folder and copies its own slice into the (possibly sharded) model:
a Hugging Face folder has no sharding metadata for DCP to reshard from.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint.folders import PARAMETER_FIELDS, model_differences
from trainer.checkpoint.hf_folders import load_hf_folder
from trainer.model.hf_llama3 import InteropError, from_hf_state_dict, model_args_from_hf_config
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.model.tiled_init import local_slice

logger = logging.getLogger("meshtrain")

HF_FIELDS = PARAMETER_FIELDS + ("norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor")
"""Checked against ``config.json``: shapes alone would let a different RoPE base or norm epsilon
load silently."""


def load_hf_weights(model: Transformer, model_args: ModelArgs, path: Path) -> None:
    """Copy the weights of the Hugging Face folder ``path`` into ``model``, after checking that
    the folder describes the model of ``model_args``; raises ``UserError`` for a folder that
    cannot be loaded."""
    logger.info("loading Hugging Face weights from %s", path)
    hf_state, hf_cfg = load_hf_folder(str(path))
    differ = model_differences(model_args_from_hf_config(hf_cfg), model_args, HF_FIELDS)
    if differ:
        raise InteropError(
            f"{path} holds a different model than `model.flavor` describes ({'; '.join(differ)}); pick the "
            "matching flavor and tokenizer."
        )
    tied = bool(hf_cfg.get("tie_word_embeddings"))
    load_full_weights(model, from_hf_state_dict(hf_state, model_args, tie_word_embeddings=tied))


def load_full_weights(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into a possibly sharded model, each rank its own slice
    (under pipeline parallelism: of its stages' parameters; the others' are not unexpected).

    ``state`` has been checked against the model's ``ModelArgs``, so a mismatch here is a bug.
    """
    params = dict(model.named_parameters())
    missing = params.keys() - state.keys()
    unexpected = {name for name in state.keys() - params.keys() if not _held_by_another_stage(model, name)}
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, param in params.items():
            full = state[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(param.shape)}")
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(local_slice(full.to(local.device, local.dtype), param))


def _held_by_another_stage(model: Transformer, name: str) -> bool:
    """Under pipeline parallelism a rank's model lacks the other stages' blocks and ends."""
    top, _, rest = name.partition(".")
    if top == "layers":
        return rest.split(".")[0] not in model.layers
    return hasattr(model, top) and getattr(model, top) is None
