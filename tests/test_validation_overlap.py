"""Validation on training data is warned about, however the two are named: the same file, a
copy of it, a prepared folder (the same, a copy, or one made from the training files), raw files
against the folder prepared from them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from data_helpers import load_data, run_prepare, write


def test_validation_on_training_data_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    train = write(tmp_path / "train" / "a.txt", "To be, or not to be. " * 400)
    copy = write(tmp_path / "held" / "copy.txt", train.read_text())
    write(tmp_path / "fresh" / "b.txt", "Other words entirely. " * 400)
    for validation, overlap in ((train, "(the same file)"), (tmp_path / "held", f"(identical to {train})")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="meshtrain"):
            load_data(
                "--training.dataset_path", str(train), "--validation.dataset_path", str(validation), validation=True
            )
        assert "overlaps the training data" in caplog.text and overlap in caplog.text
        assert str(copy if validation != train else train) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        fresh = str(tmp_path / "fresh")
        load_data("--training.dataset_path", str(train), "--validation.dataset_path", fresh, validation=True)
    assert "overlaps" not in caplog.text


@pytest.mark.parametrize(
    ("training", "validation", "overlap"),
    [
        ("prepared", "prepared", "manifest.json (the same file)"),
        ("prepared", "copy", "(identical to"),
        ("prepared", "again", "(identical to"),
        ("raw", "prepared", "a.txt (the same file)"),
        ("prepared", "raw", "a.txt (the same file)"),
    ],
)
def test_prepared_folders_are_compared_by_what_they_were_made_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, training: str, validation: str, overlap: str
) -> None:
    raw = tmp_path / "train"
    write(raw / "a.txt", "To be, or not to be. " * 400)
    run_prepare([raw], tmp_path / "prepared")
    run_prepare([raw], tmp_path / "again")
    (tmp_path / "copy").mkdir()
    for file in (tmp_path / "prepared").rglob("*"):
        target = tmp_path / "copy" / file.relative_to(tmp_path / "prepared")
        target.parent.mkdir(parents=True, exist_ok=True)
        if file.is_file():
            target.write_bytes(file.read_bytes())
    paths = {"raw": raw, "prepared": tmp_path / "prepared", "copy": tmp_path / "copy", "again": tmp_path / "again"}
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        load_data(
            "--training.dataset_path",
            str(paths[training]),
            "--validation.dataset_path",
            str(paths[validation]),
            validation=True,
        )
    assert "overlaps the training data" in caplog.text and overlap in caplog.text
