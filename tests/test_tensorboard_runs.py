"""TensorBoard runs are named after their job, and a job that resumes continues its own run."""

from __future__ import annotations

from trainer.metrics.tensorboard_sink import RUN_RECORD, tensorboard_run


def test_a_run_is_named_after_its_job_and_continued_on_resume(tmp_path):
    dump = tmp_path / "llama-debug-lr3e-3"
    first = tensorboard_run(dump, "tb", resumed=False)
    assert first.parent == dump / "tb" and first.name.startswith("llama-debug-lr3e-3-")
    first.mkdir()
    assert tensorboard_run(dump, "tb", resumed=True) == first
    assert (dump / "tb" / RUN_RECORD).read_text().strip() == first.name
    # A fresh start (no checkpoint resumed) is a run of its own; a record whose run is gone too.
    (dump / "tb" / RUN_RECORD).write_text("gone-20000101-000000\n")
    assert tensorboard_run(dump, "tb", resumed=True) != dump / "tb" / "gone-20000101-000000"
