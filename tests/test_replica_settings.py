"""Settings around replica groups that a launch would ignore or could not keep, refused before
any process starts: a ``[fault_tolerance]`` key set while fault tolerance is off (every key),
groups whose batches together exceed the data, and ``--dry-run`` with a lighthouse missing or
silent, as the launch refuses it."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trainer.config import FaultTolerance, load_config
from trainer.entry.job import Request, describe_job, prepare
from trainer.runtime.errors import ConfigError, DataError

pytest.importorskip("torchft")


@pytest.mark.parametrize(
    "key", [f.name for f in dataclasses.fields(FaultTolerance) if f.name != "enable"], ids=lambda key: key
)
def test_every_fault_tolerance_key_set_without_enable_is_refused_naming_it(key):
    default = FaultTolerance.__dataclass_fields__[key].default
    value = "http://h:29510" if isinstance(default, str) else str(default + 1)
    with pytest.raises(
        ConfigError, match=re.escape(f"`fault_tolerance.{key}` = ") + ".* `fault_tolerance.enable` is off"
    ):
        load_config([f"--fault_tolerance.{key}", value])


def test_fault_tolerance_keys_at_their_defaults_without_enable_are_accepted():
    defaults = [f"--fault_tolerance.{f.name}={f.default}" for f in dataclasses.fields(FaultTolerance)]
    assert load_config(defaults).fault_tolerance == FaultTolerance()


def test_a_job_whose_groups_together_exceed_the_data_is_refused(tmp_path):
    """864 samples of 2048 tokens hold one group's batch of 512, not two groups' 1024."""
    argv = [
        *("--training.seq_len", "2048", "--training.global_batch_size", "512", "--training.local_batch_size", "8"),
        *("--validation.enable=false", "--job.dump_folder", str(tmp_path)),
    ]
    assert len(prepare(argv, 1, local_ranks=1, memory=False).dataset) == 864
    groups = ["--fault_tolerance.enable", "--fault_tolerance.group_count", "2", "--fault_tolerance.lighthouse", "h:1"]
    with pytest.raises(DataError, match=re.escape("fewer than one global batch of 1024 (2 replica groups of 512)")):
        prepare([*argv, *groups], 1, local_ranks=1, memory=False)


@pytest.mark.parametrize(
    "address, expected",
    [
        ("http://127.0.0.1:1", "cannot reach the torchft lighthouse at 'http://127.0.0.1:1' ("),
        ("", "`fault_tolerance.enable` needs the torchft lighthouse's address"),
        (None, ""),
    ],
    ids=["unreachable", "unset", "answering"],
)
def test_dry_run_looks_at_the_lighthouse_as_the_launch_does(
    address, expected, lighthouse, monkeypatch, capsys, tmp_path
):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    argv = ["--fault_tolerance.enable", "--fault_tolerance.group_count", "2", "--job.dump_folder", str(tmp_path)]
    argv += [
        "--fault_tolerance.connect_timeout_seconds",
        "1",
        "--fault_tolerance.lighthouse",
        lighthouse if address is None else address,
    ]
    request = Request(mode="dry_run", argv=argv)
    if expected:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            describe_job(request, 1, 1)
    else:
        describe_job(request, 1, 1)
    shown = capsys.readouterr().out
    assert "replica groups: this is group 0 of 2" in shown  # the plan is shown either way
    assert (f"lighthouse: {lighthouse} answers" in shown) == (address is None), shown
