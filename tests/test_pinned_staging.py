"""``checkpoint.async_mode = "async_with_pinned_mem"``: the state is staged in the background while
the next step runs, and the optimizer step waits for the copy, so each checkpoint holds the
weights of its own step, as a blocking save's does. Pinned memory is CUDA's: on this CPU the
staging runs unpinned (the same stager, path and fence), slowed so that an optimizer step that
did not wait would change the weights under the copy; a CPU job asking for it is refused."""

from __future__ import annotations

import time

import pytest
import torch
from harness import QUICK, run_ranks, train_as_a_worker

from trainer.checkpoint.model_entry import read_dcp_model
from trainer.entry.launch import main as launch_main

STEPS = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "1"]


def staged_unpinned(argv: list[str], fence: bool) -> None:
    """Train with the pinned mode's path on this CPU, the copy starting a second late."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from trainer.checkpoint import writer
    from trainer.planning import job_plan
    from trainer.runtime.weights_fence import WeightsFence

    job_plan.check_pinned_staging = lambda config, device: None
    writer.PINNED_STAGING = StagingOptions(False, False, True, False)
    copy = DefaultStager._stage  # what the staging thread runs

    def late(self, state_dict, **kwargs):
        time.sleep(1.0)
        return copy(self, state_dict, **kwargs)

    DefaultStager._stage = late
    if not fence:
        WeightsFence.wait = lambda self: None
    train_as_a_worker(argv)


@pytest.mark.slow
def test_each_checkpoint_holds_its_own_steps_weights_as_a_blocking_save_does(tmp_path):
    blocking, pinned, unfenced = tmp_path / "blocking", tmp_path / "pinned", tmp_path / "unfenced"
    run_ranks(train_as_a_worker, 1, [*QUICK, *STEPS, "--job.dump_folder", str(blocking)])
    mode = ["--checkpoint.async_mode", "async_with_pinned_mem"]
    run_ranks(staged_unpinned, 1, [*QUICK, *STEPS, *mode, "--job.dump_folder", str(pinned)], True)
    run_ranks(staged_unpinned, 1, [*QUICK, *STEPS, *mode, "--job.dump_folder", str(unfenced)], False)
    for step in (1, 2, 3, 4):
        want = read_dcp_model(blocking / "checkpoint" / f"step-{step}")
        got = read_dcp_model(pinned / "checkpoint" / f"step-{step}")
        assert all(torch.equal(got[k], want[k]) for k in want), step
    # Without the fence the optimizer moves the weights under the late copy: the test can fail.
    moved = read_dcp_model(unfenced / "checkpoint" / "step-1")
    assert not all(
        torch.equal(moved[k], want_k) for k, want_k in read_dcp_model(blocking / "checkpoint" / "step-1").items()
    )


def test_a_cpu_job_asking_for_pinned_staging_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "1")
    argv = [*QUICK, *STEPS, "--checkpoint.async_mode", "async_with_pinned_mem", "--job.dump_folder", str(tmp_path)]
    code = launch_main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and '`checkpoint.async_mode` = "async_with_pinned_mem"' in err, err
