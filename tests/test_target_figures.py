"""What a user states of the machine planned for (``--target-gpu``, ``--target.*``) is what every
planning tool plans for: the estimate, its limit and the simulator's advice; and a figure that
cannot describe a machine is one line before anything is planned."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.entry.launch import main as launch_main
from trainer.hardware import GIB
from trainer.planning.job_plan import resolve_job
from trainer.planning.target_figures import LIMITS, OVERRIDES
from trainer.simulation.report import fit_advice
from trainer.simulation.targets import target_named

ONE_B = ["--config", "llama3_1b.toml", "--dry-run", "--target-gpu", "h100"]


@pytest.fixture(autouse=True)
def one_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("NGPU", "1")
    monkeypatch.chdir(tmp_path)  # the dry run's dump folder probe lands here


def dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = launch_main([*ONE_B, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("field", list(OVERRIDES))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "many"])
def test_a_figure_that_is_no_amount_is_one_line_naming_it(capsys, field, value):
    code, out, err = dry_run(capsys, f"--target.{field}", value)
    assert code == 2 and not out
    assert err.count("\n") == 1 and f"--target.{field} {value}" in err


@pytest.mark.parametrize("field", [f for f in LIMITS if LIMITS[f][1] < 1e6])
def test_a_fraction_past_its_range_is_refused(capsys, field):
    code, _, err = dry_run(capsys, f"--target.{field}", str(LIMITS[field][1] * 1.5))
    assert code == 2 and "out of range" in err and err.count("\n") == 1


def test_the_stated_memory_is_the_dry_runs_limit(capsys):
    """The 1B preset needs about 28 GiB: it fits an H100, not one the user says has 20 GiB."""
    assert dry_run(capsys)[0] == 0
    code, out, err = dry_run(capsys, "--target.memory_gib", "20")
    assert code == 2 and "limit 20.00 GiB: one H100 with `--target.memory_gib 20`" in out
    assert "more than one H100 with `--target.memory_gib 20` (20.00 GiB)" in err


def test_figures_alone_plan_for_the_default_gpu_not_this_machine(capsys):
    code, out, _ = (
        launch_main(["--config", "llama3_1b.toml", "--dry-run", "--target.memory_gib", "20"]),
        *capsys.readouterr(),
    )
    assert code == 2 and "one H100 with `--target.memory_gib 20`" in out


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [("runtime_gib", "4", "4.00 GiB runtime"), ("allocator_slack", "0", "0.00 GiB allocator slack")],
)
def test_the_stated_runtime_and_slack_are_the_estimates(capsys, field, value, line):
    code, out, _ = dry_run(capsys, f"--target.{field}", value)
    assert code == 0 and line in out


def test_dry_run_and_simulate_together_are_one_line(capsys):
    assert launch_main(["--dry-run", "--simulate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give one" in err


def test_the_simulators_advice_never_proposes_the_job_it_simulated():
    """The estimate puts the 1B job at about 28 GiB; say the simulation measured 32 against a
    30 GiB GPU. Taken at face value the estimate would propose the very same job (1 process)."""
    plan = resolve_job(load_config(["--config", "llama3_1b.toml"]), 1, "cuda")
    target = target_named("h100", {"memory_gib": "30"}, 1)
    report = {"roles": [{"fits": False, "needed_bytes": 32 * GIB, "pp_stage": 0, "ranks": 1}]}
    advice = fit_advice(plan, target, report)
    assert "dp_shard 1 " not in advice and "dp_shard 2 (2 processes" in advice


def test_presets_plan_for_their_machine_without_environment_variables(monkeypatch, capsys):
    monkeypatch.delenv("NGPU")
    monkeypatch.delenv("NNODES", raising=False)
    assert launch_main(["--config", "llama3_70b.toml", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "the machine the config is sized for: 8 node(s) x 8 H100" in err
    assert "mesh: pp=1 dp_replicate=1 dp_shard=8 cp=1 tp=8 (64 processes)" in out
    assert "one H100's memory" in out


def test_a_preset_launched_on_too_few_gpus_names_its_machine(monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "4")
    assert launch_main(["--config", "llama3_70b.toml", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "This config is sized for 64 GPUs (`machine.*`): launch it with NGPU=8 NNODES=8" in err
