"""Stop requests (SIGTERM, Ctrl-C) through ``./run_train.sh``: never lost, whenever they arrive
(before any worker, while workers import or restart, while training, while the loop waits for a
stalled data loader), and a stop whose checkpoint cannot be written is reported as a failure."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest
from harness import QUICK, ROOT, Launched, children, needs_tmpfs

from trainer.checkpoint.folders import step_folders
from trainer.runtime.dump_folder import LOCK_FILE
from trainer.runtime.stop_requests import Stopped, stopped_by_signals, stops_held, wait_process, wait_result

# --------------------------------------------------------------------------------------------
# A stop request is never lost, whenever it arrives
# --------------------------------------------------------------------------------------------


def running(parent: int, module: str) -> list[int]:
    """The children of ``parent`` that run ``python -m module``. A process's children alone are
    not enough: before ``run_train.sh`` execs the launcher, its bash has children of its own
    (``$(dirname ...)``), and a signal then kills bash instead of reaching the launcher."""
    found = []
    for pid in children(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv:
            found.append(pid)
    return found


def wait_until(condition, timeout: float, what: str, job: Launched) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.proc.poll() is None, f"job ended (exit {job.proc.returncode}) before {what}:\n{job.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{job.output()[-3000:]}"
        time.sleep(0.02)


def signal_another_thread(pid: int, sig: signal.Signals) -> None:
    """``sig`` to a thread of ``pid`` other than its main one (``import torch`` starts one), as the
    kernel may deliver a signal sent to the process."""
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
    assert threads, f"process {pid} has no thread besides its main one"
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, threads[0], sig) == 0


@pytest.mark.launcher
@pytest.mark.parametrize(
    "moment, sig, restarts",
    [
        ("torchrun started, no worker yet", signal.SIGTERM, "0"),
        ("torchrun started, the signal on the launcher's other thread", signal.SIGTERM, "0"),
        ("workers importing, torchrun may restart them", signal.SIGTERM, "2"),
        ("Ctrl-C after the first step, checkpointing off", signal.SIGINT, "0"),
    ],
)
def test_a_stop_request_holds_from_the_first_instant_to_the_last(moment, sig, restarts, tmp_path):
    """The request reaches workers that do not exist yet, that are importing (and would be
    restarted), or are training; each ends without training a step more than asked, with exit
    128 + the signal and a resume promise only where a checkpoint exists to resume from. Also when
    the kernel hands the launcher's signal to a thread other than the one waiting for torchrun."""
    job = Launched(
        1,
        QUICK + ["--training.steps", "60", "--job.dump_folder", str(tmp_path)],
        tmp_path / "job.log",
        MAX_RESTARTS=restarts,
    )
    try:
        torchrun = lambda: running(job.proc.pid, "torch.distributed.run")  # noqa: E731
        workers = lambda: [pid for parent in torchrun() for pid in running(parent, "trainer.entry.worker")]  # noqa: E731
        if moment.startswith("torchrun"):
            wait_until(lambda: torchrun() and not workers(), 120, "torchrun", job)
        elif moment.startswith("workers"):
            wait_until(lambda: len(workers()) == 1, 120, "the workers", job)
        else:
            job.wait_for("step: 1/60")
        if moment.endswith("other thread"):
            signal_another_thread(job.proc.pid, sig)
        else:
            job.proc.send_signal(sig)
        code = job.finish(timeout=120)
    finally:
        job.finish(timeout=60)
    out = job.output()
    assert code == 128 + sig, out[-3000:]
    name = signal.Signals(sig).name
    assert f"meshtrain: stopped by {name}" in out and "step: 60/60" not in out
    if moment.startswith("Ctrl-C"):
        assert f"the launcher received {name}" in out and "SIGTERM" not in out
        assert "no checkpoint to resume from" in out and "rerun the same command to resume" not in out
    else:
        assert "step: 1/60" not in out, out[-3000:]  # stopped before the first step, restarts included
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.launcher
@pytest.mark.parametrize("ending", ["stop request while waiting", "data timeout"])
def test_a_stalled_data_loader_worker_never_hangs_silently(ending, tmp_path):
    """One process, no collective to time out: the loader's own timeout names it, and a stop
    request while the loop waits for data stops the job with the last finished step saved."""
    job = Launched(
        1,
        QUICK
        + [
            "--training.steps",
            "60",
            "--training.num_workers",
            "1",
            "--training.data_timeout_seconds",
            "4",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "50",
            "--job.dump_folder",
            str(tmp_path),
        ],
        tmp_path / "job.log",
    )
    stalled: list[int] = []
    try:
        job.wait_for("step: 2/60")
        stalled = children(job.workers()[0])
        assert stalled, "no data-loader worker process"
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        if ending.startswith("stop"):
            job.proc.send_signal(signal.SIGTERM)
        code = job.finish(timeout=120)
    finally:
        job.finish(timeout=60)
        for pid in stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = job.output()
    if ending.startswith("stop"):
        assert code == 128 + signal.SIGTERM, out[-3000:]
        last = max(step for step, _ in step_folders(tmp_path / "checkpoint"))
        assert f"stopped by SIGTERM after step {last}" in out and last >= 2
    else:
        assert code == 1, out[-3000:]
        assert "the data loader delivered nothing for step" in out and "`training.data_timeout_seconds` = 4 s" in out
        assert "[rank0]:Traceback" not in out and "the job failed (exit 1): local rank 0: error: the data loader" in out


@needs_tmpfs
@pytest.mark.launcher
def test_a_stop_whose_checkpoint_cannot_be_written_is_a_failure_not_a_stop(tmp_path):
    """The debug model's state (about 70 MB) does not fit a 20 MB disk: the stop's save fails, and
    the launcher reports that cause with the job's error code, promising no resume."""
    mount = tmp_path / "small"
    mount.mkdir()
    args = QUICK + [
        "--training.steps",
        "60",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--metrics.enable_tensorboard=false",
        "--job.dump_folder",
        str(mount / "out"),
    ]
    log = tmp_path / "job.log"
    script = f"mount -t tmpfs -o size=20m tmpfs {mount} && exec {ROOT / 'run_train.sh'} {' '.join(args)}"
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", script],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1"},
        )
    try:
        deadline = time.monotonic() + 180
        while "step: 2/60" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = log.read_text()
    assert code == 1, out[-3000:]
    assert "SIGTERM received, but the job failed while stopping (exit 1): error: checkpoint step-" in out, out[-3000:]
    assert "no space left on the device" in out and "rerun the same command to resume" not in out


class _Interrupted(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise _Interrupted


@pytest.mark.parametrize("waiting_for", ["a child process", "a pool's result"])
def test_a_signal_another_thread_receives_ends_the_main_threads_wait(waiting_for):
    """The launcher's wait for torchrun and ``--simulate``'s for its roles: the handler runs while
    the child still works (a single blocking wait would run it only once the child had ended)."""
    previous = signal.signal(signal.SIGUSR1, _raise)
    pool = ThreadPool(1)
    child = subprocess.Popen(["sleep", "30"])
    try:
        result = pool.apply_async(time.sleep, (30,))
        helper = threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(helper.ident, signal.SIGUSR1)))
        helper.start()
        with pytest.raises(_Interrupted):
            wait_process(child) if waiting_for == "a child process" else wait_result(result)
        helper.join()
        assert child.poll() is None and not result.ready()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        child.kill()
        child.wait()
        pool.terminate()


# --------------------------------------------------------------------------------------------
# Inside a job with no step to finish (``--simulate``), a stop waits while processes start
# --------------------------------------------------------------------------------------------


def held_run(signals: list[signal.Signals], nested: bool, reached: list[str]) -> None:
    with stopped_by_signals(), stops_held():
        with stops_held() if nested else contextlib.nullcontext():
            for sig in signals:
                os.kill(os.getpid(), sig)
            time.sleep(0.05)  # Python runs a handler between two bytecodes, a moment after the signal
            reached.append("inner block's end")
        reached.append("outer block's end")
    reached.append("after")


@pytest.mark.parametrize("signals", [[], [signal.SIGTERM], [signal.SIGINT, signal.SIGTERM]], ids=["none", "one", "two"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_stop_while_processes_start_is_raised_where_they_have_started(signals, nested):
    """Not inside a held block (a half-started process would be left to nobody), not lost, named
    by the first signal, and the handlers of before restored."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    reached: list[str] = []
    if signals:
        with pytest.raises(Stopped) as raised:
            held_run(signals, nested, reached)
        assert raised.value.signum == signals[0]
        assert reached == ["inner block's end", "outer block's end"]
    else:
        held_run(signals, nested, reached)
        assert reached == ["inner block's end", "outer block's end", "after"]
    assert {sig: signal.getsignal(sig) for sig in before} == before
