"""The configuration: TOML + command line into one typed tree, and every mistake reported
before any process group exists, naming the key (and fast, from the real entry point). Each
key's value checks and the TOML round trip are in test_config_values.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from config_helpers import write

from trainer.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    FIELDS,
    ConfigError,
    JobConfig,
    help_text,
    load_config,
    parse_mesh,
    resolve_config_path,
)
from trainer.entry.worker import main
from trainer.planning.job_plan import resolve_job

ROOT = Path(__file__).resolve().parent.parent
FAST_EXIT_S = 90.0
"""A config error exits long before this; a process group waiting for its peers would wait far longer."""


# --------------------------------------------------------------------------------------------
# Command-line forms
# --------------------------------------------------------------------------------------------


def test_value_as_next_token_or_after_equals():
    assert load_config(["--training.steps", "7"]).training.steps == 7
    assert load_config(["--training.steps=7"]).training.steps == 7
    assert load_config(["--optimizer.lr", "1e-3"]).optimizer.lr == pytest.approx(1e-3)
    assert load_config(["--job.description=a=b"]).job.description == "a=b"
    # A negative number is a value, not an option.
    assert load_config(["--parallelism.data_parallel_shard_degree", "-1"]).parallelism.data_parallel_shard_degree == -1


def test_bool_forms():
    assert load_config([]).metrics.disable_color_printing is False
    assert load_config(["--metrics.disable_color_printing"]).metrics.disable_color_printing is True
    assert load_config(["--metrics.enable_tensorboard=false"]).metrics.enable_tensorboard is False
    assert load_config(["--metrics.enable_tensorboard=true"]).metrics.enable_tensorboard is True
    assert load_config(["--metrics.enable_tensorboard", "false"]).metrics.enable_tensorboard is False
    assert load_config(["--metrics.enable_tensorboard", "False"]).metrics.enable_tensorboard is False
    assert load_config(["--debug.deterministic", "true"]).debug.deterministic is True
    # A bare flag followed by another option: the flag is true and the next option still applies.
    c = load_config(["--metrics.disable_color_printing", "--training.steps", "3"])
    assert c.metrics.disable_color_printing is True and c.training.steps == 3
    with pytest.raises(ConfigError, match="metrics.enable_tensorboard"):
        load_config(["--metrics.enable_tensorboard=yes"])


def test_dashes_in_keys():
    assert load_config(["--training.local-batch-size", "3"]).training.local_batch_size == 3
    assert load_config(["--training.local-batch-size=5"]).training.local_batch_size == 5
    assert load_config(["--training.defer-gradient-reduction"]).training.defer_gradient_reduction is True


def test_missing_value_and_stray_argument():
    with pytest.raises(ConfigError, match="training.steps"):
        load_config(["--training.steps"])
    with pytest.raises(ConfigError, match="steps"):
        load_config(["steps=3"])
    with pytest.raises(ConfigError, match="--config"):
        load_config(["--config"])


# --------------------------------------------------------------------------------------------
# Precedence and --config
# --------------------------------------------------------------------------------------------


def test_defaults_come_from_the_debug_config():
    c = load_config([])
    assert c.model.flavor == "debugmodel"
    assert c.training.steps == 60 and c.training.seq_len == 128  # debug_model.toml
    assert c.optimizer.beta1 == 0.9  # not in the file: the dataclass default
    assert load_config(["--config", str(DEFAULT_CONFIG)]) == c


def test_precedence_defaults_toml_mesh_cli(tmp_path: Path):
    path = write(
        tmp_path,
        """
[training]
steps = 11
seq_len = 64
[parallelism]
data_parallel_replicate_degree = 4
data_parallel_shard_degree = 3
""",
    )
    c = load_config(["--config", path])
    assert c.training.steps == 11 and c.training.seq_len == 64  # file over defaults
    assert c.training.local_batch_size == JobConfig().training.local_batch_size  # default kept
    assert (c.parallelism.data_parallel_replicate_degree, c.parallelism.data_parallel_shard_degree) == (4, 3)

    c = load_config(["--config", path, "--mesh", "dp_replicate=2"])  # mesh over file
    assert (c.parallelism.data_parallel_replicate_degree, c.parallelism.data_parallel_shard_degree) == (2, -1)

    c = load_config(
        [
            "--config",
            path,
            "--mesh",
            "dp_replicate=2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--training.steps",
            "5",
        ]
    )  # CLI over file (agreeing with the mesh is fine)
    assert c.training.steps == 5 and c.training.seq_len == 64
    assert c.parallelism.data_parallel_replicate_degree == 2

    # Order on the command line does not change precedence; the later of two overrides wins.
    c = load_config(["--training.steps", "5", "--config", path, "--training.steps=6"])
    assert c.training.steps == 6


def test_config_by_path_or_bare_name():
    assert resolve_config_path("llama3_8b.toml") == CONFIG_DIR / "llama3_8b.toml"
    assert load_config(["--config", "llama3_8b.toml"]).model.flavor == "8B"
    assert load_config(["--config=llama3_8b.toml"]).model.flavor == "8B"
    assert load_config(["--config", str(CONFIG_DIR / "llama3_70b.toml")]).model.flavor == "70B"


def test_missing_config_lists_available():
    with pytest.raises(ConfigError) as err:
        load_config(["--config", "no_such_config.toml"])
    msg = str(err.value)
    assert "no_such_config.toml" in msg
    for p in CONFIG_DIR.glob("*.toml"):
        assert p.name in msg


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
def test_bundled_configs_load(name: str):
    load_config(["--config", name])


# --------------------------------------------------------------------------------------------
# --mesh
# --------------------------------------------------------------------------------------------


def test_parse_mesh():
    assert parse_mesh("dp_replicate=2,dp_shard=2") == {
        "parallelism.pipeline_parallel_degree": 1,
        "parallelism.data_parallel_replicate_degree": 2,
        "parallelism.data_parallel_shard_degree": 2,
        "parallelism.tensor_parallel_degree": 1,
        "parallelism.context_parallel_degree": 1,
        "parallelism.expert_parallel_degree": 1,
    }
    # Unnamed dimensions are 1, except dp_shard which is inferred (-1).
    assert parse_mesh("tp=2,cp=4") == {
        "parallelism.pipeline_parallel_degree": 1,
        "parallelism.data_parallel_replicate_degree": 1,
        "parallelism.data_parallel_shard_degree": -1,
        "parallelism.tensor_parallel_degree": 2,
        "parallelism.context_parallel_degree": 4,
        "parallelism.expert_parallel_degree": 1,
    }
    assert parse_mesh("")["parallelism.data_parallel_shard_degree"] == -1


def test_mesh_sets_all_degrees(tmp_path: Path):
    path = write(tmp_path, "[parallelism]\ntensor_parallel_degree = 1\ndata_parallel_shard_degree = 8\n")
    c = load_config(["--config", path, "--mesh", "dp_replicate=2,dp_shard=2"])
    assert (c.parallelism.data_parallel_replicate_degree, c.parallelism.data_parallel_shard_degree) == (2, 2)
    c = load_config(["--config", path, "--mesh=dp_replicate=2"])
    assert c.parallelism.data_parallel_shard_degree == -1
    assert c.parallelism.tensor_parallel_degree == 1 and c.parallelism.context_parallel_degree == 1


def test_mesh_contradicting_explicit_key_is_an_error():
    with pytest.raises(ConfigError, match="parallelism.data_parallel_shard_degree") as err:
        load_config(["--mesh", "dp_shard=2", "--parallelism.data_parallel_shard_degree", "4"])
    assert "--mesh" in str(err.value)
    with pytest.raises(ConfigError, match="parallelism.data_parallel_replicate_degree"):
        load_config(["--parallelism.data_parallel_replicate_degree=3", "--mesh", "dp_replicate=2"])


@pytest.mark.parametrize("spec", ["garbage", "dp_shard", "dp=2", "dp_shard=two", "dp_shard=2;tp=1", "fsdp=4"])
def test_garbage_mesh(spec: str):
    with pytest.raises(ConfigError, match="--mesh"):
        load_config(["--mesh", spec])


def test_tensor_and_context_parallel_degrees_are_accepted():
    config = load_config(["--mesh", "dp_shard=2,cp=2,tp=2"])
    assert config.parallelism.tensor_parallel_degree == 2
    assert config.parallelism.context_parallel_degree == 2


# --------------------------------------------------------------------------------------------
# Errors name the key
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["--training.step", "7"], "training.steps"),
        (["--training.step=7"], "training.steps"),
        (["--trainig.seq_len", "7"], "training.seq_len"),
        (["--metrics.enable_tensorbord"], "metrics.enable_tensorboard"),
        (["--training.local-batch-sise", "2"], "training.local_batch_size"),
    ],
)
def test_unknown_cli_key_suggests_nearest(argv, suggestion):
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config(argv)
    assert f"`{suggestion}`" in str(err.value)


def test_unknown_key_without_close_match_points_at_help():
    with pytest.raises(ConfigError, match="--help"):
        load_config(["--zzzz.qqqq", "1"])


def test_unknown_toml_key_suggests_nearest(tmp_path: Path):
    with pytest.raises(ConfigError, match="training.step`") as err:
        load_config(["--config", write(tmp_path, "[training]\nstep = 10\n")])
    assert "`training.steps`" in str(err.value)
    with pytest.raises(ConfigError, match="`optimizer.lr`"):
        load_config(["--config", write(tmp_path, "[optimiser]\nlr = 0.1\n", "b.toml")])
    with pytest.raises(ConfigError, match="steps"):  # a key outside any [section]
        load_config(["--config", write(tmp_path, "steps = 10\n", "c.toml")])


def test_invalid_toml_names_the_file(tmp_path: Path):
    path = write(tmp_path, "[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as err:
        load_config(["--config", path])
    assert path in str(err.value)


@pytest.mark.parametrize(
    "key", ["parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree"]
)
def test_non_positive_degrees_are_rejected_by_plan(key):
    config = load_config([f"--{key}", "-3"])
    with pytest.raises(ConfigError, match=f"`{key}`"):
        resolve_job(config, 4)


# --------------------------------------------------------------------------------------------
# --help
# --------------------------------------------------------------------------------------------


def test_help_mentions_every_key_with_its_doc():
    text = help_text()
    for key, (_, f) in FIELDS.items():
        assert f"--{key} " in text, key
        assert f.metadata["doc"] in text, key
        for choice in f.metadata["choices"] or ():
            assert choice in text
    assert "--mesh" in text and "--config" in text


def test_help_shows_what_this_command_line_gives_and_the_code_default():
    text = help_text(["--config", "llama3_8b.toml", "--training.steps", "7"])
    assert "from llama3_8b.toml" in text
    assert (
        "--model.flavor (str {debugmodel|1B|3B|8B|70B|405B|qwen3_debug|0.6B|1.7B|4B|14B|32B|debugmoe|qwen3_moe_debug|qwen3_30b_a3b|qwen3_235b_a22b|deepseek_v3_debug|16B|671B}) = '8B'; code default 'debugmodel'"
        in text
    )
    assert "--training.steps (int) = 7; code default 10000" in text
    assert "--training.seq_len (int) = 128" in help_text([])  # the default file's, not the code's 2048
    assert "training.stepz" in help_text(["--training.stepz", "1"])  # the error is shown, not raised


def test_config_file_from_the_environment(monkeypatch):
    from trainer.entry.launch import training_argv

    monkeypatch.setenv("CONFIG_FILE", "llama3_8b.toml")
    assert training_argv(["--training.steps", "2"]) == ["--config", "llama3_8b.toml", "--training.steps", "2"]
    assert load_config(training_argv([])).model.flavor == "8B"
    with pytest.raises(ConfigError, match="both CONFIG_FILE=llama3_8b.toml and --config"):
        training_argv(["--config", "debug_model.toml"])
    monkeypatch.delenv("CONFIG_FILE")
    assert training_argv(["--config=x.toml"]) == ["--config=x.toml"]


def test_fields_cover_every_dataclass_field():
    config = JobConfig()
    expected = {
        f"{s.name}.{f.name}" for s in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, s.name))
    }
    assert set(FIELDS) == expected
    assert all(f.metadata.get("doc") for _, f in FIELDS.values())


def test_main_help_returns_zero(capsys):
    assert main(["--help"]) == 0
    assert "training.steps" in capsys.readouterr().out
    assert main(["--training.steps", "3", "-h"]) == 0


# --------------------------------------------------------------------------------------------
# resolve_job(config, world_size)
# --------------------------------------------------------------------------------------------


def test_plan_mesh_product_mismatch_names_degrees_and_ngpu():
    config = load_config(["--parallelism.data_parallel_shard_degree", "3"])
    with pytest.raises(ConfigError) as err:
        resolve_job(config, 4)
    msg = str(err.value)
    assert "parallelism.data_parallel_shard_degree" in msg
    assert "dp_shard=3" in msg and "world size 4" in msg and "NGPU=3" in msg


def test_plan_infers_dp_shard():
    assert resolve_job(load_config([]), 4).dims.dp_shard == 4
    p = resolve_job(load_config(["--mesh", "dp_replicate=2"]), 4)
    assert (p.dims.dp_replicate, p.dims.dp_shard, p.dims.dp, p.dims.hsdp) == (2, 2, 4, True)
    assert resolve_job(load_config(["--parallelism.data_parallel_shard_degree", "0"]), 2).dims.dp_shard == 2


def test_plan_cannot_infer_dp_shard():
    with pytest.raises(ConfigError, match="parallelism.data_parallel_shard_degree") as err:
        resolve_job(load_config(["--mesh", "dp_replicate=2"]), 3)
    assert "NGPU" in str(err.value)


def test_plan_non_dividing_global_batch():
    config = load_config(["--training.global_batch_size", "10", "--training.local_batch_size", "4"])
    with pytest.raises(ConfigError, match="training.global_batch_size") as err:
        resolve_job(config, 1)
    assert "10" in str(err.value)
    # 12 = 4 x 3 on one rank is fine, but not on 2 ranks (per micro-batch 8).
    config = load_config(["--training.global_batch_size", "12", "--training.local_batch_size", "4"])
    assert resolve_job(config, 1).microbatches == 3
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        resolve_job(config, 2)


@pytest.mark.parametrize(
    "argv, world, microbatches, global_batch",
    [
        (["--training.global_batch_size", "16", "--training.local_batch_size", "2"], 4, 2, 16),
        (["--training.global_batch_size", "16", "--training.local_batch_size", "2"], 1, 8, 16),
        (["--training.global_batch_size", "16", "--training.local_batch_size", "4"], 4, 1, 16),
        # HSDP: the replicas read different samples too, dp = 2 x 2 = 4.
        (
            ["--training.global_batch_size", "16", "--training.local_batch_size", "2", "--mesh", "dp_replicate=2"],
            4,
            2,
            16,
        ),
        (
            [
                "--training.global_batch_size",
                "16",
                "--training.local_batch_size",
                "1",
                "--mesh",
                "dp_replicate=2,dp_shard=2",
            ],
            4,
            4,
            16,
        ),
        # -1: no accumulation, global = local x dp.
        (["--training.global_batch_size", "-1", "--training.local_batch_size", "3"], 4, 1, 12),
    ],
)
def test_plan_gradient_accumulation(argv, world, microbatches, global_batch):
    p = resolve_job(load_config(argv), world)
    assert p.microbatches == microbatches
    assert p.global_batch_size == global_batch
    assert p.model_args.max_seq_len == p.config.training.seq_len


# --------------------------------------------------------------------------------------------
# The entry point fails fast
# --------------------------------------------------------------------------------------------


def entry_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--training.step", "7"], "training.steps"),
        (["--training.steps", "abc"], "training.steps"),
        (["--parallelism.data_parallel_shard_degree", "3"], "parallelism.data_parallel_shard_degree"),
        (["--training.global_batch_size", "10", "--training.local_batch_size", "4"], "training.global_batch_size"),
    ],
    ids=["unknown-key", "wrong-type", "mesh-mismatch", "non-dividing-batch"],
)
def test_entry_point_exits_2_fast(argv, key):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.entry.worker", *argv],
        cwd=ROOT,
        env=entry_env(WORLD_SIZE="4"),
        capture_output=True,
        text=True,
        timeout=FAST_EXIT_S,
    )
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr
    assert "config error" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.launcher
def test_run_train_sh_mesh_mismatch_fails_fast():
    proc = subprocess.run(
        ["./run_train.sh", "--parallelism.data_parallel_shard_degree", "4"],
        cwd=ROOT,
        env=entry_env(NGPU="2"),
        capture_output=True,
        text=True,
        timeout=FAST_EXIT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "parallelism.data_parallel_shard_degree" in output
    assert "NGPU=4" in output
    # Checked once by the launcher: one message, no worker started, no torchrun report.
    assert output.count("config error") == 1 and "[rank" not in output and "ChildFailedError" not in output
