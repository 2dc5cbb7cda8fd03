"""The checkpoint folder: what ``step-N`` holds, when it is whole, and model-only reads and writes.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) folder ``step-N`` whose ``"model"`` entry
holds the model's parameters by name (stored as ``model.<name>``), beside ``model_args.json``, the
``ModelArgs`` of the run, for converters that have no config. It is written as ``step-N.partial``
and published by one rename, so a folder named ``step-N`` is never half-written.

``read_dcp_model`` and ``write_dcp_model`` handle the model entry alone, in one process and
without a process group, for the converters; the trainer loads what they write as its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint.disk import staged_output, user_entries
from trainer.checkpoint.integrity import (
    CHECKSUMMED,
    MANIFEST_FILE,
    METADATA_FILE,
    ChecksummingWriter,
    add_to_manifest,
    checksum_problem,
)
from trainer.config import Checkpoint
from trainer.model.hf_architectures import adapter_for_args
from trainer.model.hf_llama3 import CONFIG_FILE, InteropError, preview_names
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer
from trainer.model.moe import FLAVORS as MOE_FLAVORS
from trainer.model.moe import MoEArgs
from trainer.runtime.errors import ConfigError

PARTIAL_SUFFIX = ".partial"
STEP_FOLDER = re.compile(r"^step-(\d+)$")

MODEL_ARGS_FILE = "model_args.json"
"""Written beside every checkpoint: the ``ModelArgs`` of the run, as JSON."""

DATA_FILE = "data.json"
"""Written beside every training checkpoint: fingerprints of the data and the tokenizer it was
trained on, so that a resume on other data is noticed. Outside DCP's state on purpose: a new key
in the DCP state would make every older checkpoint unloadable."""

SCHEDULE_FILE = "schedule.json"
"""Written beside every training checkpoint: the settings of the LR schedule it was trained with
(``LRSchedule.settings``), so that a resume says what another schedule changes."""

MODEL_KEY = "model"
"""The checkpoint state dict's entry holding the model; DCP stores its tensors as ``model.<name>``."""


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """Completed (renamed) checkpoint folders, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return sorted(found)


def remove_partial_folders(folder: Path) -> list[Path]:
    """Delete the ``step-N.partial`` folders of saves that never finished; return them.

    Only safe while no other job writes into ``folder``: the caller holds the dump-folder lock.
    """
    if not folder.is_dir():
        return []
    partials = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX))
    for partial in partials:
        shutil.rmtree(partial, ignore_errors=True)
    return partials


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be loaded, or None when it looks whole.

    Reads DCP's metadata (written last) and checks that every file it points into exists and
    is at least as long as the bytes it should hold: a truncated or partly copied checkpoint
    fails here, before any rank starts loading it.
    """
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing or corrupt .metadata raises whatever its reader raises
        return f"its metadata ({METADATA_FILE}) cannot be read ({type(e).__name__}: {e})"
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and CHECKSUMMED in storage_meta.modules and not (path / MANIFEST_FILE).is_file():
        return f"its {MANIFEST_FILE} is missing, though its {METADATA_FILE} records that one was written"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            return f"its data file {relative} is missing"
        if file.stat().st_size < size:
            return f"its data file {relative} is truncated ({file.stat().st_size} of {size} bytes)"
    return None


def is_model_only(path: Path) -> bool:
    """A seed checkpoint, an export or a converted Hugging Face model: weights and nothing else."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return all(key.startswith(MODEL_KEY + ".") for key in keys)


def publish(
    partial: Path,
    final: Path,
    model_args: ModelArgs,
    data_identity: dict[str, str] | None = None,
    schedule: dict[str, Any] | None = None,
) -> None:
    """Add the model's shape (for converters), the data's fingerprints and the LR schedule's
    settings (all checksummed), then rename: the checkpoint appears whole or not at all."""
    write_model_args(partial, model_args)
    written = [MODEL_ARGS_FILE]
    for name, content in ((DATA_FILE, data_identity), (SCHEDULE_FILE, schedule)):
        if content:
            (partial / name).write_text(json.dumps(content))
            written.append(name)
    add_to_manifest(partial, written)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def read_data_identity(folder: Path) -> dict[str, str] | None:
    """The fingerprints of the data a checkpoint was trained on; None when not recorded."""
    return _read_json(folder / DATA_FILE)


def read_schedule(folder: Path) -> dict[str, Any] | None:
    """The LR schedule's settings a checkpoint was trained with; None when not recorded."""
    return _read_json(folder / SCHEDULE_FILE)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_model_args(folder: Path, model_args: ModelArgs) -> None:
    """Record the model's shape beside a checkpoint, for converters that have no config."""
    (folder / MODEL_ARGS_FILE).write_text(json.dumps(dataclasses.asdict(model_args)))


def read_model_args(checkpoint_dir: str | Path) -> ModelArgs:
    """The ``ModelArgs`` a checkpoint was trained with, from its ``model_args.json``.

    Fields the file lacks take their defaults (files from before a field existed); fields
    ``ModelArgs`` does not know are an error, as they would describe another model. A
    Mixture-of-Experts model's file names its experts (``n_experts``) and reads as ``MoEArgs``.
    A folder that is no checkpoint at all is named for what it is.
    """
    path = Path(checkpoint_dir) / MODEL_ARGS_FILE
    if not path.is_file():
        kind = folder_kind(Path(checkpoint_dir))
        if kind == "hugging_face":
            raise InteropError(
                f"{checkpoint_dir} is already a Hugging Face model folder (it has {CONFIG_FILE}); to make a "
                f"training checkpoint of it run `python scripts/convert_from_hf.py {checkpoint_dir} CHECKPOINT_DIR`, "
                "or train from it with `--checkpoint.initial_load_path` and `--checkpoint.initial_load_in_hf`."
            )
        if kind != "checkpoint":
            raise _not_a_checkpoint(Path(checkpoint_dir))
        raise InteropError(
            f"{path} does not exist; the trainer writes it beside every checkpoint. For another "
            f"checkpoint, write json.dumps(dataclasses.asdict(model_args)) of its ModelArgs there."
        )
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"{path} is not valid JSON: {err}") from err
    args_type: type[ModelArgs] = MoEArgs if "n_experts" in values else ModelArgs
    known = {f.name for f in dataclasses.fields(args_type)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InteropError(f"{path}: unknown {args_type.__name__} fields {unknown}; known fields: {sorted(known)}.")
    return args_type(**values)


PARAMETER_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden_dim")
"""The ``ModelArgs`` that decide the parameters' names and shapes, and how heads divide them."""


EXPERT_FIELDS = ("n_experts", "top_k", "moe_hidden_dim", "n_shared_experts", "n_dense_layers")
"""The ``MoEArgs`` that decide the experts' shapes and which blocks route (``top_k`` changes no
shape, but a model routing to other numbers of experts is another model)."""


def checkpoint_model_differences(theirs: ModelArgs, ours: ModelArgs) -> list[str]:
    """What makes a checkpoint's model another than this run's: the parameter fields, whether it
    is a Mixture-of-Experts, and between two MoEs the expert fields."""
    differ = model_differences(theirs, ours, PARAMETER_FIELDS)
    kinds = ["moe" if isinstance(args, MoEArgs) else "llama3" for args in (theirs, ours)]
    if kinds[0] != kinds[1]:
        return [*differ, f"model.name: {kinds[0]} there, {kinds[1]} here"]
    return differ + (model_differences(theirs, ours, EXPERT_FIELDS) if kinds[0] == "moe" else [])


def model_keys(args: ModelArgs) -> str:
    """The ``model`` keys that build ``args`` (a checkpoint's): its name, the flavor of that
    shape if one is, and its blocks where they are not the flavor's."""
    moe = isinstance(args, MoEArgs)
    name, flavors = ("moe", MOE_FLAVORS) if moe else ("llama3", FLAVORS)
    fields = [f for f in PARAMETER_FIELDS + (EXPERT_FIELDS if moe else ()) if f not in ("n_layers", "vocab_size")]
    flavor = next(
        (key for key, shape in flavors.items() if all(getattr(shape, f) == getattr(args, f) for f in fields)), None
    )
    if flavor is None:
        return f'`model.name` = "{name}" with no flavor of its shape (a converted or hand-made checkpoint)'
    layers = f", `model.n_layers` = {args.n_layers}" if args.n_layers != flavors[flavor].n_layers else ""
    return f'`model.name` = "{name}", `model.flavor` = "{flavor}"{layers}'


def model_differences(theirs: ModelArgs, ours: ModelArgs, fields: tuple[str, ...]) -> list[str]:
    """``fields`` that differ, each as ``"name: theirs there, ours here"``."""
    return [
        f"{f}: {getattr(theirs, f)} there, {getattr(ours, f)} here"
        for f in fields
        if getattr(theirs, f) != getattr(ours, f)
    ]


FolderKind = Literal["missing", "file", "checkpoint", "hugging_face", "other"]


def folder_kind(path: Path) -> FolderKind:
    """What a path given as a checkpoint is: missing, a file, a DCP checkpoint (it has
    ``.metadata``), a Hugging Face model folder (``config.json`` and no ``.metadata``), or another
    folder (a dump folder or its ``checkpoint`` folder among them: :func:`steps_inside`)."""
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "file"
    if (path / METADATA_FILE).is_file():
        return "checkpoint"
    return "hugging_face" if (path / CONFIG_FILE).is_file() else "other"


def steps_inside(folder: Path) -> list[str]:
    """The ``step-N`` folders in ``folder`` or one level down (a dump folder's ``checkpoint/``),
    relative to it: what the user most likely meant to pass."""
    if not folder.is_dir():
        return []
    found = [*folder.glob("step-*"), *folder.glob("*/step-*")]
    return sorted(str(p.relative_to(folder)) for p in found if p.is_dir() and STEP_FOLDER.match(p.name))


def check_initial_load_kind(config: Checkpoint) -> None:
    """Refuse, before launch, a ``checkpoint.initial_load_path`` that cannot be what
    ``checkpoint.initial_load_in_hf`` says it is; the job would start and fail at its load."""
    if not config.initial_load_path:
        return
    path, key = Path(config.initial_load_path), f"`checkpoint.initial_load_path` = {config.initial_load_path}"
    kind, steps = folder_kind(path), steps_inside(path)
    hf = config.initial_load_in_hf
    if kind == "missing":
        raise ConfigError(
            f"{key} does not exist; point it at a checkpoint's `step-N` folder (or a Hugging Face model folder "
            "with `--checkpoint.initial_load_in_hf`), or unset it."
        )
    if kind == "hugging_face" and not hf:
        raise ConfigError(f"{key} is a Hugging Face model folder: add `--checkpoint.initial_load_in_hf` to load it.")
    if kind == "checkpoint" and hf:
        raise ConfigError(
            f"{key} is a training checkpoint (DCP), not a Hugging Face folder: drop `checkpoint.initial_load_in_hf`."
        )
    if kind in ("file", "other"):
        what = (
            f"holds {preview_names(steps)}: point it at one of those"
            if steps
            else ("is a file" if kind == "file" else f"holds neither a checkpoint nor a Hugging Face {CONFIG_FILE}")
        )
        wanted = (
            f"a Hugging Face model folder ({CONFIG_FILE} + safetensors)" if hf else "a checkpoint's `step-N` folder"
        )
        raise ConfigError(f"{key} {what}; it must be {wanted}.")


def _not_a_checkpoint(folder: Path) -> InteropError:
    if not folder.exists():
        return InteropError(f"{folder} does not exist; pass a `{{dump_folder}}/checkpoint/step-N` folder.")
    steps = steps_inside(folder)
    hint = f" It holds {preview_names(steps)}: pass one of those folders." if steps else ""
    return InteropError(
        f"{folder} is not a torch.distributed.checkpoint folder (no checkpoint metadata); pass a "
        f"`{{dump_folder}}/checkpoint/step-N` folder.{hint}"
    )


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's warning, on every ``no_dist`` call, that it assumes a single process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_dcp_model(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full model tensors (our names, CPU, stored dtype) of a training checkpoint.

    One process and no process group: DCP records every tensor's global shape, so full tensors
    are allocated from the metadata and loaded with ``no_dist=True``, whatever mesh saved them.
    Only ``model.`` entries are read; optimizer, scheduler and dataloader state is skipped. The
    checkpoint's files are verified first, as a resume verifies them.
    """
    folder = Path(checkpoint_dir)
    model = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in _model_entries(folder).items()
    }
    verify(folder)
    with _quiet_no_dist():
        dcp.load({MODEL_KEY: model}, checkpoint_id=str(folder), no_dist=True)
    return model


def dcp_model_reader(checkpoint_dir: str | Path) -> Callable[[str], torch.Tensor]:
    """``read(name)``: one full model tensor of a training checkpoint, read alone (``read_dcp_model``
    one entry at a time), so that an export holds one tensor, not the model. The files are
    verified at the first read, after the export's own quick checks."""
    folder = Path(checkpoint_dir)
    entries = _model_entries(folder)
    verified = functools.cache(lambda: verify(folder))

    def read(name: str) -> torch.Tensor:
        verified()
        tensor = torch.empty(entries[name].size, dtype=entries[name].properties.dtype)
        with _quiet_no_dist():
            dcp.load({MODEL_KEY: {name: tensor}}, checkpoint_id=str(folder), no_dist=True)
        return tensor

    return read


def check_model_entries(checkpoint_dir: str | Path, args: ModelArgs) -> None:
    """Refuse, from the metadata alone, a checkpoint whose parameters are not those of ``args``
    (its ``model_args.json`` edited, or copied beside another model's files): an export would
    fail inside DCP's load with a traceback, or write weights its config.json does not describe."""
    folder = Path(checkpoint_dir)
    entries = _model_entries(folder)
    with torch.device("meta"):
        model = Transformer(args)
    buffers = set(model.state_dict()) - {name for name, _ in model.named_parameters()}
    params = {name: torch.empty(e.size, device="meta") for name, e in entries.items() if name not in buffers}
    try:
        adapter_for_args(args).check_state_dict(params, args)
    except InteropError as err:
        raise InteropError(f"{folder}: its tensors do not match its {MODEL_ARGS_FILE}: {err}") from None


def verify(folder: Path) -> None:
    """Refuse a checkpoint whose files are incomplete or no longer match their checksums, as a
    resume refuses it: converted, its flipped bytes would become weights (an embedding of 3.4e38)."""
    problem = checkpoint_problem(folder) or checksum_problem(folder)
    if problem:
        raise InteropError(
            f"{folder} cannot be read: {problem}. Convert another checkpoint (an older `step-N`), or "
            "copy this one again from where it was written."
        )


def _model_entries(folder: Path) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors by our name, from its metadata."""
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except (FileNotFoundError, NotADirectoryError) as err:
        raise _not_a_checkpoint(folder) from err
    prefix = MODEL_KEY + "."
    model: dict[str, TensorStorageMetadata] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise InteropError(
                f"{folder}: checkpoint entry `{key}` is not a tensor; the model entry must hold only tensors."
            )
        model[key.removeprefix(prefix)] = entry
    if not model:
        tops = sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
        raise InteropError(f"{folder}: the checkpoint has no `{MODEL_KEY}` entry (top-level entries: {tops}).")
    return model


def write_dcp_model(checkpoint_dir: str | Path, state_dict_ours: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Write a model-only training checkpoint (``{"model": sd}``) and its ``model_args.json``,
    checksummed as the trainer's own.

    The trainer loads it as it loads its own checkpoints; it has no optimizer or dataloader
    state, so training from it starts those afresh. An existing non-empty folder is refused
    rather than mixed with another checkpoint's files; the files appear in it only once all are
    written (``staged_output``), so a full disk leaves nothing that blocks the rerun.
    """
    folder = Path(checkpoint_dir)
    adapter_for_args(args).check_state_dict(state_dict_ours, args)
    if folder.is_dir() and user_entries(folder):
        raise InteropError(f"{folder} is not empty; write the checkpoint into a new or empty folder.")
    model = {name: t.detach() for name, t in state_dict_ours.items()}
    needs = sum(t.numel() * t.element_size() for t in model.values())
    with staged_output(folder, "write the checkpoint", needs) as staging, _quiet_no_dist():
        dcp.save({MODEL_KEY: model}, storage_writer=ChecksummingWriter(str(staging)), no_dist=True)
        write_model_args(staging, args)
        add_to_manifest(staging, [MODEL_ARGS_FILE])
