"""Hugging Face model folders: ``config.json`` plus safetensors weights, one file or shards.

The layout is what ``from_pretrained`` reads and ``save_pretrained`` writes, so an export loads
in transformers and a published Llama 3 or Qwen3-MoE folder loads here. The tensors are Hugging
Face's (``trainer/model/hf_architectures.py`` picks the adapter that converts names and layouts).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from trainer.checkpoint.disk import staged_output
from trainer.checkpoint.folders import folder_kind
from trainer.checkpoint.integrity import first_non_finite
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.model.hf_architectures import adapter_for_args
from trainer.model.hf_llama3 import CONFIG_FILE, HF_DTYPES, InteropError, preview_names
from trainer.model.llama3 import ModelArgs
from trainer.runtime.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
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
    tokenizer: str | Path | None = None,
) -> None:
    """``export_hf_folder`` of a state dict of full tensors held in memory."""
    adapter_for_args(args).check_state_dict(state_dict_ours, args)
    export_hf_folder(
        path, state_dict_ours.__getitem__, args, dtype, max_shard_bytes=max_shard_bytes, tokenizer=tokenizer
    )


def export_hf_folder(
    path: str | Path,
    read: Callable[[str], torch.Tensor],
    args: ModelArgs,
    dtype: torch.dtype,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | Path | None = None,
) -> None:
    """Write a folder ``from_pretrained`` loads: the weights in ``dtype``, ``config.json``,
    ``generation_config.json`` and, given the run's ``tokenizer`` file, its Hugging Face files.

    ``read(name)`` gives one full tensor of ours at a time and each is written out before the
    next is read, so the memory needed is one tensor, never a shard or the model: a safetensors
    header needs only names, dtypes and shapes, which ``args`` gives. One ``model.safetensors``
    when the weights fit in ``max_shard_bytes``, else numbered shards and
    ``model.safetensors.index.json``. Every file is readable by all (0644). A folder that already
    holds a config or weights is refused: ``from_pretrained`` prefers a stale
    ``model.safetensors`` over a new index. The files appear in ``path`` only once all are
    written (``staged_output``), and the tokenizer is read first: a mistake found late, a full
    disk or Ctrl-C leaves no partial model to block the rerun.
    """
    out = Path(path)
    if max_shard_bytes < 1:
        raise InteropError(
            f"the largest shard (`--max-shard-bytes`) must be a positive number of bytes, got {max_shard_bytes}."
        )
    stale = sorted(p.name for p in out.glob("*") if p.name == CONFIG_FILE or ".safetensors" in p.name)
    if stale:
        raise InteropError(f"{out} already holds {stale}; export into a new or empty folder.")
    generation: dict[str, Any] = {"_from_model_config": True}
    if tokenizer is not None:
        loaded = _read_tokenizer(Path(tokenizer))
        generation.update(bos_token_id=loaded.bos_id, eos_token_id=loaded.eos_id)
    adapter = adapter_for_args(args)
    config = adapter.hf_config(args, dtype)
    pieces = adapter.hf_pieces(args)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {hf_name: math.prod(shape) * itemsize for hf_name, (_, _, shape) in pieces.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    )
    with staged_output(out, "export", needs=sum(sizes.values())) as staging:
        held: tuple[str, torch.Tensor] | None = None  # the experts' HF tensors are slices of one of ours
        for names, filename in zip(shards, files):
            shapes = {n: tuple(pieces[n][2]) for n in names}
            with open(staging / filename, "wb") as file:
                file.write(_safetensors_header(shapes, dtype))
                for n in names:
                    name = pieces[n][0]
                    if held is None or held[0] != name:
                        held = (name, read(name).detach())
                    piece = adapter.to_hf_piece(n, held[1], args, pieces)
                    tensor = piece.to(device="cpu", dtype=dtype)
                    _check_finite(n, name, piece, tensor)
                    file.write(tensor.contiguous().view(torch.uint8).numpy().data)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {n: f for names, f in zip(shards, files) for n in names},
            }
            _write_json(staging / INDEX_FILE, index)
        _write_json(staging / CONFIG_FILE, config)
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), staging)
        _write_json(staging / GENERATION_CONFIG_FILE, generation)
        for written in staging.iterdir():
            os.chmod(written, 0o644)


def _check_finite(hf_name: str, name: str, ours: torch.Tensor, written: torch.Tensor) -> None:
    """Refuse to write a NaN or an infinity: transformers would load it and compute NaN logits.
    A value finite in the checkpoint but beyond the export dtype's range is the dtype's fault."""
    if first_non_finite([(hf_name, written)]) is None:
        return
    if first_non_finite([(name, ours)]) is None:
        largest = torch.finfo(written.dtype).max
        raise InteropError(
            f"`{name}` ({hf_name}) holds values beyond {largest:.4g}, the largest {HF_DTYPES[written.dtype]} number; "
            "export with `--dtype bfloat16` or `--dtype float32`."
        )
    raise InteropError(
        f"`{name}` ({hf_name}) holds NaN or infinite values, which the checkpoint should never have published; "
        "export an earlier `step-N`."
    )


def _read_tokenizer(tokenizer: Path) -> Tokenizer:
    if not tokenizer.is_file():
        raise InteropError(
            f"tokenizer {tokenizer} does not exist; pass the run's `model.tokenizer_path` (nothing was written)."
        )
    return load_tokenizer(str(tokenizer))


def _safetensors_header(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    """A safetensors file's length-prefixed JSON header for tensors written in this order, contiguous.

    The JSON is padded with spaces to a multiple of 8 bytes, as safetensors writes it, so the
    data that follows is aligned.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        end = offset + math.prod(shape) * itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _copy_tokenizer(tokenizer: Path, out: Path) -> None:
    """The run's tokenizer as Hugging Face reads it: a ``tokenizer.json`` with the
    ``tokenizer_config.json`` and ``special_tokens_map.json`` beside it, or a SentencePiece model
    as ``tokenizer.model``."""
    if tokenizer.suffix != ".json":
        shutil.copyfile(tokenizer, out / "tokenizer.model")
        return
    shutil.copyfile(tokenizer, out / "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer.parent / name).is_file():
            shutil.copyfile(tokenizer.parent / name, out / name)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def load_hf_folder(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The Hugging Face state dict (CPU tensors, stored dtype) and ``config.json`` of a folder.

    Reads a single ``model.safetensors`` or a sharded folder with its index, as ``from_pretrained``
    does. Holds the whole model: the trainer and the converters read slices through ``HFFolder``.
    """
    folder = HFFolder(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file in folder.files:
        state_dict.update(_read_safetensors(file))
    return state_dict, folder.config


class HFFolder:
    """A Hugging Face folder opened for reading slices: ``config.json`` and, from the safetensors
    headers alone, which file holds each tensor and its shape. ``read`` copies out one box of one
    tensor and touches no other bytes, so a rank's memory follows what it holds, not the model."""

    def __init__(self, path: str | Path):
        self.path = folder = Path(path)
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            raise InteropError(_not_hugging_face(folder))
        self.config = _read_json(config_path)
        self.files = _weight_files(folder)
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in self.files:
            with _open(file) as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is no mapping)
                    self.where[name] = file
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        if (folder / INDEX_FILE).is_file():
            weight_map = _read_json(folder / INDEX_FILE)["weight_map"]
            absent = sorted(set(weight_map) - set(self.where))
            if absent:
                raise InteropError(
                    f"{folder / INDEX_FILE} maps {preview_names(absent)} to shards that do not hold them."
                )

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[box]`` of tensor ``name`` in its stored dtype; the file is mapped only while reading.

        A NaN or an infinity is refused: trained from, it makes every loss NaN from the first step;
        converted, it would sit in a checkpoint the trainer's own saves never publish. Each box is
        checked as it is read, so the check costs one pass over what is read anyway."""
        with _open(self.where[name]) as handle:
            values = handle.get_slice(name)[box]
        if first_non_finite([(name, values)]) is not None:
            raise InteropError(
                f"{self.where[name]}: `{name}` holds NaN or infinite values; the folder's weights are damaged or "
                "were saved from a diverged model: download or save them again."
            )
        return values


def _not_hugging_face(folder: Path) -> str:
    if not folder.exists():
        return f"{folder} does not exist; pass a Hugging Face model folder ({CONFIG_FILE} + safetensors)."
    if folder_kind(folder) == "checkpoint":
        return (
            f"{folder} is a training checkpoint, not a Hugging Face model folder: "
            f"`python scripts/convert_to_hf.py {folder} HF_DIR` makes one of it."
        )
    return f"{folder} has no {CONFIG_FILE}; pass a Hugging Face model folder."


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors``, or the shards its index names."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
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
    files = [folder / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise InteropError(f"{folder / INDEX_FILE} lists {file.name}, which is missing from the folder.")
    return files


def _open(path: Path) -> Any:
    """``safe_open`` on ``path`` (a context manager); a truncated or damaged file is named as such."""
    _safetensors()
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise InteropError(f"{path} is not a readable safetensors file ({err}); re-download or re-save it.") from err


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
