"""The Mixture-of-Experts settings a user can give, tried through the entry point as a user would:
values a float32 run cannot honour are refused in one line naming the key, absurd finite ones run
with a one-line warning saying why, settings the job's layout would ignore are refused instead of
printed as assumed, and other trainers' keys say what meshtrain does instead."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, cautions, load_config
from trainer.config.foreign_keys import FOREIGN_KEYS
from trainer.entry.launch import main as launch_main
from trainer.planning.job_plan import resolve_job

DEBUG_MOE = ["--config", "debug_moe.toml", "--training.steps", "2"]
DENSE = ["--config", "debug_model.toml", "--training.steps", "2"]


def dry_run(monkeypatch, tmp_path, capsys, ngpu: int, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("NGPU", str(ngpu))
    monkeypatch.chdir(tmp_path)
    code = launch_main([*argv, "--dry-run", "--job.dump_folder", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    return code, out, err


def refused_in_one_line(code: int, err: str, *names: str) -> None:
    assert code == 2 and err.count("\n") == 1 and "config error" in err and "Traceback" not in err, err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("moe.balance_loss_weight", "1e300"),  # overflowed float32 after launch, naming no key
        ("moe.balance_loss_weight", "1e10"),
        ("moe.bias_update_rate", "1e300"),  # made every expert_bias NaN, and saved them
        ("moe.bias_update_rate", "1e8"),  # a float32 bias this large no longer sees the router's scores
    ],
)
def test_moe_values_a_float32_run_cannot_honour_are_refused_naming_the_key(monkeypatch, tmp_path, capsys, key, value):
    code, _, err = dry_run(monkeypatch, tmp_path, capsys, 2, *DEBUG_MOE, f"--{key}", value)
    refused_in_one_line(code, err, f"`{key}` must be in [0, ")


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("moe.balance_loss_weight", "1e6", "the gradient serves balance more than language"),
        ("moe.balance_loss_weight", "5", "the gradient serves balance more than language"),
        ("moe.bias_update_rate", "1e6", "the biases, not the router, choose"),
        ("moe.bias_update_rate", "0.5", "the biases, not the router, choose"),
    ],
)
def test_absurd_moe_values_run_with_a_one_line_warning(monkeypatch, tmp_path, capsys, key, value, reason):
    code, out, _ = dry_run(monkeypatch, tmp_path, capsys, 2, *DEBUG_MOE, f"--{key}", value)
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1 and f"`{key}` = {float(value):g}" in warnings[0], out
    assert reason in warnings[0]


def test_the_usual_moe_values_and_a_dense_model_get_no_warning():
    for argv in (DEBUG_MOE, [*DEBUG_MOE, "--moe.bias_update_rate", "0.1", "--moe.balance_loss_weight", "1"], DENSE):
        assert cautions(load_config(argv)) == [], argv


@pytest.mark.parametrize(
    ("ngpu", "argv", "names"),
    [
        # A MoE whose blocks are all dense: it ran and logged `balance loss: nan`.
        (
            2,
            [*DEBUG_MOE, "--model.n_layers", "1", "--mesh", "dp_shard=2,ep=2"],
            ["`model.n_layers` = 1", "no MoE layer"],
        ),
        (1, [*DEBUG_MOE, "--model.n_layers", "1"], ["`model.n_layers` = 1", "no MoE layer"]),
        # The routing imbalance on one expert-parallel rank or a dense model: printed as assumed.
        (2, [*DEBUG_MOE, "--target.routing_imbalance", "1.5"], ["--target.routing_imbalance 1.5", "= 1 one rank"]),
        (2, [*DENSE, "--target.routing_imbalance", "2"], ["--target.routing_imbalance 2", "dense"]),
        # The [moe] keys on a dense model.
        (2, [*DENSE, "--moe.balance_loss_weight", "0.01"], ["`moe.balance_loss_weight`", "dense"]),
        (2, [*DENSE, "--moe.bias_update_rate", "0.01"], ["`moe.bias_update_rate`", "dense"]),
        (2, [*DENSE, "--moe.balance_loss_scope", "sequence"], ["`moe.balance_loss_scope`", "dense"]),
    ],
)
def test_settings_the_layout_would_ignore_are_refused(monkeypatch, tmp_path, capsys, ngpu, argv, names):
    code, out, err = dry_run(monkeypatch, tmp_path, capsys, ngpu, *argv)
    refused_in_one_line(code, err, *names)
    assert "routing_imbalance" not in out  # never printed as assumed


def test_the_routing_imbalance_applies_under_expert_parallelism(monkeypatch, tmp_path, capsys):
    code, out, err = dry_run(
        monkeypatch, tmp_path, capsys, 4, *DEBUG_MOE, "--mesh", "dp_shard=4,ep=2", "--target.routing_imbalance", "1.5"
    )
    assert code == 0 and "assumed to receive 1.5x the average" in out, err


def test_a_moe_with_one_moe_layer_still_plans():
    assert resolve_job(load_config([*DEBUG_MOE, "--model.n_layers", "2", "--mesh", "dp_shard=2,ep=2"]), 2).dims.ep == 2


@pytest.mark.parametrize("key", sorted(FOREIGN_KEYS))
def test_other_trainers_keys_say_what_we_do_instead(key):
    """Every key of the table, as a command-line flag in the `[moe]` section and in its own
    spelling with dashes: the answer, never a guess at a nearby key."""
    for flag in (f"--moe.{key}", f"--parallelism.{key.replace('_', '-')}"):
        with pytest.raises(ConfigError) as caught:
            load_config([flag, "1"])
        message = str(caught.value)
        assert FOREIGN_KEYS[key] in message and "Did you mean" not in message and "\n" not in message


def test_the_dropless_answer_through_the_entry_point(monkeypatch, tmp_path, capsys):
    code, _, err = dry_run(monkeypatch, tmp_path, capsys, 2, *DEBUG_MOE, "--moe.capacity_factor", "1.25")
    refused_in_one_line(code, err, "`moe.capacity_factor`", "dropless", "every token reaches its top-k experts")
    assert "model.flavor" not in err  # the old far-fetched hint


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("training.lr", "`optimizer.lr`"),  # the same name in another section
        ("parallelism.tp", "`parallelism.tensor_parallel_degree` (or `--mesh tp=N`)"),
        ("training.batch_size", "`training.local_batch_size`"),
        ("moe.topk_experts", None),  # nothing close: no guess
        ("moe.aux_loss", None),
        ("training.warmup", None),
    ],
)
def test_unknown_keys_get_a_hint_only_when_close(key, hint):
    with pytest.raises(ConfigError) as caught:
        load_config([f"--{key}", "1"])
    message = str(caught.value)
    if hint is None:
        assert "Did you mean" not in message and "--help" in message, message
    else:
        assert f"Did you mean {hint}?" in message, message
