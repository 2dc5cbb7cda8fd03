"""Validation: the same loss on every mesh, equal to a single-process ``no_grad`` evaluation of
the same weights, invisible to training, and its settings checked before any process group.
(Through ``./run_train.sh`` on two meshes: ``test_run_train.py``.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from harness import run_ranks, trainer_for
from step_helpers import fetch_step, forward_backward, optimizer_step

from trainer.build import build_validator
from trainer.config import ConfigError, load_config
from trainer.data.datasets import load_validation_dataset
from trainer.data.documents import split_documents
from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model.llama3 import Transformer
from trainer.planning.job_plan import resolve_job
from trainer.validation import Validator


def documents(path: Path, count: int) -> Path:
    """Short documents of varied length, so packed windows hold several (document masking)."""
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "the", "mind"]
    lines = [json.dumps({"text": " ".join(words[(i * 3) % 11 :][: 2 + i % 9])}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def argv_for(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--training.dataset_path",
        str(documents(tmp_path / "train.jsonl", 60)),
        "--validation.dataset_path",
        str(documents(tmp_path / "valid.jsonl", 23)),
        "--validation.enable",
        "--validation.local_batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "2",
        "--training.document_mask",
        "--debug.seed",
        "11",
        "--metrics.enable_tensorboard=false",
        *extra,
    ]


def validation_worker(argv: list[str], part_steps: int) -> list[dict]:
    """The whole validation set, then its first ``part_steps`` batches, on the same weights."""
    p, parts = trainer_for(argv)
    dataset = load_validation_dataset(p.config, p.tokenizer)
    results = []
    for steps in (-1, part_steps):
        validator = Validator(
            dataset,
            local_batch_size=p.config.validation.local_batch_size,
            dp_rank=parts.meshes.batch.get_local_rank(),
            dp_degree=p.dims.dp,
            steps=steps,
            freq=1,
            seed=p.config.debug.seed,
        )
        result = validator.run(parts)
        results.append({"loss": result.loss, "n": result.n_valid_tokens, "batches": result.batches})
    return results


def reference(argv: list[str]) -> dict:
    """One process, plain model, no_grad, every validation sample once: the definition."""
    p = resolve_job(load_config(argv), 1)
    dataset = load_validation_dataset(p.config, p.tokenizer)
    model = Transformer(p.model_args)
    model.init_weights(p.config.debug.seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            inputs, labels = (t.unsqueeze(0) for t in dataset[i])
            labels, positions, ids = split_documents(inputs, labels, p.tokenizer.bos_id)
            total += cross_entropy_sum(model(inputs, positions, ids), labels).double().item()
            count += int((labels != IGNORE_INDEX).sum())
    return {"loss": total / count, "n": count, "samples": len(dataset)}


@pytest.mark.slow
def test_validation_loss_is_the_single_process_evaluation_on_any_mesh(tmp_path: Path) -> None:
    """HSDP-like replication x TP (loss parallel), masked documents, and a last batch with fewer
    samples than ranks x local batch (filler samples must add nothing)."""
    argv = argv_for(tmp_path, "--mesh", "dp_replicate=2,tp=2")
    expected = reference(argv_for(tmp_path))
    assert expected["samples"] % 4 != 0  # the last validation batch is partial
    results = run_ranks(validation_worker, 4, argv, 2)
    assert len({r[0]["loss"] for r in results}) == 1
    whole, part = results[0]
    assert whole["n"] == expected["n"] and whole["batches"] == math.ceil(expected["samples"] / 4)
    assert whole["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    # A part of the set (2 batches of 2 in all): the same samples whatever the data-parallel degree.
    alone = run_ranks(validation_worker, 1, argv_for(tmp_path), 2)[0][1]
    assert (part["batches"], alone["batches"]) == (1, 2)
    assert part["n"] == alone["n"] < expected["n"] and part["loss"] == pytest.approx(alone["loss"], rel=1e-6)


def losses_worker(argv: list[str], validate: bool) -> list[float]:
    p, parts = trainer_for(argv)
    validator = build_validator(p, parts, load_validation_dataset(p.config, p.tokenizer)) if validate else None
    losses = []
    for _ in range(3):
        result = forward_backward(parts, fetch_step(parts))
        optimizer_step(parts, result)
        losses.append(result.loss_avg)
        if validator is not None:
            validator.run(parts)
    return losses


@pytest.mark.slow
def test_validation_does_not_perturb_training(tmp_path: Path) -> None:
    argv = argv_for(tmp_path)
    with_validation = run_ranks(losses_worker, 1, argv, True)[0]
    without = run_ranks(losses_worker, 1, argv, False)[0]
    assert with_validation == without and len(set(without)) == 3


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--validation.seq_len", "64"], r"`validation.seq_len` = 64 must be in \[1, `training.seq_len` = 32\]"),
        (["--validation.steps", "0"], "`validation.steps` must be >= 1, or -1"),
        (["--validation.freq", "0"], "`validation.freq` must be >= 1"),
    ],
)
def test_bad_settings_name_the_key(tmp_path: Path, extra: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(argv_for(tmp_path, *extra))


def test_held_out_plays_and_their_errors(tmp_path: Path) -> None:
    # Own training data needs own validation data: the held-out plays split the bundled corpus
    # only, so the run trains without validation (and says so at start).
    own = resolve_job(
        load_config(
            [
                "--training.dataset_path",
                str(documents(tmp_path / "t.jsonl", 40)),
                "--validation.enable",
                "--training.seq_len",
                "32",
            ]
        ),
        1,
    )
    assert not own.validates and load_validation_dataset(own.config, own.tokenizer) is None
    with pytest.raises(ConfigError, match="`validation.seq_len` = 16 differs from `training.seq_len` = 32.*context"):
        resolve_job(
            load_config(
                ["--validation.enable", "--validation.seq_len", "16", "--training.seq_len", "32", "--mesh", "cp=2"]
            ),
            2,
        )
    # Bundled plays: the validation split is the held-out plays, which training never reads.
    p = resolve_job(load_config(["--validation.enable", "--training.seq_len", "32"]), 1)
    from trainer.data import sources

    validation_files = {f.stem for f, _ in sources.read_sources(None, "validation").files}
    training_files = {f.stem for f, _ in sources.read_sources(None).files}
    assert validation_files == set(sources.HELD_OUT_PLAYS) and not validation_files & training_files
    assert len(load_validation_dataset(p.config, p.tokenizer)) > 100
    # A validation set that yields nothing is an error naming the validation keys.
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ho"}]})
    )
    p = resolve_job(
        load_config(
            [
                "--validation.enable",
                "--validation.dataset",
                "chat",
                "--validation.dataset_path",
                str(tiny),
                "--training.seq_len",
                "32",
                "--validation.seq_len",
                "3",
            ]
        ),
        1,
    )
    with pytest.raises(
        ValueError, match="`validation.dataset_path` = .* yields no chat samples of `validation.seq_len` = 3"
    ):
        load_validation_dataset(p.config, p.tokenizer)
