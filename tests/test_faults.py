"""Faults a long run meets, injected one at a time. Each ends the job loudly, with a message that
says what happened and what to do, or is recovered from; none publishes broken state, clobbers
another job or hangs silently. (Corrupt checkpoints, non-finite states and SIGTERM are tested
with the other checkpoint tests in ``test_checkpoint.py``; stop requests through the
launcher in ``test_stop_requests.py``.)"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import QUICK, ROOT, Launched, needs_tmpfs, run_train

from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.model_entry import read_dcp_model
from trainer.config import ConfigError, load_config
from trainer.entry.job import prepare
from trainer.entry.worker import main
from trainer.runtime.dump_folder import LOCK_FILE, STALE_AFTER_S, DumpFolderLock, read_lock
from trainer.runtime.errors import BusyFolderError


def python_train(args: list[str], *prefix: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m trainer.entry.worker args`` as one process without torchrun (``prefix`` wraps it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "trainer.entry.worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


# --------------------------------------------------------------------------------------------
# Bad values and folders, before any process group
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["optimizer.lr", "optimizer.eps", "optimizer.beta2", "training.max_norm", "lr_scheduler.min_lr_factor"]
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_values_are_config_errors(key, value, tmp_path):
    with pytest.raises(ConfigError, match=f"`{key}` must be a finite number"):
        load_config([f"--{key}", value])
    section, name = key.split(".")
    toml = tmp_path / "job.toml"
    toml.write_text(f"[{section}]\n{name} = {value}\n")
    with pytest.raises(ConfigError, match=f"`{key}` must be a finite number"):
        load_config(["--config", str(toml)])


def test_a_dump_folder_that_is_a_file_is_refused_before_any_process_group(tmp_path):
    file = tmp_path / "outputs"
    file.write_text("")
    for folder in (file, file / "run1"):
        with pytest.raises(ConfigError, match="job.dump_folder"):
            prepare(["--job.dump_folder", str(folder)], 1, local_ranks=1)


@needs_tmpfs
@pytest.mark.launcher
def test_a_read_only_dump_folder_is_refused_before_launch(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    script = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {mount} && exec {ROOT / 'run_train.sh'} --job.dump_folder {mount / 'out'}"
    )
    start = time.monotonic()
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NGPU": "2"},
    )
    assert proc.returncode == 2
    assert "`job.dump_folder`" in proc.stderr and "not a writable folder" in proc.stderr
    assert "torch.distributed" not in proc.stderr + proc.stdout  # refused before torchrun started
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------------------------
# One job per dump folder
# --------------------------------------------------------------------------------------------


def write_lock(folder: Path, host: str, pid: int, pid_start: str | None, age_s: float) -> None:
    lock = folder / LOCK_FILE
    lock.write_text(
        f'{{"host": "{host}", "pid": {pid}, "pid_start": {"null" if pid_start is None else repr(pid_start).replace(chr(39), chr(34))}, "started": 0}}'
    )
    os.utime(lock, (time.time() - age_s, time.time() - age_s))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_lock_is_refused_naming_its_owner(tmp_path):
    write_lock(tmp_path, "node-7", 4242, None, age_s=5)
    with pytest.raises(BusyFolderError, match="in use by another job: pid 4242 on host node-7"):
        DumpFolderLock(tmp_path).acquire()
    write_lock(tmp_path, socket.gethostname(), os.getpid(), None, age_s=STALE_AFTER_S * 10)
    with pytest.raises(BusyFolderError, match=f"pid {os.getpid()}"):  # alive here: a stopped job keeps its lock
        DumpFolderLock(tmp_path).acquire()


@pytest.mark.parametrize("owner", ["dead process here", "recycled pid here", "silent other host"])
def test_a_stale_lock_is_taken_over(owner, tmp_path):
    if owner == "dead process here":
        write_lock(tmp_path, socket.gethostname(), dead_pid(), None, age_s=1)
    elif owner == "recycled pid here":
        write_lock(tmp_path, socket.gethostname(), os.getpid(), "1", age_s=1)
    else:
        write_lock(tmp_path, "node-7", 4242, None, age_s=STALE_AFTER_S + 10)
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    try:
        holder, age = read_lock(tmp_path)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and age < 5
        with pytest.raises(BusyFolderError, match="in use"):
            DumpFolderLock(tmp_path).acquire()
    finally:
        lock.release()
    assert read_lock(tmp_path) is None


def test_the_entry_point_refuses_a_locked_folder_before_any_process_group(tmp_path, capsys):
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    try:
        assert main(["--job.dump_folder", str(tmp_path), "--training.steps", "1"]) == 2
    finally:
        lock.release()
    assert "is in use by another job" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


@pytest.mark.launcher
def test_of_two_jobs_started_together_on_one_folder_the_second_is_refused_at_once(tmp_path):
    """The launcher holds the lock from its check through the job (its rank 0 inherits it), so
    there is no window between the check and the workers' lock for a second job to slip in."""
    args = QUICK + ["--training.steps", "200", "--job.dump_folder", str(tmp_path)]
    jobs = [Launched(1, args, tmp_path / f"job{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(job.proc.poll() is None for job in jobs):
            assert time.monotonic() < deadline, "neither job was refused"
            time.sleep(0.2)
        loser = next(job for job in jobs if job.proc.poll() is not None)
        winner = next(job for job in jobs if job is not loser)
        assert loser.proc.returncode == 2, loser.output()[-3000:]
        assert f"is in use by another job: pid {winner.proc.pid} on host {socket.gethostname()}" in loser.output()
        assert "torch.distributed" not in loser.output()  # refused before its torchrun
        winner.wait_for("step: 1/200")
        # Without a launcher, the job's rank 0 refuses before its process group exists.
        direct = python_train(QUICK + ["--training.steps", "2", "--job.dump_folder", str(tmp_path)])
        assert direct.returncode == 2 and f"pid {winner.proc.pid}" in direct.stderr
        winner.proc.send_signal(signal.SIGTERM)
        assert winner.finish() == 128 + signal.SIGTERM
    finally:
        for job in jobs:
            job.finish(timeout=60)
    assert not (tmp_path / LOCK_FILE).exists()


# --------------------------------------------------------------------------------------------
# Divergence, stalls, restarts, a full disk, other data
# --------------------------------------------------------------------------------------------


@pytest.mark.launcher
def test_divergence_ends_the_job_and_every_checkpoint_stays_finite(tmp_path):
    """lr 10 (the largest the config accepts): from step 2 on every step is skipped (non-finite
    gradient norm)."""
    args = QUICK + [
        "--optimizer.lr",
        "10",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.steps",
        "20",
        "--training.max_consecutive_skipped_steps",
        "3",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--job.dump_folder",
        str(tmp_path),
    ]
    proc = run_train(2, args)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "the last 3 optimizer steps (up to step 4) were all skipped (non-finite gradient norm)" in out, out[-3000:]
    assert "training.max_consecutive_skipped_steps" in out and "step: 5/20" not in out
    saved = step_folders(tmp_path / "checkpoint")
    assert [step for step, _ in saved] == [1, 2, 3]
    for _, folder in saved:
        assert all(torch.isfinite(w).all() for w in read_dcp_model(str(folder)).values())


@pytest.mark.launcher
def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    timeout = 5
    job = Launched(
        2,
        QUICK
        + ["--training.steps", "500", "--comm.train_timeout_seconds", str(timeout), "--job.dump_folder", str(tmp_path)],
        tmp_path / "job.log",
    )
    named = f"a collective waited more than `comm.train_timeout_seconds` = {timeout} s"
    try:
        job.wait_for("step: 3/500")
        stalled = job.workers()[-1]
        os.kill(stalled, signal.SIGSTOP)
        start = time.monotonic()
        job.wait_for(named, timeout=timeout + 120)
        elapsed = time.monotonic() - start
        # Left stopped, the rank would hold the job for torchrun's 30 s grace before its SIGKILL
        # (torchrun's, not ours); woken, it finds its peer gone and the job ends.
        os.kill(stalled, signal.SIGCONT)
        code = job.finish(timeout=120)
    finally:
        for pid in job.workers():
            os.kill(pid, signal.SIGKILL)
    assert code != 0
    assert elapsed < timeout + 15, elapsed


@pytest.mark.launcher
def test_restarts_recover_from_kill_9_of_any_rank(tmp_path):
    """Two kills in one job, each recovered by a torchrun restart that resumes the checkpoint
    (before the fix, two of three restarts failed to connect)."""
    steps = 9
    job = Launched(
        2,
        QUICK
        + [
            "--training.steps",
            str(steps),
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1",
            "--job.dump_folder",
            str(tmp_path),
        ],
        tmp_path / "job.log",
        MAX_RESTARTS="2",
    )
    pick = random.Random(0)
    try:
        for kill_after in (2, 5):
            job.wait_for(f"step: {kill_after}/{steps}")
            os.kill(pick.choice(job.workers()), signal.SIGKILL)
            job.wait_for(f"step: {kill_after + 2}/{steps}")  # only reached after a restart and resume
        assert job.finish() == 0, job.output()[-3000:]
    finally:
        job.finish(timeout=60)
    out = job.output()
    assert out.count("resuming from") == 2 and f"step: {steps}/{steps}" in out
    assert "connectFullMesh" not in out


@needs_tmpfs
@pytest.mark.launcher
def test_a_full_disk_is_named_and_the_previous_checkpoint_kept(tmp_path):
    """The debug model's full state takes about 70 MB: the first save fits a 100 MB disk, the second not."""
    mount = tmp_path / "small"
    mount.mkdir()
    args = QUICK + [
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--metrics.enable_tensorboard=false",
        "--job.dump_folder",
        str(mount / "out"),
    ]
    command = " ".join([sys.executable, "-m", "trainer.entry.worker", *args])
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=100m tmpfs {mount} && exec {command}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "checkpoint step-4 could not be written: no space left on the device" in proc.stderr
    assert "older checkpoints are kept (step-2)" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.launcher
def test_resuming_on_other_data_of_the_same_size_is_refused(tmp_path):
    def pairs(name: str, word: str) -> Path:
        file = tmp_path / name
        file.write_text("".join(f'{{"prompt": "{word} {i}?", "response": "{word} {i}."}}\n' for i in range(40)))
        return file

    args = QUICK + [
        "--training.dataset",
        "shakespeare_dialogue",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]
    first = python_train(args + ["--training.dataset_path", str(pairs("a.jsonl", "Why")), "--training.steps", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    other = args + ["--training.dataset_path", str(pairs("b.jsonl", "How")), "--training.steps", "4"]
    refused = python_train(other)
    assert refused.returncode == 1
    assert "was trained on other data than this run's (samples_sha256" in refused.stderr
    assert "checkpoint.allow_data_change" in refused.stderr and "Traceback" not in refused.stderr
    allowed = python_train(other + ["--checkpoint.allow_data_change"])
    assert allowed.returncode == 0 and "resuming" in allowed.stderr and "on changed data" in allowed.stderr


# --------------------------------------------------------------------------------------------
# Errors that name their cause, whichever rank has it
# --------------------------------------------------------------------------------------------

FAULT_ON_RANK_1 = """
import importlib.abc, importlib.machinery, os, sys

class _Inject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "trainer.loss" or os.environ.get("LOCAL_RANK") != "1":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            def failing(*args, **kwargs):
                {raise_it}
            module.cross_entropy_sum = failing
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Inject())
"""


@pytest.mark.launcher
@pytest.mark.parametrize(
    "fault, expected",
    [
        ("raise RuntimeError('injected fault of rank one')", "RuntimeError: injected fault of rank one"),
        (
            "from trainer.runtime.errors import JobError; raise JobError('injected user error of rank one')",
            "error: injected user error of rank one",
        ),
    ],
    ids=["bug", "user error"],
)
def test_the_error_of_a_rank_whose_output_is_hidden_reaches_the_console(fault, expected, tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAULT_ON_RANK_1.replace("{raise_it}", fault))
    proc = run_train(
        2,
        QUICK + ["--training.steps", "2", "--job.dump_folder", str(tmp_path / "out")],
        PYTHONPATH=str(tmp_path / "inject"),
    )
    assert proc.returncode == 1
    assert f"local rank 1 (not shown: LOG_RANK=0) failed: {expected}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("value", ["9", "abc", "0,2", "-1"])
def test_log_rank_outside_the_local_ranks_is_one_line(value, monkeypatch, capsys):
    from trainer.entry.launch import main as launch

    monkeypatch.setenv("NGPU", "2")
    monkeypatch.setenv("LOG_RANK", value)
    assert launch(["--training.steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"LOG_RANK={value}" in err and "0..1" in err
