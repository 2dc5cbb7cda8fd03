"""``scripts/multinode_trainer.slurm`` run as Slurm would run it, with stand-ins for ``srun`` and
``scontrol`` (``tests/stand_ins``) that start two "nodes" on this machine: one ``./run_train.sh``
per node, the rendezvous on the first node, a job of world size 2; a SIGTERM to the batch script
(preemption, the time limit) stops every node after a step with a checkpoint, and submitting the
same command again resumes from it."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from harness import QUICK, ROOT, Launched, free_port

SCRIPT = ROOT / "scripts" / "multinode_trainer.slurm"


def allocation(nodes: int = 2) -> dict[str, str]:
    """The environment of a Slurm batch script on ``nodes`` nodes of this machine (one process each)."""
    return {
        **os.environ,
        "PATH": f"{ROOT / 'tests' / 'stand_ins'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": f"node[0-{nodes - 1}]",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "NGPU": "1",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.slow
@pytest.mark.launcher
def test_two_nodes_train_as_one_job_stop_on_sigterm_with_a_checkpoint_and_resume(tmp_path):
    args = [*QUICK, "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable"]
    args += ["--metrics.enable_tensorboard=false", "--checkpoint.interval", "1000"]
    job = Launched(1, [*args, "--training.steps", "500"], tmp_path / "job.log", SCRIPT, **allocation())
    job.wait_for("step: 2/500", timeout=240)
    job.proc.send_signal(signal.SIGTERM)
    code = job.finish(timeout=240)
    out = job.output()
    # One job over both nodes: the mesh spans the two processes, and both launchers stopped it.
    assert "mesh pp=1 dp_replicate=1 dp_shard=2" in out, out[-3000:]
    assert code == 128 + signal.SIGTERM and out.count("meshtrain: stopped by SIGTERM") == 2, out[-3000:]
    saved = sorted((tmp_path / "out" / "checkpoint").glob("step-*"))
    assert len(saved) == 1 and not saved[0].name.endswith(".partial"), saved
    stopped_at = int(saved[0].name.removeprefix("step-"))

    rerun = Launched(
        1, [*args, "--training.steps", str(stopped_at + 1)], tmp_path / "again.log", SCRIPT, **allocation()
    )
    code = rerun.finish(timeout=240)
    said = rerun.output()
    assert code == 0, said[-3000:]
    assert f"resuming from {saved[0]}" in said and f"step: {stopped_at + 1}/{stopped_at + 1}" in said, said[-3000:]


def test_outside_an_allocation_or_the_repository_it_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in allocation().items() if k != "SLURM_JOB_NODELIST"}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "submit it with sbatch" in proc.stderr
    env = {**allocation(), "SLURM_SUBMIT_DIR": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "MESHTRAIN_ROOT" in proc.stderr


def test_a_long_host_list_gives_the_first_node_without_a_broken_pipe(tmp_path):
    """The rendezvous node is the first of ``scontrol show hostnames``: read without a reader that
    stops early (``| head -n 1`` breaks scontrol's pipe, and ``pipefail`` then ends the script with
    141 before any node starts, more likely the longer the list)."""
    (tmp_path / "scontrol").write_text('#!/usr/bin/env bash\necho 127.0.0.1\nseq -f "node%g" 200000\n')
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\necho "rendezvous $RDZV_ENDPOINT"\n')
    for stand_in in ("scontrol", "srun"):
        (tmp_path / stand_in).chmod(0o755)
    env = {**allocation(), "PATH": f"{tmp_path}:{os.environ['PATH']}", "RDZV_PORT": "29555"}
    proc = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "rendezvous 127.0.0.1:29555", (proc.returncode, proc.stderr)
