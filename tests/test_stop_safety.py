"""A job ends with its launcher and torchrun, holds its dump folder while any of its processes
lives, and stops when asked: right after a save in flight, and at once on a second signal.

The classes of fault: a process of the launch chain killed with SIGKILL (torchrun, the launcher
itself), and a signal at a moment the loop does not expect (during a save, a second one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from harness import QUICK, Launched, children, run_ranks

from trainer.checkpoint.folders import step_folders
from trainer.runtime.dump_folder import LOCK_FILE, MEMBERS, busy_message, is_stale, join, live_members

STEPS = 400  # far more than a test waits for: only a stop or a kill ends the job


def job_args(folder: Path) -> list[str]:
    steps = ["--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2"]
    return [*QUICK, *steps, "--job.dump_folder", str(folder)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until_gone(pids: list[int], timeout: float) -> float:
    start = time.monotonic()
    while any(alive(pid) for pid in pids):
        assert time.monotonic() - start < timeout, [pid for pid in pids if alive(pid)]
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.launcher
@pytest.mark.parametrize("killed", ["torchrun", "launcher"])
def test_a_killed_launch_leaves_no_worker_and_the_folder_held_until_they_end(killed, tmp_path):
    """``kill -9`` of torchrun or of the launcher at step 3 of a 2-rank job: every worker ends
    within 60 s (after a checkpoint: the stop is SIGTERM's), a rerun on the folder meanwhile is
    refused naming them, and the folder ends with the one run's checkpoints. The processes left
    are held (SIGSTOP) while the rerun checks, so that they surely still live then."""
    job = Launched(2, job_args(tmp_path), tmp_path / "job.log")
    workers: list[int] = []
    try:
        job.wait_for(f"step: 3/{STEPS}")
        (torchrun,) = children(job.proc.pid)
        workers = children(torchrun)
        assert len(workers) == 2
        held = workers if killed == "torchrun" else [torchrun, *workers]
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        os.kill(torchrun if killed == "torchrun" else job.proc.pid, signal.SIGKILL)
        rerun = Launched(1, job_args(tmp_path), tmp_path / "rerun.log")
        code = rerun.finish(timeout=180)
        assert code == 2, rerun.output()[-3000:]
        assert "is in use by" in rerun.output() and "torch.distributed" not in rerun.output()
        if killed == "launcher":
            assert f"the training processes {sorted(workers)} of a job whose launcher is gone" in rerun.output()
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        assert wait_until_gone(workers, timeout=60) < 60
        job.finish(timeout=60)
    finally:
        for pid in [*workers, *children(job.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.finish(timeout=30)
    if killed == "torchrun":  # the launcher saw it, waited for the workers, then released the lock
        assert "waiting for the training processes" in job.output(), job.output()[-3000:]
        assert not (tmp_path / LOCK_FILE).exists()
    saved = [step for step, _ in step_folders(tmp_path / "checkpoint")]
    assert saved and saved == sorted(saved) and saved[0] == 2, saved
    assert not list((tmp_path / "checkpoint").glob("*.partial"))


@pytest.mark.launcher
def test_a_second_signal_stops_at_once(tmp_path):
    """The second SIGTERM kills torchrun and the workers (torchrun alone would wait 30 s for a
    worker inside a collective or a save): the launcher exits within seconds, saying so. The
    workers are held (SIGSTOP), as a rank stuck in a collective would be: an idle machine would
    otherwise finish the graceful stop before the second signal."""
    job = Launched(2, job_args(tmp_path), tmp_path / "job.log")
    try:
        job.wait_for(f"step: 2/{STEPS}")
        workers = job.workers()
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        job.proc.send_signal(signal.SIGTERM)
        time.sleep(3.5)  # past the workers' grace for a repeated signal
        job.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code = job.finish(timeout=60)
        elapsed = time.monotonic() - start
        wait_until_gone(workers, timeout=10)
    finally:
        job.finish(timeout=30)
    out = job.output()
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert elapsed < 10, elapsed
    assert "stopped at once by a second SIGTERM" in out and "Traceback" not in out, out[-3000:]


def stop_during_save_worker(argv: list[str]) -> dict:
    """Train with a SIGTERM that arrives inside the first checkpoint's save."""
    import trainer.checkpoint.writer as writer
    from trainer.entry.job import prepare
    from trainer.runtime.stop_requests import StopRequests
    from trainer.train import train

    original = writer.CheckpointWriter.save

    def signalled(self, step: int, *, model_only: bool = False) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        original(self, step, model_only=model_only)

    writer.CheckpointWriter.save = signalled  # type: ignore[method-assign]
    job = prepare(argv, 1, local_ranks=1, memory=False)
    stop = StopRequests()
    with stop.installed():
        train(job.plan, job.dataset, stop)
    folder = Path(job.plan.config.job.dump_folder) / "checkpoint"
    return {"saved": [step for step, _ in step_folders(folder)]}


@pytest.mark.slow
def test_a_stop_during_a_save_ends_after_that_save(tmp_path):
    """The request is seen after the save it arrived in: no further step and no second save
    (before: one more step, then its checkpoint, 76 s past the signal on the 1B shape)."""
    (out,) = run_ranks(stop_during_save_worker, 1, job_args(tmp_path))
    assert out["saved"] == [2], out


def test_a_worker_keeps_the_lock_held_until_it_ends(tmp_path):
    """The members beside the lock: a live one of the lock's job keeps a lock whose launcher is
    gone from being stale, and the refusal names it; one of another job or a dead one does not."""
    gone = {"host": socket.gethostname(), "pid": 999999999, "pid_start": None, "token": "token-a", "started": 0}
    assert is_stale(gone, 0.0, tmp_path)
    me = join(tmp_path, "token-a")
    assert live_members(tmp_path, "token-a") == [os.getpid()]
    assert live_members(tmp_path, "token-b") == [] and live_members(tmp_path, None) == []
    assert not is_stale(gone, 0.0, tmp_path) and is_stale({**gone, "token": "token-b"}, 0.0, tmp_path)
    message = busy_message(tmp_path, gone, 0.0)
    assert f"training processes [{os.getpid()}]" in message and "launcher is gone" in message
    dead = tmp_path / MEMBERS / f"{socket.gethostname()}-999999999.json"
    dead.write_text(json.dumps({**json.loads(me.read_text()), "pid": 999999999}))
    me.unlink()
    assert live_members(tmp_path, "token-a") == [] and is_stale(gone, 0.0, tmp_path)
