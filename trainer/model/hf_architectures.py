"""Which Hugging Face adapter converts a model: ``hf_llama3``, ``hf_qwen3`` or ``hf_qwen3_moe``.

A folder says what it is in ``config.json`` (``architectures``, ``model_type``), a run or a
checkpoint in the type of its ``ModelArgs``. Each adapter offers the same functions
(``model_args_from_hf_config``, ``hf_config``, ``hf_pieces``, ``to_hf_piece``, ``hf_layout``,
``check_state_dict``, ``check_hf_shapes``, ``read_box``), so the folders, the loader and the
converters call them without knowing the architecture.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from trainer.model import hf_llama3, hf_qwen3, hf_qwen3_moe
from trainer.model.families import family_of
from trainer.model.hf_llama3 import CONFIG_FILE, InteropError
from trainer.model.llama3 import ModelArgs

_BY_ARCHITECTURE = {
    "LlamaForCausalLM": hf_llama3,
    hf_qwen3.ARCHITECTURE: hf_qwen3,
    hf_qwen3_moe.ARCHITECTURE: hf_qwen3_moe,
}
_BY_MODEL_TYPE = {"llama": hf_llama3, hf_qwen3.MODEL_TYPE: hf_qwen3, hf_qwen3_moe.MODEL_TYPE: hf_qwen3_moe}
_BY_FAMILY = {"llama3": hf_llama3, "qwen3": hf_qwen3, "moe": hf_qwen3_moe}


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
    """The adapter of our model ``args`` describe; a family without one is refused."""
    family = family_of(args)
    if family not in _BY_FAMILY:
        raise InteropError(
            f'`model.name` = "{family}" has no Hugging Face conversion yet (DeepseekV3ForCausalLM is not '
            "built): keep its checkpoints as DCP folders, which resume and reshard on any mesh."
        )
    return _BY_FAMILY[family]
