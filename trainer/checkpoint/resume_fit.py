"""Whether a checkpoint serves this run, from what lies beside it (``model_args.json``,
``data.json``, ``schedule.json``) without loading it: the model first (another model is never a
matter of its data), then the data, then what another LR schedule changes. The resume asks on
rank 0 for every rank; ``--dry-run`` asks before any process exists, of the checkpoint the run
would resume (:func:`resume_preview`)."""

from __future__ import annotations

from typing import Any

from trainer.checkpoint.folders import (
    MODEL_ARGS_FILE,
    checkpoint_model_differences,
    checkpoint_problem,
    is_model_only,
    model_keys,
    read_data_identity,
    read_model_args,
    read_schedule,
)
from trainer.checkpoint.location import Location, display, location
from trainer.checkpoint.timeline import candidates
from trainer.config import Checkpoint
from trainer.model.llama3 import ModelArgs
from trainer.optimizer import schedule_change
from trainer.runtime.errors import CheckpointError, UserError


def check_same_model(path: Location, ours: ModelArgs, what: str) -> None:
    """Refuse, in one line naming the difference and the keys that build the checkpoint's model,
    a checkpoint of another model (another flavor or kind, a vocabulary of another size, other
    experts): DCP would fail on the first tensor of another shape with every rank's traceback. A
    checkpoint without ``model_args.json`` is left to DCP."""
    saved = saved_model_args(path)
    differ = checkpoint_model_differences(saved, ours) if saved is not None else []
    if saved is None or not differ:
        return
    vocabulary = (
        " The vocabulary size comes from the tokenizer: set `model.tokenizer_path` to the one the "
        "checkpoint was trained with (`checkpoint.allow_data_change` allows other data, not another model)."
        if saved.vocab_size != ours.vocab_size
        else ""
    )
    raise CheckpointError(
        f"{what} {display(path)} holds another model than this run's ({'; '.join(differ)}): it was trained with "
        f"{model_keys(saved)}.{vocabulary} Set those keys to resume it, or point `job.dump_folder` or "
        "`checkpoint.folder` elsewhere to start afresh."
    )


def saved_model_args(path: Location) -> ModelArgs | None:
    """The ``ModelArgs`` recorded beside a checkpoint; None when it has no ``model_args.json``."""
    if not (path / MODEL_ARGS_FILE).is_file():
        return None
    try:
        return read_model_args(path)
    except UserError as error:
        raise CheckpointError(f"{display(path)} cannot be loaded: {error}") from error


def data_changes(path: Location, ours: dict[str, str]) -> list[str]:
    """The data fingerprints (files, tokenizer, ``seq_len``) that differ from the checkpoint's."""
    saved = read_data_identity(path) or {}
    return [
        f"{key} {saved[key][:16]} in the checkpoint, {value[:16]} now"
        for key, value in ours.items()
        if key in saved and saved[key] != value
    ]


def other_data(path: Location, differ: list[str]) -> CheckpointError:
    """Continuing a checkpoint's data stream on other data would train on something else from
    its next step on, silently."""
    return CheckpointError(
        f"{display(path)} was trained on other data than this run's ({'; '.join(differ)}). Point "
        "`training.dataset`, `training.dataset_path`, `training.dataset_weights`, `training.seq_len` and "
        "`model.tokenizer_path` at the data it was trained on, or set `checkpoint.allow_data_change = true` to "
        "resume on the new data deliberately (or exclude `dataloader` from loading to start its order afresh)."
    )


def schedule_line(path: Location, ours: dict[str, Any], step: int) -> str | None:
    """What this run's LR schedule changes against the one ``path`` was trained with, resumed at ``step``."""
    return schedule_change(read_schedule(path) or {}, ours, step)


def resume_preview(
    config: Checkpoint, dump_folder: str, model: ModelArgs, data: dict[str, str], schedule: dict[str, Any]
) -> list[str]:
    """``--dry-run``'s lines on the checkpoint the run would resume: the newest whole one of the
    current timeline (``checkpoint.load_step``'s), refused as the resume would refuse it (another
    model; other data without ``checkpoint.allow_data_change``), with another schedule said.
    Its checksums are verified by the resume, not here (that reads every byte)."""
    if not config.enable:
        return []
    folder = location(config.folder, base=dump_folder)
    paths, _ = candidates(folder, config.load_step)
    skipped: list[str] = []
    for path in paths:
        problem = checkpoint_problem(path)
        if problem is None:
            return skipped + _resuming(path, config, model, data, schedule)
        skipped.append(f"resume: {display(path)} would be skipped: {problem}")
    return [*skipped, f"resume: no checkpoint in {display(folder)}; the run starts {_start(config)}"]


def _resuming(
    path: Location, config: Checkpoint, model: ModelArgs, data: dict[str, str], schedule: dict[str, Any]
) -> list[str]:
    check_same_model(path, model, "checkpoint")
    if is_model_only(path):
        return [f"resume: {display(path)}, weights only (the model's as this run's): training starts at step 0"]
    loaded = [key for key in ("optimizer", "lr_scheduler", "dataloader") if key not in config.exclude_from_loading]
    lines = [f"resume: {display(path)} (the model's as this run's)"]
    differ = data_changes(path, data) if "dataloader" in loaded else []
    if differ and not config.allow_data_change:
        raise other_data(path, differ)
    if differ:
        lines.append(f"resume: on changed data (`checkpoint.allow_data_change`): {'; '.join(differ)}")
    step = int(path.name.removeprefix("step-"))
    change = schedule_line(path, schedule, step) if "lr_scheduler" in loaded else None
    return lines + ([f"resume: {change}"] if change else [])


def _start(config: Checkpoint) -> str:
    return f"from `checkpoint.initial_load_path` {config.initial_load_path}" if config.initial_load_path else "afresh"
