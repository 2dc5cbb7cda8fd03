"""The CPU threads each training process gets (``OMP_NUM_THREADS``): the launcher gives every
process of the node an equal share of the idle cores, one process included, and keeps a value the
user set; the start line says how many a process runs with."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_train

import trainer.entry.launch as launch
from trainer.runtime import cpu_threads
from trainer.runtime.cpu_threads import THREADS_ENV, threads_per_process


class _Finished:
    def wait(self, timeout: float | None = None) -> int:
        return 0


def launched_env(monkeypatch, tmp_path: Path, ngpu: int, cores: int, busy: float, user: str | None) -> dict:
    """The environment ``./run_train.sh`` would start torchrun with, on a machine of ``cores``
    cores of which ``busy`` are taken by other work."""
    seen: dict = {}

    def popen(command, env, **kwargs):
        seen.update(env)
        return _Finished()

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda: busy)
    monkeypatch.setenv("NGPU", str(ngpu))
    if user is None:
        monkeypatch.delenv(THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(THREADS_ENV, user)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "debug_model.toml", "--job.dump_folder", str(tmp_path / "out"), "--training.steps", "1"]
    assert launch.main(argv) == 0
    return seen


@pytest.mark.parametrize(
    ("ngpu", "cores", "busy", "user", "threads"),
    [
        (1, 8, 0.0, None, "8"),  # one process too: torchrun would leave it torch's default
        (2, 8, 0.0, None, "4"),
        (2, 9, 0.2, None, "4"),
        (1, 8, 5.6, None, "2"),  # other jobs keep 6 of the 8 cores busy
        (1, 2, 1.7, None, "1"),  # the shared machine of the 136 s run: at least one
        (4, 2, 0.0, None, "1"),
        (1, 8, 0.0, "3", "3"),  # the user's value is kept, whatever the machine
        (4, 2, 0.0, "6", "6"),
    ],
)
def test_the_launcher_gives_each_process_its_share_of_the_idle_cores(
    monkeypatch, tmp_path, ngpu, cores, busy, user, threads
):
    assert launched_env(monkeypatch, tmp_path, ngpu, cores, busy, user)[THREADS_ENV] == threads


def test_the_share_is_never_more_than_the_cores_nor_less_than_one():
    for processes in range(1, 9):
        for cores in range(1, 17):
            for busy in (0.0, 0.4, cores / 2, cores + 3.0):
                share = threads_per_process(processes, cores, busy)
                assert 1 <= share <= max(1, cores // processes)


@pytest.mark.launcher
def test_the_start_line_says_the_threads_a_process_runs_with(tmp_path):
    proc = run_train(
        1,
        ["--training.steps", "1", "--validation.enable=false", "--job.dump_folder", str(tmp_path)],
        OMP_NUM_THREADS="1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on cpu, 1 CPU thread(s) per process" in proc.stdout + proc.stderr
