"""Weights & Biases (``metrics.enable_wandb``), offline: rank 0 writes one run whose history holds
every scalar TensorBoard gets at the same steps, its config the job's resolved config; a resumed
job continues that run; without the extra, or when wandb cannot start, one line says so."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import QUICK, run_train
from metrics_helpers import _read_events, _scalars

from trainer.entry.launch import main as launch_main
from trainer.metrics.dashboard import DASHBOARD_ALIASES

pytest.importorskip("wandb")

BLOCK, HEADER = 32768, 7  # the .wandb file: LevelDB's log format, 32 KiB blocks of framed records


def records(path: Path) -> Iterator:
    """The protobuf records of an offline run's ``.wandb`` file, as ``wandb sync`` reads them."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), HEADER, b""
    assert data[:4] == b":W&B", path
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER]) if left >= HEADER else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += left
            continue
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(dump: Path) -> dict[str, list[Path]]:
    """``{run id: its offline run files, oldest first}``."""
    runs: dict[str, list[Path]] = {}
    for file in sorted(dump.glob("wandb/offline-run-*/run-*.wandb")):
        runs.setdefault(file.stem.removeprefix("run-"), []).append(file)
    return runs


def history(files: list[Path]) -> dict[int, dict[str, float]]:
    """The logged rows of a run's files, by the trainer's step."""
    rows: dict[int, dict[str, float]] = {}
    for file in files:
        for record in records(file):
            if record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                rows.setdefault(int(row.pop("step")), {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")}
                )
    return rows


def run_config(file: Path) -> dict:
    for record in records(file):
        if record.WhichOneof("record_type") == "run":
            return {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.run.config.update}
    raise AssertionError(f"no run record in {file}")


@pytest.mark.slow
@pytest.mark.launcher
def test_an_offline_run_holds_what_tensorboard_holds_and_a_resume_continues_it(tmp_path):
    args = [*QUICK, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb", "--checkpoint.enable"]
    first = run_train(2, [*args, "--training.steps", "4"], WANDB_MODE="offline")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "wandb: offline run in " in first.stderr and "wandb sync" in first.stderr
    resumed = run_train(2, [*args, "--training.steps", "6"], WANDB_MODE="offline")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]

    # Rank 0 only, and the resumed job in the same run.
    ((run_id, files),) = offline_runs(tmp_path).items()
    assert len(files) == 2 and (tmp_path / "wandb" / "run-of-this-job.txt").read_text().strip() == run_id, files
    rows = history(files)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]

    # Every scalar TensorBoard has at a step, with its value (the dashboard's aliases are TensorBoard's own).
    (tb_run,) = [p for p in (tmp_path / "tb").iterdir() if p.is_dir()]
    events = _read_events(str(tb_run))
    tags = set(events.Tags()["scalars"]) - set(DASHBOARD_ALIASES.values())
    for tag in tags:
        for step, value in _scalars(events, tag).items():
            assert rows[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)
    assert all(set(row) == tags for row in rows.values()), [sorted(tags ^ set(row)) for row in rows.values()]

    config = run_config(files[0])
    assert config["training"]["steps"] == 4 and config["metrics"]["enable_wandb"] is True
    assert config["job"]["dump_folder"] == str(tmp_path)


def test_without_wandb_installed_the_job_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    monkeypatch.setenv("NGPU", "1")
    code = launch_main([*QUICK, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert '`metrics.enable_wandb` needs wandb: `pip install -e ".[wandb]"`' in err


def test_a_wandb_that_cannot_start_ends_the_job_in_one_line_naming_the_fix(tmp_path, monkeypatch):
    import wandb

    from trainer.metrics.wandb_sink import WandbSink
    from trainer.runtime.errors import JobError

    def refuse(**kwargs: object) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(JobError) as caught:
        WandbSink(tmp_path, resumed=False, run_config={})
    said = str(caught.value)
    assert "\n" not in said and "api_key not configured" in said and "WANDB_MODE=offline" in said
