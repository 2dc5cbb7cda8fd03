"""The checkpoint folder: what ``step-N`` holds, when it is whole, and which model it was trained as.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) folder ``step-N`` whose ``"model"`` entry
holds the model's parameters by name (stored as ``model.<name>``), beside ``model_args.json``, the
``ModelArgs`` of the run, for converters that have no config. It is written as ``step-N.partial``
and published by one rename, so a folder named ``step-N`` is never half-written; in an object
store, which cannot rename, it is written as ``step-N`` and published by a marker written last
(``location.py``). Every function here takes either kind of folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Literal

from trainer.checkpoint.integrity import (
    CHECKSUMMED,
    MANIFEST_FILE,
    METADATA_FILE,
    add_to_manifest,
)
from trainer.checkpoint.location import (
    PUBLISHED_FILE,
    Location,
    dcp_reader,
    display,
    fresh,
    is_published,
    is_remote,
    location,
    mark_published,
    remove_tree,
)
from trainer.config import Checkpoint
from trainer.model.deepseek_v3 import DeepSeekV3Args
from trainer.model.families import FAMILIES, family_of
from trainer.model.hf_llama3 import CONFIG_FILE, InteropError, preview_names
from trainer.model.llama3 import ModelArgs
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


def step_folders(folder: Location) -> list[tuple[int, Location]]:
    """Published checkpoint folders, oldest first."""
    if not fresh(folder).is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := STEP_FOLDER.match(p.name)) and p.is_dir() and is_published(p)
    ]
    return sorted(found, key=lambda found: found[0])


def partial_path(final: Location) -> Location:
    """Where the save of ``final`` (a ``step-N``) is written until it is published."""
    return final if is_remote(final) else final.with_name(final.name + PARTIAL_SUFFIX)


def remove_partial_folders(folder: Location) -> list[Location]:
    """Delete the folders of saves that never finished (``step-N.partial``; in an object store,
    a ``step-N`` without its marker); return them.

    Only safe while no other job writes into ``folder``: the caller holds the dump-folder lock.
    """
    if not fresh(folder).is_dir():
        return []
    partials = sorted(
        (
            p
            for p in folder.iterdir()
            if p.is_dir() and (p.name.endswith(PARTIAL_SUFFIX) or (STEP_FOLDER.match(p.name) and not is_published(p)))
        ),
        key=lambda p: p.name,
    )
    for partial in partials:
        remove_tree(partial)
    return partials


def checkpoint_problem(path: Location) -> str | None:
    """Why ``path`` cannot be loaded, or None when it looks whole.

    Reads DCP's metadata (written last) and checks that every file it points into exists and
    is at least as long as the bytes it should hold: a truncated or partly copied checkpoint
    fails here, before any rank starts loading it. An object store's folder must be published.
    """
    if not is_published(fresh(path)):
        return f"it was never published (no {PUBLISHED_FILE} marker: its save did not finish)"
    try:
        metadata = dcp_reader(path).read_metadata()
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


def is_model_only(path: Location) -> bool:
    """A seed checkpoint, an export or a converted Hugging Face model: weights and nothing else."""
    keys = dcp_reader(path).read_metadata().state_dict_metadata
    return all(key.startswith(MODEL_KEY + ".") for key in keys)


def publish(
    partial: Location,
    final: Location,
    model_args: ModelArgs,
    data_identity: dict[str, str] | None = None,
    schedule: dict[str, Any] | None = None,
) -> None:
    """Add the model's shape (for converters), the data's fingerprints and the LR schedule's
    settings (all checksummed), then rename (or mark it published, in an object store): the
    checkpoint appears whole or not at all."""
    write_model_args(partial, model_args)
    written = [MODEL_ARGS_FILE]
    for name, content in ((DATA_FILE, data_identity), (SCHEDULE_FILE, schedule)):
        if content:
            (partial / name).write_text(json.dumps(content))
            written.append(name)
    add_to_manifest(partial, written)
    if is_remote(final):
        mark_published(final, int(final.name.removeprefix("step-")))
        return
    if final.exists():
        remove_tree(final)
    os.replace(str(partial), final)


def read_data_identity(folder: Location) -> dict[str, str] | None:
    """The fingerprints of the data a checkpoint was trained on; None when not recorded."""
    return _read_json(folder / DATA_FILE)


def read_schedule(folder: Location) -> dict[str, Any] | None:
    """The LR schedule's settings a checkpoint was trained with; None when not recorded."""
    return _read_json(folder / SCHEDULE_FILE)


def _read_json(path: Location) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_model_args(folder: Location, model_args: ModelArgs) -> None:
    """Record the model's shape beside a checkpoint, for converters that have no config."""
    (folder / MODEL_ARGS_FILE).write_text(json.dumps(dataclasses.asdict(model_args)))


def read_model_args(checkpoint_dir: str | Location) -> ModelArgs:
    """The ``ModelArgs`` a checkpoint was trained with, from its ``model_args.json``.

    Fields the file lacks take their defaults (files from before a field existed); fields
    ``ModelArgs`` does not know are an error, as they would describe another model. A
    Mixture-of-Experts model's file names its experts (``n_experts``) and reads as ``MoEArgs``,
    a DeepSeek-V3's its latents too (``kv_lora_rank``) and reads as ``DeepSeekV3Args``. A folder
    that is no checkpoint at all is named for what it is.
    """
    folder = location(checkpoint_dir)
    path = folder / MODEL_ARGS_FILE
    if not path.is_file():
        kind = folder_kind(folder)
        if kind == "hugging_face":
            raise InteropError(
                f"{checkpoint_dir} is already a Hugging Face model folder (it has {CONFIG_FILE}); to make a "
                f"training checkpoint of it run `python scripts/convert_from_hf.py {checkpoint_dir} CHECKPOINT_DIR`, "
                "or train from it with `--checkpoint.initial_load_path` and `--checkpoint.initial_load_in_hf`."
            )
        if kind != "checkpoint":
            raise not_a_checkpoint(folder)
        raise InteropError(
            f"{path} does not exist; the trainer writes it beside every checkpoint. For another "
            f"checkpoint, write json.dumps(dataclasses.asdict(model_args)) of its ModelArgs there."
        )
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InteropError(f"{path} is not valid JSON: {err}") from err
    args_type: type[ModelArgs] = (
        DeepSeekV3Args if "kv_lora_rank" in values else MoEArgs if "n_experts" in values else ModelArgs
    )
    known = {f.name for f in dataclasses.fields(args_type)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InteropError(f"{path}: unknown {args_type.__name__} fields {unknown}; known fields: {sorted(known)}.")
    return args_type(**values)


PARAMETER_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "head_dim",
    "vocab_size",
    "ffn_hidden_dim",
    "tie_embeddings",
)
"""The ``ModelArgs`` that decide the parameters' names and shapes, and how heads divide them."""


EXPERT_FIELDS = ("n_experts", "top_k", "moe_hidden_dim", "n_shared_experts", "n_dense_layers")
"""The ``MoEArgs`` that decide the experts' shapes and which blocks route (``top_k`` changes no
shape, but a model routing to other numbers of experts is another model)."""

LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The ``DeepSeekV3Args`` that decide the latent attention's shapes."""


def family_fields(args: ModelArgs) -> tuple[str, ...]:
    """The fields beyond ``PARAMETER_FIELDS`` that decide the shapes of ``args``'s family."""
    if isinstance(args, DeepSeekV3Args):
        return EXPERT_FIELDS + LATENT_FIELDS
    return EXPERT_FIELDS if isinstance(args, MoEArgs) else ()


def checkpoint_model_differences(theirs: ModelArgs, ours: ModelArgs) -> list[str]:
    """What makes a checkpoint's model another than this run's: the parameter fields, whether it
    is a Mixture-of-Experts, and between two MoEs the expert fields."""
    differ = model_differences(theirs, ours, PARAMETER_FIELDS)
    kinds = [family_of(args) for args in (theirs, ours)]
    if kinds[0] != kinds[1]:
        return [*differ, f"model.name: {kinds[0]} there, {kinds[1]} here"]
    return differ + model_differences(theirs, ours, family_fields(ours))


def model_keys(args: ModelArgs) -> str:
    """The ``model`` keys that build ``args`` (a checkpoint's): its name, the flavor of that
    shape if one is, and its blocks where they are not the flavor's."""
    name = family_of(args)
    flavors = FAMILIES[name]
    fields = [f for f in PARAMETER_FIELDS + family_fields(args) if f not in ("n_layers", "vocab_size")]
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


def folder_kind(path: Location) -> FolderKind:
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


def steps_inside(folder: Location) -> list[str]:
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
    path = location(config.initial_load_path)
    key = f"`checkpoint.initial_load_path` = {display(path)}"
    hf = config.initial_load_in_hf
    if hf and is_remote(path):
        raise ConfigError(
            f"{key} is in an object store: Hugging Face folders are read from a local disk. Copy it first "
            "(`aws s3 cp --recursive`, `gcloud storage cp -r`, ...) and give the local folder."
        )
    kind, steps = folder_kind(path), steps_inside(path)
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


def not_a_checkpoint(folder: Location) -> InteropError:
    if not folder.exists():
        return InteropError(f"{folder} does not exist; pass a `{{dump_folder}}/checkpoint/step-N` folder.")
    steps = steps_inside(folder)
    hint = f" It holds {preview_names(steps)}: pass one of those folders." if steps else ""
    return InteropError(
        f"{folder} is not a torch.distributed.checkpoint folder (no checkpoint metadata); pass a "
        f"`{{dump_folder}}/checkpoint/step-N` folder.{hint}"
    )
