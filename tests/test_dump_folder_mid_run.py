"""A dump folder that turns read-only or full while the job runs, on a real file system: a tmpfs
in a private mount namespace, remounted read-only or filled up once the job is past a checkpoint.
The job ends within seconds with one line naming the folder and `job.dump_folder`, and the
checkpoint it saved before is kept and loads. (The checkpoint's own save on a full disk is in
``test_faults.py``; a TensorBoard writer that fails, without a file system, in ``test_metrics.py``.)"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from harness import QUICK, ROOT, needs_tmpfs

from trainer.checkpoint.folders import step_folders
from trainer.checkpoint.model_entry import read_dcp_model

# Run inside ``unshare -rm``: mount, train in the background, wait for the saved checkpoint,
# break the folder, wait for the job, and copy what is left where the test can read it.
# ``mount -o remount,ro`` is refused while a file on it is open for writing (a checkpoint being
# written), so it is tried until it takes.
SCRIPT = """
mount -t tmpfs -o size={size} tmpfs {mount} || exit 90
{command} > {log} 2>&1 &
job=$!
until grep -q "saved checkpoint .*step-10" {log}; do kill -0 $job 2>/dev/null || break; sleep 0.1; done
if [ {fault} = read-only ]; then
  until mount -o remount,ro {mount} 2>/dev/null; do sleep 0.05; done
else
  dd if=/dev/zero of={mount}/filler bs=1M 2>/dev/null
fi
date +%s.%N > {broken}
wait $job
code=$?
date +%s.%N > {ended}
cp -r {mount}/out/checkpoint {kept}
exit $code
"""


@needs_tmpfs
@pytest.mark.slow
@pytest.mark.launcher
@pytest.mark.parametrize(
    ("fault", "reason"), [("read-only", "Read-only file system"), ("full", "No space left on device")]
)
def test_a_dump_folder_that_turns_read_only_or_full_mid_run_ends_the_job_naming_it(tmp_path, fault, reason):
    """A checkpoint every 10 steps, TensorBoard every step: after step 10's save the next write is
    TensorBoard's (a full tmpfs still takes the appends that fit the events file's last page, a few
    steps' worth, well before step 20's save)."""
    mount, log = tmp_path / "disk", tmp_path / "job.log"
    mount.mkdir()
    args = [*QUICK, "--training.steps", "60", "--checkpoint.enable", "--checkpoint.interval", "10"]
    command = shlex.join([str(ROOT / "run_train.sh"), *args, "--job.dump_folder", f"{mount}/out"])
    script = SCRIPT.format(
        size="300m",
        mount=mount,
        command=command,
        log=log,
        fault=fault,
        broken=tmp_path / "broken",
        ended=tmp_path / "ended",
        kept=tmp_path / "kept",
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], timeout=300, env={**os.environ, "NGPU": "1"})
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    error = f"error: cannot write the TensorBoard logs in {mount}/out/tb/"
    assert f"[rank0]:meshtrain: {error}" in out and f"({reason}): the dump folder (`job.dump_folder`)" in out
    assert out.count("meshtrain: error:") == 1, out[-3000:]
    assert f"meshtrain: the job failed (exit 1): local rank 0: {error}" in out, out[-3000:]
    assert "[rank0]:Traceback" not in out and "Exception in thread" not in out, out[-3000:]
    ended, broken = ((tmp_path / name).read_text() for name in ("ended", "broken"))
    assert float(ended) - float(broken) < 60
    kept = step_folders(tmp_path / "kept")
    assert [step for step, _ in kept] == [10], kept
    assert read_dcp_model(kept[0][1])
