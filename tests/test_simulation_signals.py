"""``--simulate`` stopped by any signal leaves no process behind and says so in one line; two
simulations into one dump folder do not overwrite each other's report. A stop that arrives while
the role processes are being started waits until they are (``stop_requests.stops_held``).

Every process of the job (the launcher, the fork server, the pool's role workers, the manager,
multiprocessing's resource tracker) is found by a marker in its environment, which children
inherit, so that orphans re-parented to init are found too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from harness import ROOT

pytestmark = pytest.mark.slow

MARK = "MESHTRAIN_TEST_JOB"
TWO_STAGES = ["--config", "llama3_8b.toml", "--mesh", "pp=2", "--training.global_batch_size", "2", "--simulate"]
"""Two roles of a few seconds each: long enough to be stopped while they run."""


def processes_marked(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def start(dump: Path, mark: str) -> subprocess.Popen[str]:
    """The simulation, its output in files (a pipe would tie the test to its holders' lives)."""
    env = {**os.environ, "NGPU": "2", MARK: mark}
    command = [str(ROOT / "run_train.sh"), *TWO_STAGES, "--job.dump_folder", str(dump / "job")]
    with open(dump / "out.txt", "w") as out, open(dump / "err.txt", "w") as err:
        return subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)


def wait_for_roles(proc: subprocess.Popen[str], dump: Path, then: float, timeout: float = 120) -> None:
    """Until the line the simulation prints as it starts the roles, and ``then`` seconds more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if "simulating 2 role(s)" in (dump / "err.txt").read_text():
            time.sleep(then)
            return
        time.sleep(0.2)
    raise AssertionError(f"the simulation's roles never started: {(dump / 'err.txt').read_text()[-2000:]}")


def gone(mark: str, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize(
    ("sig", "then"),
    [(signal.SIGTERM, 0.0), (signal.SIGINT, 2.0), (signal.SIGKILL, 2.0)],
    ids=["SIGTERM-as-roles-start", "SIGINT-as-roles-run", "SIGKILL-as-roles-run"],
)
def test_a_signal_ends_every_process_of_the_simulation(tmp_path: Path, sig: signal.Signals, then: float):
    """At 0 s the role processes are being started (the fork server still imports the trainer)."""
    mark = uuid.uuid4().hex
    proc = start(tmp_path, mark)
    try:
        wait_for_roles(proc, tmp_path, then)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert not gone(mark), "processes of the simulation outlived it"
    finally:
        for pid in processes_marked(mark):
            os.kill(pid, signal.SIGKILL)
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), err[-2000:]
    if sig != signal.SIGKILL:
        assert err.strip().splitlines()[-1] == (
            f"meshtrain: --simulate stopped by {sig.name}: its processes are ended; nothing was written."
        )
        assert "Traceback" not in err
    assert not (tmp_path / "job" / "simulation.json").exists()


def test_a_second_simulation_into_the_same_folder_is_refused(tmp_path: Path):
    mark = uuid.uuid4().hex
    first = start(tmp_path, mark)
    try:
        wait_for_roles(first, tmp_path, 2.0)
        second = subprocess.run(
            [str(ROOT / "run_train.sh"), *TWO_STAGES, "--job.dump_folder", str(tmp_path / "job")],
            env={**os.environ, "NGPU": "2"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].startswith("meshtrain: busy dump folder:")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
        for pid in processes_marked(mark):
            os.kill(pid, signal.SIGKILL)
