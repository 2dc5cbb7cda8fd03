"""Which Hugging Face adapter converts a model: ``hf_llama3``, ``hf_qwen3``, ``hf_qwen3_moe`` or
``hf_deepseek_v3``.

A folder says what it is in ``config.json`` (``architectures``, ``model_type``), a run or a
checkpoint in the type of its ``ModelArgs``. Each adapter offers the same functions
(``model_args_from_hf_config``, ``hf_config``, ``hf_pieces``, ``to_hf_piece``, ``hf_layout``,
``check_state_dict``, ``check_hf_shapes``, ``read_box``, and ``MODEL_FIELDS``, what a folder's
config must match beyond the shapes), so the folders, the loader and the converters call them
without knowing the architecture.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from trainer.model import hf_deepseek_v3, hf_llama3, hf_qwen3, hf_qwen3_moe
from trainer.model.families import family_of
from trainer.model.hf_llama3 import CONFIG_FILE, InteropError
from trainer.model.llama3 import ModelArgs

_BY_ARCHITECTURE = {
    "LlamaForCausalLM": hf_llama3,
    hf_qwen3.ARCHITECTURE: hf_qwen3,
    hf_qwen3_moe.ARCHITECTURE: hf_qwen3_moe,
    hf_deepseek_v3.ARCHITECTURE: hf_deepseek_v3,
}
_BY_MODEL_TYPE = {
    "llama": hf_llama3,
    hf_qwen3.MODEL_TYPE: hf_qwen3,
    hf_qwen3_moe.MODEL_TYPE: hf_qwen3_moe,
    hf_deepseek_v3.MODEL_TYPE: hf_deepseek_v3,
}
_BY_FAMILY = {"llama3": hf_llama3, "qwen3": hf_qwen3, "moe": hf_qwen3_moe, "deepseek_v3": hf_deepseek_v3}


def adapter_for_config(cfg: dict[str, Any]) -> ModuleType:
    """The adapter of a folder's ``config.json``; a folder of another architecture is refused."""
    architectures = cfg.get("architectures") or []
    found = {_BY_ARCHITECTURE[a] for a in architectures if a in _BY_ARCHITECTURE}
    model_type = cfg.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        found.add(_BY_MODEL_TYPE[model_type])
    if not architectures and model_type is None:
        return hf_llama3
    if len(found) != 1:
        raise InteropError(
            f"{CONFIG_FILE} describes {architectures} (model_type {model_type!r}); meshtrain converts only "
            f"{', '.join(_BY_ARCHITECTURE)}."
        )
    return found.pop()


def adapter_for_args(args: ModelArgs) -> ModuleType:
    """The adapter of our model ``args`` describe."""
    return _BY_FAMILY[family_of(args)]
