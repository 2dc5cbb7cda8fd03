"""A checkpoint's model entry alone, for the converters: read and written in one process, with no
process group, whatever mesh saved it. The trainer loads what :func:`write_dcp_model` writes as
its own checkpoints; :func:`read_dcp_model` and :func:`dcp_model_reader` verify the files first,
as a resume does, and read a local folder or an object store's alike.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint.disk import staged_output, user_entries
from trainer.checkpoint.folders import (
    MODEL_ARGS_FILE,
    MODEL_KEY,
    checkpoint_problem,
    not_a_checkpoint,
    write_model_args,
)
from trainer.checkpoint.integrity import ChecksummingWriter, add_to_manifest, checksum_problem
from trainer.checkpoint.location import Location, dcp_reader, location
from trainer.checkpoint.states import tied_names
from trainer.model.hf_architectures import adapter_for_args
from trainer.model.hf_llama3 import InteropError
from trainer.model.llama3 import ModelArgs, Transformer


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's warning, on every ``no_dist`` call, that it assumes a single process: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_dcp_model(checkpoint_dir: str | Location) -> dict[str, torch.Tensor]:
    """The full model tensors (our names, CPU, stored dtype) of a training checkpoint.

    One process and no process group: DCP records every tensor's global shape, so full tensors
    are allocated from the metadata and loaded with ``no_dist=True``, whatever mesh saved them.
    Only ``model.`` entries are read; optimizer, scheduler and dataloader state is skipped. The
    checkpoint's files are verified first, as a resume verifies them.
    """
    folder = location(checkpoint_dir)
    model = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in _model_entries(folder).items()
    }
    verify(folder)
    with _quiet_no_dist():
        dcp.load({MODEL_KEY: model}, storage_reader=dcp_reader(folder), no_dist=True)
    return model


def load_dcp_model(model: Transformer, checkpoint_dir: str | Location) -> None:
    """Load a training checkpoint's model entry into ``model`` (whole, one process): a tied
    matrix, saved once, is given to both its names."""
    state = read_dcp_model(checkpoint_dir)
    model.load_state_dict({**state, **{alias: state[name] for alias, name in tied_names(model).items()}})


def dcp_model_reader(checkpoint_dir: str | Location) -> Callable[[str], torch.Tensor]:
    """``read(name)``: one full model tensor of a training checkpoint, read alone (``read_dcp_model``
    one entry at a time), so that an export holds one tensor, not the model. The files are
    verified at the first read, after the export's own quick checks."""
    folder = location(checkpoint_dir)
    entries = _model_entries(folder)
    verified = functools.cache(lambda: verify(folder))

    def read(name: str) -> torch.Tensor:
        verified()
        tensor = torch.empty(entries[name].size, dtype=entries[name].properties.dtype)
        with _quiet_no_dist():
            dcp.load({MODEL_KEY: {name: tensor}}, storage_reader=dcp_reader(folder), no_dist=True)
        return tensor

    return read


def check_model_entries(checkpoint_dir: str | Location, args: ModelArgs) -> None:
    """Refuse, from the metadata alone, a checkpoint whose parameters are not those of ``args``
    (its ``model_args.json`` edited, or copied beside another model's files): an export would
    fail inside DCP's load with a traceback, or write weights its config.json does not describe."""
    folder = location(checkpoint_dir)
    entries = _model_entries(folder)
    with torch.device("meta"):
        model = Transformer(args)
    # Buffers, and a tied output's second name for the embedding, are saved but are no parameter;
    # the buffers the format holds (DeepSeek-V3's routing biases) are exported with the weights.
    adapter = adapter_for_args(args)
    not_params = set(model.state_dict()) - {name for name, _ in model.named_parameters()} - set(adapter.hf_layout(args))
    params = {name: torch.empty(e.size, device="meta") for name, e in entries.items() if name not in not_params}
    try:
        adapter.check_state_dict(params, args)
    except InteropError as err:
        raise InteropError(f"{folder}: its tensors do not match its {MODEL_ARGS_FILE}: {err}") from None


def verify(folder: Location) -> None:
    """Refuse a checkpoint whose files are incomplete or no longer match their checksums, as a
    resume refuses it: converted, its flipped bytes would become weights (an embedding of 3.4e38)."""
    problem = checkpoint_problem(folder) or checksum_problem(folder)
    if problem:
        raise InteropError(
            f"{folder} cannot be read: {problem}. Convert another checkpoint (an older `step-N`), or "
            "copy this one again from where it was written."
        )


def _model_entries(folder: Location) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors by our name, from its metadata."""
    try:
        metadata = dcp_reader(folder).read_metadata()
    except (FileNotFoundError, NotADirectoryError) as err:
        raise not_a_checkpoint(folder) from err
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
