"""Every entry point prepares the job the same way and tells user errors from bugs the same way.

A :class:`~trainer.runtime.errors.UserError` is one line on stderr with its exit code; anything
else (a ``ValueError`` deep in torch, say) is a bug and must keep its traceback, never be printed
as "config error". Tested on every entry point, for a bug while preparing and a bug in a step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

import trainer.entry.job as job_module
from trainer.config import load_config
from trainer.entry import launch
from trainer.entry.job import parse_request, prepare
from trainer.entry.worker import main as train_main
from trainer.model.llama3 import Transformer
from trainer.planning.job_plan import resolve_job
from trainer.runtime.errors import BusyFolderError, ConfigError, DataError, JobError, UserError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import show_batch  # noqa: E402

TINY = ["--training.steps", "1", "--training.seq_len", "32", "--metrics.enable_tensorboard=false"]

ENTRY_POINTS: dict[str, Callable[[list[str]], int]] = {
    "launcher": lambda argv: launch.main(argv),
    "launcher --dry-run": lambda argv: launch.main([*argv, "--dry-run"]),
    "worker": lambda argv: train_main(argv),
    "worker --dry-run": lambda argv: train_main([*argv, "--dry-run"]),
    "show_batch": lambda argv: show_batch.main(["--step", "1", *argv]),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_user_error_is_one_line_with_its_exit_code(entry, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NGPU", "1")
    code = ENTRY_POINTS[entry]([*TINY, "--job.dump_folder", str(tmp_path), "--training.seq_len", "zero"])
    err = capsys.readouterr().err
    assert code == 2
    assert "config error: `training.seq_len` expects" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("entry", [*ENTRY_POINTS, "launcher --simulate"])
def test_an_initial_load_path_that_cannot_load_is_refused_before_launch(entry, tmp_path, capsys, monkeypatch):
    """Known from the folder alone, so no entry point starts a job that fails at its load."""
    monkeypatch.setenv("NGPU", "1")
    run = ENTRY_POINTS.get(entry) or (lambda argv: launch.main([*argv, "--simulate"]))
    hf, dcp = tmp_path / "hf", tmp_path / "checkpoint" / "step-4"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"")
    key = "config error: `checkpoint.initial_load_path` = "
    for extra, message in (
        ([str(tmp_path / "absent")], f"{key}{tmp_path / 'absent'} does not exist; point it at a checkpoint's"),
        ([str(hf)], f"{key}{hf} is a Hugging Face model folder: add `--checkpoint.initial_load_in_hf`"),
        ([str(dcp), "--checkpoint.initial_load_in_hf"], f"{key}{dcp} is a training checkpoint (DCP), not a Hugging"),
        ([str(tmp_path)], f"{key}{tmp_path} holds [checkpoint/step-4]: point it at one of those"),
    ):
        argv = [*TINY, "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.initial_load_path", *extra]
        assert run(argv) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_bug_while_preparing_keeps_its_traceback(entry, tmp_path, monkeypatch):
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug deep inside the plan")

    monkeypatch.setenv("NGPU", "1")
    monkeypatch.setattr(job_module, "resolve_job", broken)
    with pytest.raises(ValueError, match="a bug deep inside the plan"):
        ENTRY_POINTS[entry]([*TINY, "--job.dump_folder", str(tmp_path)])


def test_a_bug_inside_the_model_during_a_step_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    def broken_forward(self: Transformer, *args: object, **kwargs: object) -> None:
        raise ValueError("a bug inside the model")

    monkeypatch.setattr(Transformer, "forward", broken_forward)
    try:
        with pytest.raises(ValueError, match="a bug inside the model"):
            train_main([*TINY, "--job.dump_folder", str(tmp_path)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "config error" not in capsys.readouterr().err


def test_the_user_error_family():
    """Exit 2 for what is wrong before the job runs, 1 for what stops a running job; input
    errors stay ValueErrors for library callers."""
    assert all(issubclass(cls, UserError) for cls in (ConfigError, DataError, BusyFolderError, JobError))
    assert ConfigError.exit_code == DataError.exit_code == BusyFolderError.exit_code == 2
    assert JobError.exit_code == 1
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)


def test_every_entry_point_prepares_through_one_function(tmp_path):
    """The entry points' own flags are split off the same way, and what they prepare is the same."""
    request = parse_request(["--dry-run", "--target-gpu", "h100", "--target.memory_gib=75", "--mesh", "dp_shard=1"])
    assert (request.mode, request.target_gpu, request.target_overrides) == ("dry_run", "h100", {"memory_gib": "75"})
    assert request.argv == ["--mesh", "dp_shard=1"]
    with pytest.raises(ConfigError, match="--target-gpu"):
        parse_request(["--target-gpu", "h100"])
    job = prepare([*TINY, "--job.dump_folder", str(tmp_path)], 1, local_ranks=1)
    assert job.plan.dims.world_size == 1 and len(job.dataset) > 0
    for source in ("trainer/entry/launch.py", "trainer/entry/worker.py", "scripts/show_batch.py"):
        text = (ROOT / source).read_text()
        assert "prepare(" in text and "except UserError" in text, source


def test_resolving_writes_nothing_and_preparing_checks_the_dump_folder(tmp_path):
    """The resolver has no side effect (the simulator resolves a second plan of the same job); the
    dump folder is made and probed while preparing."""
    folder = tmp_path / "out"
    resolve_job(load_config([*TINY, "--job.dump_folder", str(folder)]), 1)
    assert not folder.exists()
    prepare([*TINY, "--job.dump_folder", str(folder)], 1, local_ranks=1)
    assert folder.is_dir() and not list(folder.iterdir())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        prepare([*TINY, "--job.dump_folder", str(tmp_path / "a_file")], 1, local_ranks=1)
