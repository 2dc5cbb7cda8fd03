"""Checkpoints in an object store (S3 on a loopback moto server): the promises of a local folder.

Nothing half-written is loaded (a save is published by its marker, written last), checksums and
rotation hold, a process killed mid-save leaves the last published checkpoint to resume from, a
resume on another mesh continues the same losses, the Hugging Face export reads from the URL,
the credentials appear nowhere, and bad URLs are refused in one line before launch.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs
import torch.multiprocessing as mp
from checkpoint_helpers import COMMON, one_rank, resume_worker, small_argv, tiny_manager, train_worker
from harness import ROOT, run_ranks, run_train, tensorboard_scalars
from object_store import SECRET, s3_bucket

from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.location import PUBLISHED_FILE, location
from trainer.config import ConfigError, load_config
from trainer.planning.job_plan import resolve_job

__all__ = ["one_rank", "s3_bucket"]  # fixtures, used by name


def store() -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(skip_instance_cache=True)


def published(url: str) -> list[int]:
    return [step for step, _ in step_folders(location(url))]


def keys(url: str) -> list[str]:
    prefix = url.removeprefix("s3://")
    return [key.removeprefix(prefix + "/") for key in store().find(prefix)]


def flip_a_byte(key: str) -> None:
    fs = store()
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def largest_data_file(url: str, step: int) -> str:
    fs, prefix = store(), f"{url.removeprefix('s3://')}/step-{step}"
    return max(fs.find(prefix), key=lambda key: fs.size(key) if key.endswith(".distcp") else -1)


def test_saves_are_published_last_rotated_verified_and_set_aside_not_deleted(
    tmp_path: Path, one_rank: None, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{s3_bucket}/in-process"
    manager = tiny_manager(tmp_path, folder=url, keep_latest_k=2)
    for step in (1, 2, 3):
        manager.train_state.step = step
        manager.save(step)
    assert published(url) == [2, 3]
    assert {key.split("/", 1)[1] for key in keys(url) if key.startswith("step-3/")} >= {
        PUBLISHED_FILE,
        ".metadata",
        "checksums.json",
        "model_args.json",
    }
    assert not any(".partial" in key for key in keys(url))
    assert not (tmp_path / "s3:").exists()  # the bucket is not a local folder named after it

    flip_a_byte(largest_data_file(url, 3))
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        assert tiny_manager(tmp_path, folder=url).load() == 2
    assert "skipping checkpoint s3://checkpoints/in-process/step-3" in caplog.text
    assert "does not match its checksum" in caplog.text
    assert published(url) == [2] and any(k.startswith("abandoned-") and "/step-3/" in k for k in keys(url))

    manager = tiny_manager(tmp_path, folder=url, step=4, async_mode="async")
    manager.save(4)
    manager.close()
    assert published(url) == [2, 4]
    store().rm_file(f"{url.removeprefix('s3://')}/step-4/{PUBLISHED_FILE}")  # as if killed before the marker
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        assert tiny_manager(tmp_path, folder=url).load() == 2
    assert "removed s3://checkpoints/in-process/step-4, left by a save that never finished" in caplog.text
    assert not any(key.startswith("step-4/") for key in keys(url))


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_the_last_published_checkpoint(tmp_path: Path, s3_bucket: str) -> None:
    url = f"{s3_bucket}/killed"
    argv = small_argv(tmp_path, "--checkpoint.interval", "1", "--checkpoint.folder", url)
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(train_worker, 2, argv, 1, 6)
    assert published(url) == [1, 2, 3, 4, 5]
    assert any(key.startswith("step-6/") for key in keys(url))  # written, never published
    resumed = run_ranks(resume_worker, 2, argv)[0]
    assert resumed["start"] == 5 and resumed["loader"]["step"] == 5
    assert "removed s3://checkpoints/killed/step-6" in "\n".join(resumed["warnings"])
    assert not any(key.startswith("step-6/") for key in keys(url))


@pytest.mark.launcher
def test_a_resume_on_another_mesh_continues_the_losses_and_exports_from_the_url(tmp_path: Path, s3_bucket: str) -> None:
    """Two ranks save to S3 asynchronously every 4 steps; a rollback to step 4 on a TP mesh trains
    steps 5-8 again with the same losses, setting the first step-8 aside in the bucket. The
    export of the new step-8 from its URL equals the export of a downloaded copy, byte for byte."""
    url = f"{s3_bucket}/launched"
    job = [*COMMON, "--training.local_batch_size", "2", "--training.steps", "8", "--checkpoint.enable"]
    job += ["--checkpoint.folder", url, "--checkpoint.interval", "4", "--checkpoint.async_mode", "async"]
    first = run_train(2, [*job, "--job.dump_folder", str(tmp_path / "first")])
    assert first.returncode == 0, first.stderr[-3000:]
    assert published(url) == [4, 8]
    second = run_train(
        2, [*job, "--job.dump_folder", str(tmp_path / "second"), "--checkpoint.load_step", "4", "--mesh", "tp=2"]
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from s3://checkpoints/launched/step-4" in second.stderr
    assert published(url) == [4, 8] and any(k.startswith("abandoned-") and "/step-8/" in k for k in keys(url))
    tags = ("loss_metrics/global_avg_loss", "grad_norm")
    before, after = (tensorboard_scalars(tmp_path / run, tags) for run in ("first", "second"))
    for tag in tags:
        assert list(after[tag]) == [5, 6, 7, 8], tag
        assert [after[tag][s] for s in range(5, 9)] == pytest.approx([before[tag][s] for s in range(5, 9)], rel=1e-5)
    for run in (first, second):
        assert SECRET not in run.stdout + run.stderr
    for dump in ("first", "second"):
        assert SECRET not in (tmp_path / dump / "config.toml").read_text()
        assert not (tmp_path / dump / "s3:").exists()

    local = tmp_path / "downloaded-step-8"
    store().get(f"{url.removeprefix('s3://')}/step-8", str(local), recursive=True)
    exports = {}
    for name, source in (("url", f"{url}/step-8"), ("local", str(local))):
        exports[name] = tmp_path / f"hf-{name}"
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "convert_to_hf.py"), source, str(exports[name])],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in exports["url"].iterdir())
    assert files == sorted(p.name for p in exports["local"].iterdir()) and "config.json" in files
    for name in files:
        assert (exports["url"] / name).read_bytes() == (exports["local"] / name).read_bytes(), name


BAD_URLS = {
    "another key": (["--model.tokenizer_path", "s3://checkpoints/tok.model"], "only `checkpoint.folder` and"),
    "credentials": (["--checkpoint.folder", "s3://key:secret@checkpoints/x"], "holds credentials in its URL"),
    "unknown protocol": (["--checkpoint.folder", "nosuch://checkpoints/x"], "fsspec cannot open it"),
    "missing package": (["--checkpoint.folder", "gs://checkpoints/x"], "install gcsfs"),
    "no such bucket": (["--checkpoint.folder", "s3://no-such-bucket/x"], "the store cannot be listed"),
    "Hugging Face from a URL": (
        ["--checkpoint.initial_load_path", "s3://checkpoints/hf", "--checkpoint.initial_load_in_hf"],
        "Hugging Face folders are read from a local disk",
    ),
}


@pytest.mark.parametrize("case", BAD_URLS)
def test_a_url_that_cannot_serve_is_refused_in_one_line_before_launch(tmp_path: Path, s3_bucket: str, case: str):
    argv, said = BAD_URLS[case]
    with pytest.raises(ConfigError) as refused:
        resolve_job(load_config(small_argv(tmp_path, *argv)), 1)
    message = str(refused.value)
    assert said in message and "\n" not in message, message
    assert "key:secret@" not in message and SECRET not in message, message


def test_credentials_that_cannot_write_are_refused_before_launch(tmp_path: Path, s3_bucket: str, monkeypatch):
    """A store that lists but refuses writes (read-only credentials): one line at the plan, not a
    traceback at the first save."""
    from upath.implementations.cloud import S3Path

    def refused(self, *args, **kwargs):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(S3Path, "write_text", refused)
    with pytest.raises(ConfigError, match=r"`checkpoint.folder` = s3://checkpoints/read-only cannot be written"):
        resolve_job(load_config(small_argv(tmp_path, "--checkpoint.folder", f"{s3_bucket}/read-only")), 1)
