"""The run's training and validation datasets, as the config names them, and how they are described
to the user (at start, by ``--dry-run`` and by ``scripts/show_batch.py``).

Inputs that cannot be what the user meant are refused or warned about here, where every path is
known: a file named twice in ``training.dataset_path`` (it would silently get twice its share),
data too small for one global batch (every batch would repeat samples), and a validation set
that is part of the training set (its loss would measure memorisation)."""

from __future__ import annotations

import logging
from pathlib import Path

from trainer.config import JobConfig, resolve_path
from trainer.data.mixture import Member, MixtureDataset
from trainer.data.prepared import PreparedDataset, is_prepared
from trainer.data.samples import SampleDataset, open_dataset
from trainer.data.shards import MANIFEST, read_manifest, sha256_file
from trainer.data.sources import local_files
from trainer.data.tokenizer import Tokenizer
from trainer.runtime.errors import DataError

logger = logging.getLogger("meshtrain")

TokenDataset = SampleDataset | PreparedDataset | MixtureDataset
"""What a run trains or validates on: ``(input_ids, labels)`` samples of ``seq_len`` tokens."""


def validates(config: JobConfig) -> bool:
    """Whether the run validates: ``validation.enable``, and data to validate on. The bundled
    held-out plays only suit training on the bundled plays; training on one's own data without
    ``validation.dataset_path`` trains without validation (and says so at start)."""
    validation = config.validation
    return validation.enable and bool(validation.dataset_path or not config.training.dataset_path)


def validation_seq_len(config: JobConfig) -> int:
    seq_len = config.validation.seq_len
    return config.training.seq_len if seq_len == -1 else seq_len


def load_dataset(config: JobConfig, tokenizer: Tokenizer, global_batch_size: int) -> TokenDataset:
    """The samples of ``training.dataset``: from the bundled plays, one path, or the mixture of
    several (``training.dataset_path``, ``training.dataset_weights``), at least one global batch
    of the whole job (each of ``fault_tolerance.group_count`` replica groups reads its own)."""
    training = config.training
    paths = [resolve_path(path) for path in training.dataset_path]
    _check_named_once(paths)
    if len(paths) <= 1:
        dataset: TokenDataset = open_dataset(training.dataset, paths[0] if paths else None, tokenizer, training.seq_len)
    else:
        members = [open_dataset(training.dataset, path, tokenizer, training.seq_len) for path in paths]
        names = [Path(path).name for path in paths]
        if len(set(names)) < len(names):
            names = list(training.dataset_path)
        dataset = MixtureDataset(members, names, training.dataset_weights or [1.0] * len(paths))
    ft = config.fault_tolerance
    groups = ft.group_count if ft.enable else 1
    if len(dataset) < groups * global_batch_size:
        where = f"`training.dataset_path` = {', '.join(training.dataset_path)}" if paths else "the bundled plays"
        of_groups = f" ({groups} replica groups of {global_batch_size})" if groups > 1 else ""
        raise DataError(
            f"{where} gives {len(dataset):,} samples of `training.seq_len` = {training.seq_len} tokens, fewer than "
            f"one global batch of {groups * global_batch_size}{of_groups}, so every batch would repeat samples; add "
            "data, or lower `training.global_batch_size` (or `training.local_batch_size`), `training.seq_len`"
            f"{' or `fault_tolerance.group_count`' if groups > 1 else ''}."
        )
    return dataset


def load_validation_dataset(config: JobConfig, tokenizer: Tokenizer) -> TokenDataset | None:
    """The validation samples (``[validation]``), or None when the run does not validate."""
    validation, training = config.validation, config.training
    if not validates(config):
        return None
    path = resolve_path(validation.dataset_path) if validation.dataset_path else None
    if path:
        _warn_overlap(path, [resolve_path(p) for p in training.dataset_path])
    return open_dataset(
        validation.dataset or training.dataset, path, tokenizer, validation_seq_len(config), split="validation"
    )


def _contents(path: str, key: str) -> dict[Path, Path]:
    """The files (a prepared folder: its manifest) ``path`` reads, by real path."""
    if is_prepared(path):
        return {(Path(path) / MANIFEST).resolve(): Path(path) / MANIFEST}
    return {file.resolve(): file for file in local_files(path, key)}


def _check_named_once(paths: list[str]) -> None:
    seen: dict[Path, str] = {}
    for path in paths:
        for real, file in _contents(path, "`training.dataset_path`").items():
            if real in seen:
                raise DataError(
                    f"`training.dataset_path` names {str(file)!r} twice (through {seen[real]!r} and {path!r}), which "
                    "would give it two shares of every batch; name it once (weigh it with `training.dataset_weights`)."
                )
            seen[real] = path


def _fingerprint(file: Path) -> tuple[int, str]:
    return file.stat().st_size, sha256_file(file)


def _with_sources(path: str, key: str) -> dict[Path, Path]:
    """:func:`_contents`, and for a prepared folder the raw files it was made from (its manifest
    names them) where they still exist: a folder prepared from the training files is training data."""
    files = _contents(path, key)
    if is_prepared(path):
        for source in read_manifest(Path(path)).get("sources", []):
            file = Path(source["path"])
            if file.is_file():
                files[file.resolve()] = file
    return files


def _warn_overlap(path: str, training_paths: list[str]) -> None:
    """Warn, loudly and naming the file, when validation data is training data: the same file, a
    file with identical bytes (a copy), or a prepared folder made from it."""
    held_out = _with_sources(path, "`validation.dataset_path`")
    trained = {real: file for p in training_paths for real, file in _with_sources(p, "`training.dataset_path`").items()}
    sizes = {file.stat().st_size for file in held_out.values()}  # only files of equal size are hashed
    copies = {_fingerprint(file): file for file in trained.values() if file.stat().st_size in sizes}
    trained_sizes = {size for size, _ in copies}
    overlap = []
    for real, file in held_out.items():
        if real in trained:
            overlap.append(f"{file} (the same file)")
        elif file.stat().st_size in trained_sizes and (copy := copies.get(_fingerprint(file))) is not None:
            overlap.append(f"{file} (identical to {copy})")
    if overlap:
        logger.warning(
            "`validation.dataset_path` = %r overlaps the training data: %s%s. Validation on training data measures "
            "memorisation, not generalisation: point `validation.dataset_path` at held-out data.",
            path,
            ", ".join(overlap[:3]),
            f" and {len(overlap) - 3} more" if len(overlap) > 3 else "",
        )


def describe_data(config: JobConfig, global_batch_size: int, dataset: TokenDataset, validation: bool = False) -> str:
    """What the run trains (or validates) on, in a line or two."""
    training = config.training
    kind = (config.validation.dataset or training.dataset) if validation else training.dataset
    paths = (
        ([config.validation.dataset_path] if config.validation.dataset_path else [])
        if validation
        else list(training.dataset_path)
    )
    source = f"{kind} from {', '.join(paths)}" if paths else f"{kind}, bundled"
    seq_len = validation_seq_len(config) if validation else training.seq_len
    text = f"{len(dataset):,} samples of {seq_len} tokens ({source})"
    members: list[Member]
    if isinstance(dataset, MixtureDataset):
        text += "; mixture over the run: " + dataset.describe_shares(
            training.steps, global_batch_size, config.debug.seed
        )
        members = dataset.members
    else:
        members = [dataset]
    stats = [m.chat_stats for m in members if isinstance(m, SampleDataset) and m.chat_stats]
    return "; ".join([text] + [s.describe(seq_len) for s in stats])


def data_lines(
    config: JobConfig, global_batch_size: int, dataset: TokenDataset, validation_dataset: TokenDataset | None
) -> str:
    """What the run trains and validates on."""
    lines = [f"data: {describe_data(config, global_batch_size, dataset)}"]
    if validation_dataset is not None:
        lines.append(
            f"validation every {config.validation.freq} steps and at the end: "
            f"{describe_data(config, global_batch_size, validation_dataset, validation=True)}"
        )
    elif config.validation.enable:
        lines.append(
            "no validation: `validation.enable` is set but `validation.dataset_path` is empty, and the "
            "bundled held-out plays are no validation set for `training.dataset_path`; point "
            "`validation.dataset_path` at held-out data of yours to validate."
        )
    return "\n".join(lines)
