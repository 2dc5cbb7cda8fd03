"""Hugging Face model folders: ``config.json`` plus safetensors weights, one file or shards.

The layout is what ``LlamaForCausalLM.from_pretrained`` reads and ``save_pretrained`` writes, so
an export loads in transformers and a published Llama 3 folder loads here. The tensors are
Hugging Face's (``trainer/model/hf_llama3.py`` converts the names and the q/k layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from trainer.model.hf_llama3 import CONFIG_FILE, InteropError, hf_config, preview_names, to_hf_state_dict
from trainer.model.llama3 import ModelArgs
from trainer.runtime.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default shard size (5 GB): the Hub and ``from_pretrained`` expect shards near it."""


def _safetensors() -> ModuleType:
    """``safetensors.torch``, imported on first use: only the HF conversions need it."""
    try:
        import safetensors.torch
    except ImportError as err:
        raise ConfigError(
            "reading or writing Hugging Face folders needs safetensors: `pip install safetensors` "
            '(or `pip install -e ".[hf]"`).'
        ) from err
    return safetensors.torch


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most ``max_shard_bytes`` (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes.items():
        if shards[-1] and filled + nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def save_hf_folder(
    path: str | Path,
    state_dict_ours: dict[str, torch.Tensor],
    args: ModelArgs,
    dtype: torch.dtype,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``config.json`` and the weights in ``dtype`` as a folder ``from_pretrained`` loads.

    One ``model.safetensors`` when the weights fit in ``max_shard_bytes``, else numbered shards
    and ``model.safetensors.index.json``. Shards are cast one at a time, so the extra memory is
    one shard, not a second copy of the model. A folder that already holds a config or weights is
    refused: ``from_pretrained`` prefers a stale ``model.safetensors`` over a new index.
    """
    st = _safetensors()
    out = Path(path)
    stale = sorted(p.name for p in out.glob("*") if p.name == CONFIG_FILE or ".safetensors" in p.name)
    if stale:
        raise InteropError(f"{out} already holds {stale}; export into a new or empty folder.")
    config = hf_config(args, dtype)
    hf_sd = to_hf_state_dict(state_dict_ours, args)
    out.mkdir(parents=True, exist_ok=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: t.numel() * itemsize for name, t in hf_sd.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    for names, filename in zip(shards, files):
        tensors = {n: hf_sd[n].detach().to(device="cpu", dtype=dtype).contiguous() for n in names}
        st.save_file(tensors, str(out / filename), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {n: f for names, f in zip(shards, files) for n in names},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_hf_folder(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The Hugging Face state dict (CPU tensors, stored dtype) and ``config.json`` of a folder.

    Reads a single ``model.safetensors`` or a sharded folder with its index, as ``from_pretrained`` does.
    """
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise InteropError(f"{folder} has no {CONFIG_FILE}; pass a Hugging Face model folder.")
    config = _read_json(config_path)
    if (folder / SINGLE_FILE).is_file():
        return _read_safetensors(folder / SINGLE_FILE), config
    if not (folder / INDEX_FILE).is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise InteropError(
            f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (it holds {preview_names(found)}); only "
            f"safetensors weights are read. Re-save PyTorch .bin weights with "
            f"`model.save_pretrained(folder, safe_serialization=True)`."
        )
    weight_map = _read_json(folder / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict):
        raise InteropError(f"{folder / INDEX_FILE} has no `weight_map`; re-save the model with `save_pretrained`.")
    state_dict: dict[str, torch.Tensor] = {}
    for filename in sorted(set(weight_map.values())):
        if not (folder / filename).is_file():
            raise InteropError(f"{folder / INDEX_FILE} lists {filename}, which is missing from the folder.")
        state_dict.update(_read_safetensors(folder / filename))
    absent = sorted(set(weight_map) - set(state_dict))
    if absent:
        raise InteropError(f"{folder / INDEX_FILE} maps {preview_names(absent)} to shards that do not hold them.")
    return state_dict, config


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a Hugging Face folder; a damaged file is named as such."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InteropError(f"{path} is not valid JSON ({err}); re-download or re-save the model.") from err
    if not isinstance(value, dict):
        raise InteropError(
            f"{path} holds a JSON {type(value).__name__}, not an object; re-download or re-save the model."
        )
    return value


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or damaged file is named as such."""
    st = _safetensors()
    from safetensors import SafetensorError

    try:
        return st.load_file(str(path))
    except SafetensorError as err:
        raise InteropError(f"{path} is not a readable safetensors file ({err}); re-download or re-save it.") from err
