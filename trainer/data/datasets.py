"""The run's training and validation datasets, as the plan names them, and how they are described
to the user (at start, by ``--dry-run`` and by ``scripts/show_batch.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config import resolve_path
from trainer.data.mixture import Member, MixtureDataset
from trainer.data.prepared import PreparedDataset
from trainer.data.samples import SampleDataset, open_dataset

if TYPE_CHECKING:
    from trainer.plan import Plan

TokenDataset = SampleDataset | PreparedDataset | MixtureDataset
"""What a run trains or validates on: ``(input_ids, labels)`` samples of ``seq_len`` tokens."""


def load_dataset(plan: Plan) -> TokenDataset:
    """The samples of ``training.dataset``: from the bundled plays, one path, or the mixture of
    several (``training.dataset_path``, ``training.dataset_weights``)."""
    training = plan.config.training
    paths = [resolve_path(path) for path in training.dataset_path]
    if len(paths) <= 1:
        return open_dataset(training.dataset, paths[0] if paths else None, plan.tokenizer, training.seq_len)
    members = [open_dataset(training.dataset, path, plan.tokenizer, training.seq_len) for path in paths]
    names = [Path(path).name for path in paths]
    if len(set(names)) < len(names):
        names = list(training.dataset_path)
    return MixtureDataset(members, names, training.dataset_weights or [1.0] * len(paths))


def load_validation_dataset(plan: Plan) -> TokenDataset | None:
    """The validation samples (``[validation]``), or None when the run does not validate."""
    validation, training = plan.config.validation, plan.config.training
    if not plan.validates:
        return None
    return open_dataset(
        validation.dataset or training.dataset,
        resolve_path(validation.dataset_path) if validation.dataset_path else None,
        plan.tokenizer,
        plan.validation_seq_len,
        split="validation",
    )


def describe_data(plan: Plan, dataset: TokenDataset, validation: bool = False) -> str:
    """What the run trains (or validates) on, in a line or two."""
    training = plan.config.training
    kind = (plan.config.validation.dataset or training.dataset) if validation else training.dataset
    seq_len = plan.validation_seq_len if validation else training.seq_len
    text = f"{len(dataset):,} samples of {seq_len} tokens ({kind})"
    members: list[Member]
    if isinstance(dataset, MixtureDataset):
        text += "; mixture over the run: " + dataset.describe_shares(
            training.steps, plan.global_batch_size, plan.config.debug.seed
        )
        members = dataset.members
    else:
        members = [dataset]
    stats = [m.chat_stats for m in members if isinstance(m, SampleDataset) and m.chat_stats]
    return "; ".join([text] + [s.describe(seq_len) for s in stats])


def data_lines(plan: Plan, dataset: TokenDataset, validation_dataset: TokenDataset | None) -> str:
    """What the run trains and validates on."""
    lines = [f"data: {describe_data(plan, dataset)}"]
    if validation_dataset is not None:
        lines.append(
            f"validation every {plan.config.validation.freq} steps and at the end: "
            f"{describe_data(plan, validation_dataset, validation=True)}"
        )
    elif plan.config.validation.enable:
        lines.append(
            "no validation: `validation.enable` is set but `validation.dataset_path` is empty, and the "
            "bundled held-out plays are no validation set for `training.dataset_path`; point "
            "`validation.dataset_path` at held-out data of yours to validate."
        )
    return "\n".join(lines)
