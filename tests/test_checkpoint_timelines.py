"""The newest save survives and a rollback is a new timeline; a checkpoint missing its proofs, or
of another vocabulary, is refused naming why; a save the disk refuses says what was kept."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import TINY, one_rank, overwrite, resume_worker, small_argv, tiny_manager, train_worker
from harness import run_ranks

import trainer.checkpoint.writer as writer_module
from trainer.checkpoint.folders import checkpoint_problem, step_folders
from trainer.checkpoint.integrity import ChecksummingWriter, checksum_problem
from trainer.checkpoint.timeline import TIMELINE_FILE, read_timelines
from trainer.runtime.errors import CheckpointError, JobError

__all__ = ["one_rank"]  # the fixture, used by name


def saved(dump: Path, *steps: int, **checkpoint: Any) -> None:
    """One run that saves ``steps`` in turn (its state at each save records that step)."""
    manager = tiny_manager(dump, **checkpoint)
    for step in steps:
        manager.train_state.step = step
        manager.save(step)


def names(dump: Path) -> list[str]:
    return [p.name for _, p in step_folders(dump / "checkpoint")]


def abandoned(dump: Path) -> list[str]:
    return sorted(f"{a.name}/{p.name}" for a in (dump / "checkpoint").glob("abandoned-*") for p in a.iterdir())


def resumed(dump: Path, caplog: pytest.LogCaptureFixture, **checkpoint: Any) -> tuple[int, str]:
    """The step a new run resumes after, and what it logged."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        start = tiny_manager(dump, **checkpoint).load()
    return start, caplog.text


def largest_file(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)


UNLOADABLE: dict[str, Callable[[Path], str]] = {
    "a flipped byte": lambda step: (overwrite(largest_file(step), 100, 8), "does not match its checksum")[1],
    "a truncated data file": lambda step: (largest_file(step).write_bytes(b"x"), "is truncated (1 of")[1],
    "damaged metadata": lambda step: ((step / ".metadata").write_bytes(b"junk"), ".metadata) cannot be read")[1],
}


@pytest.mark.parametrize("damage", UNLOADABLE)
def test_only_unloadable_checkpoints_start_from_scratch_loudly_and_rotation_keeps_every_new_save(
    tmp_path: Path, one_rank: None, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """A newer checkpoint that cannot be loaded: the run says, as a warning naming it and why, that it
    starts from scratch; it is moved aside, not deleted; and with ``keep_latest_k = 1`` each new save
    is the one kept, so the next run resumes from it."""
    saved(tmp_path, 60)
    why = UNLOADABLE[damage](tmp_path / "checkpoint" / "step-60")
    start, log = resumed(tmp_path, caplog, keep_latest_k=1)
    assert start == 0
    warning = next(r.getMessage() for r in caplog.records if "can be loaded" in r.getMessage())
    assert caplog.records[-1].levelno == logging.WARNING and "FROM SCRATCH" in warning
    assert "step-60: " in warning and why in warning, warning
    [moved] = abandoned(tmp_path)
    assert moved.endswith("/step-60") and moved.split("/")[0] in warning
    saved(tmp_path, 5, 10, keep_latest_k=1)
    assert names(tmp_path) == ["step-10"] and abandoned(tmp_path) == [moved]
    start, log = resumed(tmp_path, caplog, keep_latest_k=1)
    assert start == 10 and "resuming from" in log and "step-10 (timeline 2, from scratch after step-60" in log


def test_rotation_never_deletes_the_save_just_written_nor_a_newer_folder(tmp_path: Path, one_rank: None) -> None:
    saved(tmp_path, 1, 2, 3, keep_latest_k=2)
    assert names(tmp_path) == ["step-2", "step-3"]
    shutil.copytree(tmp_path / "checkpoint" / "step-3", tmp_path / "checkpoint" / "step-9")  # a user's copy
    manager = tiny_manager(tmp_path, keep_latest_k=1, step=4)
    manager.save(4)
    assert names(tmp_path) == ["step-4", "step-9"]


ROLLBACKS = {
    # how the run leaves the newest checkpoint behind -> (settings of the run, what it logs)
    "load_step": ({"load_step": 2}, "rolled back from step-6 to step-2 by `checkpoint.load_step`"),
    "load_step, keep_latest_k 1": ({"load_step": 2, "keep_latest_k": 1}, "rolled back from step-6 to step-2"),
    "fall-back past corrupt saves": ({"corrupt": (4, 6)}, "from step-2 after step-4, step-6 could not be loaded"),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ROLLBACKS)
def test_a_rollback_is_a_new_timeline_and_rerunning_the_command_continues_it(
    tmp_path: Path, one_rank: None, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """After the run continues from step-2 instead of step-6, the newer checkpoints are moved aside
    (never deleted), the new timeline saves step-3 (a SIGTERM) and rerunning the same command, with
    or without its ``load_step``, resumes from step-3: never step-2 again, never the abandoned step-6."""
    settings, story = ROLLBACKS[how]
    settings = dict(settings)
    saved(tmp_path, 2, 4, 6)
    for step in settings.pop("corrupt", ()):
        overwrite(largest_file(tmp_path / "checkpoint" / f"step-{step}"), 100, 8)
    start, log = resumed(tmp_path, caplog, **settings)
    assert start == 2 and f"step-2 (timeline 2, {story}" in log, log
    moved = abandoned(tmp_path)
    assert [m.split("/")[1] for m in moved] == ["step-4", "step-6"] and moved[0].split("/")[0] in log
    assert "nothing deleted" in log
    saved(tmp_path, 3, **settings)
    expected = ["step-3"] if settings.get("keep_latest_k") == 1 else ["step-2", "step-3"]
    assert names(tmp_path) == expected
    for rerun in (settings, {}):
        start, log = resumed(tmp_path, caplog, **rerun)
        assert start == 3 and "step-3 (timeline 2, " in log, (rerun, log)
    assert [t.id for t in read_timelines(tmp_path / "checkpoint")] == [1, 2]
    assert abandoned(tmp_path) == moved  # nothing more was moved, nothing deleted
    intact = tmp_path / "checkpoint" / moved[-1]
    if "corrupt" not in ROLLBACKS[how][0]:
        assert checkpoint_problem(intact) is None and checksum_problem(intact) is None


@pytest.mark.slow
def test_a_second_rollback_begins_a_third_timeline(
    tmp_path: Path, one_rank: None, caplog: pytest.LogCaptureFixture
) -> None:
    saved(tmp_path, 2, 4, 6)
    assert resumed(tmp_path, caplog, load_step=4)[0] == 4
    saved(tmp_path, 5)
    start, log = resumed(tmp_path, caplog, load_step=2)
    assert start == 2 and "timeline 3, rolled back from step-5 to step-2" in log
    assert sorted(m.split("/")[1] for m in abandoned(tmp_path)) == ["step-4", "step-5", "step-6"]
    assert names(tmp_path) == ["step-2"]
    (tmp_path / "checkpoint" / TIMELINE_FILE).write_text("{")
    with pytest.raises(CheckpointError, match=r"timeline.json cannot be read .*Restore it, or move it away"):
        tiny_manager(tmp_path, load_step=2).load()


PROOFS = ["checksums.json", "data.json", "model_args.json", ".metadata"]


@pytest.mark.parametrize("proof", PROOFS)
def test_a_checkpoint_missing_a_proof_is_refused_naming_it(
    tmp_path: Path, one_rank: None, caplog: pytest.LogCaptureFixture, proof: str
) -> None:
    """A published folder without one of the files that vouch for it (a partial copy, a tidy-up)
    is not loaded as if whole: ``load_step`` refuses it and a resume passes over it, naming the file."""
    saved(tmp_path, 2, 4)
    (tmp_path / "checkpoint" / "step-4" / proof).unlink()
    with pytest.raises(CheckpointError, match=rf"step-4 cannot be loaded: .*{proof}"):
        tiny_manager(tmp_path, load_step=4).load()
    start, log = resumed(tmp_path, caplog)
    assert start == 2 and f"skipping checkpoint {tmp_path / 'checkpoint' / 'step-4'}: " in log
    assert proof in log.split("skipping checkpoint")[1].splitlines()[0]


def test_a_checkpoint_without_checksums_from_an_older_writer_loads_with_a_warning(
    tmp_path: Path, one_rank: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ChecksummingWriter, "storage_meta", lambda self: None)  # no checksummed mark
    saved(tmp_path, 2)
    (tmp_path / "checkpoint" / "step-2" / "checksums.json").unlink()
    start, log = resumed(tmp_path, caplog)
    assert start == 2 and "has no checksums.json" in log and "not verified" in log


def test_another_vocabulary_is_refused_naming_the_sizes_and_the_tokenizer(tmp_path: Path, one_rank: None) -> None:
    """Even with ``allow_data_change`` (the tokenizer is part of the data's identity)."""
    saved(tmp_path, 2)
    for vocab in (128, 48):
        with pytest.raises(CheckpointError, match=rf"vocab_size: 64 there, {vocab} here\).*`model.tokenizer_path`"):
            tiny_manager(tmp_path, args=replace(TINY, vocab_size=vocab), data="b", allow_data_change=True).load()


def fail_with(code: int) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, errno.errorcode[code] if code != errno.EROFS else "Read-only file system")

    return fail


DISK_REFUSALS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "no space left on the device"}
DISK_REFUSALS |= {errno.EROFS: "is read-only or not writable", errno.EACCES: "is read-only or not writable"}


@pytest.mark.parametrize(
    "code, where",
    [
        (errno.ENOSPC, "writing the data"),
        (errno.EDQUOT, "publishing"),
        (errno.EROFS, "creating the folder"),
        (errno.EROFS, "writing the data"),
        (errno.EACCES, "publishing"),
    ],
)
def test_a_save_the_disk_refuses_is_one_line_saying_what_was_kept(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch, code: int, where: str
) -> None:
    """Wherever the disk refuses (full, over quota, read-only, no permission): one line naming
    the folder and the cause, only the new checkpoint lost, the older ones named and loadable."""
    saved(tmp_path, 2)
    target = {
        "creating the folder": (writer_module, "_empty_folder"),
        "writing the data": (ChecksummingWriter, "write_data"),
        "publishing": (writer_module, "publish"),
    }[where]
    monkeypatch.setattr(*target, fail_with(code))
    with pytest.raises(JobError) as error:
        saved(tmp_path, 4)
    message = str(error.value)
    assert "\n" not in message and not isinstance(error.value, CheckpointError)
    assert message.startswith("checkpoint step-4 could not be written: ") and str(tmp_path / "checkpoint") in message
    assert DISK_REFUSALS[code] in message and "older checkpoints are kept (step-2)" in message, message
    assert "partial folder was removed" in message and names(tmp_path) == ["step-2"]
    assert not (tmp_path / "checkpoint" / "step-4.partial").exists()
    monkeypatch.undo()
    assert tiny_manager(tmp_path).load() == 2


def chained_runs(runs: list[list[str]], resume: list[str]) -> dict:
    """Train each of ``runs`` in turn in this one process (no rendezvous: one rank, as a plain
    ``python -m trainer.entry.worker``), then report where ``resume`` would start."""
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.pop(name)
    for argv in runs:
        train_worker(argv)
    logging.getLogger("meshtrain").setLevel(logging.INFO)  # resume_worker records what it says
    return resume_worker(resume)


@pytest.mark.slow
def test_rollback_through_training_then_rerun_resumes_the_new_timeline(tmp_path: Path) -> None:
    """The real loop: train to step-6, roll back to step-2 and stop at step 4 (as a SIGTERM would),
    then the same command resumes at step 4 of timeline 2, with its data position."""
    rollback = small_argv(tmp_path, "--checkpoint.load_step", "2", "--checkpoint.keep_latest_k", "1")
    rollback += ["--training.steps", "4"]
    again = run_ranks(chained_runs, 1, [small_argv(tmp_path), rollback], rollback)[0]
    assert again["start"] == 4 and again["loader"]["step"] == 4
    said = "\n".join(again["warnings"])
    assert "step-4 (timeline 2, rolled back from step-6 to step-2" in said, said
    assert names(tmp_path) == ["step-4"]
    moved = abandoned(tmp_path)
    assert [m.split("/")[1] for m in moved] == ["step-4", "step-6"]
    assert checksum_problem(tmp_path / "checkpoint" / moved[-1]) is None
    assert json.loads((tmp_path / "checkpoint" / TIMELINE_FILE).read_text())["timelines"][-1]["load_step"] == 2
