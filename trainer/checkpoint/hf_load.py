"""Starting weights from a Hugging Face Llama, Qwen3 or Qwen3-MoE folder (``checkpoint.initial_load_in_hf``).

A Hugging Face folder has no sharding metadata for DCP to reshard from, so each rank works out
the box of every global tensor it holds (FSDP shard x TP shard, its pipeline stages' parameters)
from the parameter's placements and reads only that box from the safetensors files, the q/k RoPE
permutation applied to the heads the box covers. Under expert parallelism the box of an expert
stack starts at the rank's ``first_expert`` (``stacked_box``), and the adapter reads each of
those experts' own tensors, only its FSDP rows: no rank touches another EP rank's experts. A
rank's host memory thus follows its shard, not the model; the values are those of converting the
whole folder and slicing it, bit for bit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.checkpoint.folders import PARAMETER_FIELDS, check_initial_load_kind, model_differences
from trainer.checkpoint.hf_folders import HFFolder
from trainer.config import Checkpoint
from trainer.model.hf_architectures import adapter_for_config
from trainer.model.hf_llama3 import InteropError
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.model.tiled_init import stacked_box
from trainer.runtime.errors import ConfigError, UserError

logger = logging.getLogger("meshtrain")

HF_FIELDS = PARAMETER_FIELDS + ("norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor")
"""Checked against ``config.json``: shapes alone would let a different RoPE base or norm epsilon
load silently."""


def check_folder_config(config: dict[str, Any], model_args: ModelArgs, path: Path) -> ModuleType:
    """The adapter of a folder's ``config.json``, after checking that it describes the model of
    ``model_args``, the MoE's routing included; raises ``UserError`` naming what differs."""
    adapter = adapter_for_config(config)
    theirs = adapter.model_args_from_hf_config(config)
    if type(theirs) is not type(model_args):
        raise InteropError(
            f"{path} holds a {type(theirs).__name__} model ({config.get('architectures')}) but `model.flavor` "
            f"is a {type(model_args).__name__} one; pick a flavor of the folder's architecture."
        )
    fields = HF_FIELDS + ("qk_norm",) + adapter.MODEL_FIELDS
    differ = model_differences(theirs, model_args, fields)
    if differ:
        raise InteropError(
            f"{path} holds a different model than `model.flavor` describes ({'; '.join(differ)}); pick the "
            "matching flavor and tokenizer."
        )
    return adapter


def load_hf_weights(model: Transformer, model_args: ModelArgs, path: Path) -> None:
    """Copy the weights of the Hugging Face folder ``path`` into ``model``, each rank its own
    slices, after checking that the folder describes the model of ``model_args``; raises
    ``UserError`` for a folder that cannot be loaded."""
    logger.info("loading Hugging Face weights from %s", path)
    folder = HFFolder(path)
    adapter = check_folder_config(folder.config, model_args, path)
    tied = bool(folder.config.get("tie_word_embeddings"))
    adapter.check_hf_shapes(folder.shapes, model_args, tie_word_embeddings=tied)
    problem = None
    with torch.no_grad():
        try:
            for name, param in model.named_parameters():
                offset, shape, _ = stacked_box(model.get_submodule(name.rpartition(".")[0]), param)
                box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.numel() == 0:
                    continue
                values = adapter.read_box(name, model_args, box, folder.read, tie_word_embeddings=tied)
                local.copy_(values.to(local.device, local.dtype))
            # Buffers the format holds (DeepSeek-V3's routing biases), whole on every rank.
            layout = adapter.hf_layout(model_args)
            for name, buffer in model.named_buffers():
                if name in layout:
                    whole = tuple(slice(0, n) for n in buffer.shape)
                    buffer.copy_(adapter.read_box(name, model_args, whole, folder.read).to(buffer.device, buffer.dtype))
        except InteropError as err:
            problem = str(err)
    _raise_on_every_rank(problem)


def _raise_on_every_rank(problem: str | None) -> None:
    """A weight only one rank reads (a NaN in its shard) fails every rank with the same line:
    the others would otherwise go on to their first collective and die there with a traceback."""
    if dist.is_available() and dist.is_initialized():
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise InteropError(problem)


def check_initial_load(config: Checkpoint, model_args: ModelArgs) -> None:
    """Refuse, before launch, a ``checkpoint.initial_load_path`` that is not what
    ``checkpoint.initial_load_in_hf`` says (``check_initial_load_kind``), or a Hugging Face
    folder whose config or tensor shapes (its headers: no weight is read) are not the model of
    ``model_args``. The weights' finiteness is checked as each rank reads its shard."""
    check_initial_load_kind(config)
    if not config.initial_load_in_hf:
        return
    try:
        folder = HFFolder(config.initial_load_path)
        adapter = check_folder_config(folder.config, model_args, folder.path)
        tied = bool(folder.config.get("tie_word_embeddings"))
        adapter.check_hf_shapes(folder.shapes, model_args, tie_word_embeddings=tied)
    except UserError as err:
        raise ConfigError(f"`checkpoint.initial_load_path`: {err}") from None
