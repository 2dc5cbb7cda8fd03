"""The configuration: TOML + command line into one typed tree, and every mistake reported
before any process group exists, naming the key (and fast, from the real entry point)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    FIELDS,
    MESH_DIMS,
    ConfigError,
    FloatList,
    JobConfig,
    Limits,
    StrList,
    help_text,
    load_config,
    parse_mesh,
    resolve_config_path,
    to_toml,
)
from trainer.plan import plan
from trainer.train import main

ROOT = Path(__file__).resolve().parent.parent
FAST_EXIT_S = 90.0
"""A config error exits long before this; a process group waiting for its peers would wait far longer."""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


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
    }
    # Unnamed dimensions are 1, except dp_shard which is inferred (-1).
    assert parse_mesh("tp=2,cp=4") == {
        "parallelism.pipeline_parallel_degree": 1,
        "parallelism.data_parallel_replicate_degree": 1,
        "parallelism.data_parallel_shard_degree": -1,
        "parallelism.tensor_parallel_degree": 2,
        "parallelism.context_parallel_degree": 4,
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
    "argv, key, value",
    [
        (["--training.steps", "abc"], "training.steps", "abc"),
        (["--training.steps=1.5"], "training.steps", "1.5"),
        (["--optimizer.lr", "fast"], "optimizer.lr", "fast"),
        (["--debug.seed", "x1"], "debug.seed", "x1"),
    ],
)
def test_wrong_type_on_cli_names_key_and_value(argv, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    msg = str(err.value)
    assert f"`{key}`" in msg and repr(value) in msg


@pytest.mark.parametrize(
    "toml, key, value",
    [
        ('[training]\nsteps = "ten"\n', "training.steps", "'ten'"),
        ("[training]\nsteps = 1.5\n", "training.steps", "1.5"),
        ("[metrics]\nenable_tensorboard = 1\n", "metrics.enable_tensorboard", "1"),
        ('[metrics]\nenable_tensorboard = "true"\n', "metrics.enable_tensorboard", "'true'"),
        ("[training]\nsteps = true\n", "training.steps", "True"),
        ("[model]\nflavor = 8\n", "model.flavor", "8"),
        ('[optimizer]\nlr = "0.1"\n', "optimizer.lr", "'0.1'"),
    ],
)
def test_wrong_type_in_toml_names_key_and_value(tmp_path: Path, toml, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(["--config", write(tmp_path, toml)])
    msg = str(err.value)
    assert f"`{key}`" in msg and value in msg


def test_int_in_toml_is_accepted_for_a_float(tmp_path: Path):
    c = load_config(["--config", write(tmp_path, "[optimizer]\nlr = 1\n")])
    assert c.optimizer.lr == 1.0 and isinstance(c.optimizer.lr, float)


@pytest.mark.parametrize(
    "argv, key, value",
    [
        (["--model.flavor", "9B"], "model.flavor", "9B"),
        (["--training.dataset", "wikitext"], "training.dataset", "wikitext"),
        (["--optimizer.implementation=fast"], "optimizer.implementation", "fast"),
        (
            ["--parallelism.fsdp_reshard_after_forward", "sometimes"],
            "parallelism.fsdp_reshard_after_forward",
            "sometimes",
        ),
    ],
)
def test_choices(argv, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    msg = str(err.value)
    assert f"`{key}`" in msg and value in msg
    for choice in FIELDS[key][1].metadata["choices"]:
        assert choice in msg


def test_choices_in_toml(tmp_path: Path):
    with pytest.raises(ConfigError, match="model.flavor"):
        load_config(["--config", write(tmp_path, '[model]\nflavor = "9B"\n')])


@pytest.mark.parametrize(
    "key, value",
    [
        ("training.steps", "0"),
        ("training.local_batch_size", "0"),
        ("training.local_batch_size", "-2"),
        ("training.seq_len", "0"),
        ("metrics.log_freq", "0"),
        ("training.prefetch_factor", "0"),
        ("training.global_batch_size", "0"),
        ("training.global_batch_size", "-2"),
        ("training.num_workers", "-1"),
        ("lr_scheduler.warmup_steps", "-1"),
        ("lr_scheduler.decay_ratio", "1.5"),
        ("lr_scheduler.min_lr_factor", "2"),
        ("optimizer.lr", "1e20"),  # every step's update non-finite: all steps skipped
        ("optimizer.lr", "1e38"),  # overflows inside AdamW
        ("training.seq_len", "2097152"),
    ],
)
def test_out_of_range_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        load_config([f"--{key}", value])


@pytest.mark.parametrize(
    "key, value",
    [
        ("optimizer.lr", "-0.001"),
        ("optimizer.eps", "-1e-8"),
        ("optimizer.beta1", "1.5"),
        ("optimizer.beta2", "-0.1"),
        ("optimizer.weight_decay", "-0.1"),
    ],
)
def test_invalid_optimizer_hyperparameters_name_the_key(key, value):
    """Values AdamW rejects must fail in load_config, naming the key, not later inside
    ``build_step_parts`` (after the process group exists) with torch's "Invalid learning rate"."""
    with pytest.raises(ConfigError, match=f"`{key}`"):
        load_config([f"--{key}", value])


UNBOUNDED = {
    "training.max_norm": "any finite value: <= 0 disables clipping",
    **{f"parallelism.{name}": "a mesh degree, checked by plan() with the world size" for name in MESH_DIMS.values()},
}


def test_every_number_declares_its_limits():
    """A new numeric key without limits would accept any typo; the exceptions are deliberate."""
    for key, (typ, f) in FIELDS.items():
        if typ in (int, float, FloatList):
            assert (f.metadata["limits"] is None) == (key in UNBOUNDED), key
        else:
            assert f.metadata["limits"] is None, key


def limit_edges(typ: type, limits: Limits) -> list[tuple[int | float, int | float]]:
    """(just outside, just inside) for every declared bound: the next integer, or the next float."""

    def step(value: int | float, direction: float) -> int | float:
        return value + int(direction) if typ is int else math.nextafter(value, direction * math.inf)

    def outside(value: int | float, direction: float) -> int | float:
        value = step(value, direction)
        while value in limits.allowed:  # a sentinel next to a bound is not "outside"
            value = step(value, direction)
        return value

    edges = []
    if limits.ge is not None:
        edges.append((outside(limits.ge, -1), limits.ge))
    if limits.gt is not None:
        edges.append((limits.gt, step(limits.gt, 1)))
    if limits.le is not None:
        edges.append((outside(limits.le, 1), limits.le))
    if limits.lt is not None:
        edges.append((limits.lt, step(limits.lt, -1)))
    return edges


LIMITED = [
    (key, typ, f.metadata["limits"]) for key, (typ, f) in FIELDS.items() if typ in (int, float) and f.metadata["limits"]
]


@pytest.mark.parametrize("key, typ, limits", LIMITED, ids=[key for key, _, _ in LIMITED])
def test_declared_limits_refuse_just_outside_and_accept_just_inside(tmp_path: Path, key, typ, limits):
    """Every bound of every limited number, on the command line and in a TOML file: the value
    just past it is refused naming the key, the value at (or just inside) it and every sentinel
    are accepted. The base is the code's defaults, so no other rule gets in the way."""
    section, name = key.split(".")
    base = write(tmp_path, "", "base.toml")
    edges = limit_edges(typ, limits)
    assert edges, key
    for bad, good in edges:
        text = str(bad) if typ is int else repr(bad)
        for argv in (
            ["--config", base, f"--{key}", text],
            ["--config", write(tmp_path, f"[{section}]\n{name} = {text}\n", "bad.toml")],
        ):
            with pytest.raises(ConfigError, match=f"^`{key}` must be {re.escape(limits.describe())}, got ") as err:
                load_config(argv)
            assert str(err.value).endswith(f"got {bad}."), err.value
        for value in (good, *limits.allowed):
            text = str(value) if typ is int else repr(value)
            assert getattr(getattr(load_config(["--config", base, f"--{key}", text]), section), name) == value


@pytest.mark.parametrize(
    "limits, text",
    [
        (Limits(ge=1), ">= 1"),
        (Limits(gt=0.0), "> 0"),
        (Limits(le=10.0), "<= 10"),
        (Limits(ge=0.0, lt=1.0), "in [0, 1)"),
        (Limits(gt=0.5, le=2), "in (0.5, 2]"),
        (Limits(ge=1, allowed=(-1,)), ">= 1, or -1"),
        (Limits(ge=0.0, le=1.0, allowed=(-1.0,)), "in [0, 1], or -1"),
    ],
)
def test_limits_describe_themselves(limits, text):
    assert limits.describe() == text


def test_non_boolean_for_a_boolean_key_says_so(tmp_path: Path):
    """Every boolean key, given a value that is not one: the message names the key, says it is
    boolean and which values are accepted (the command line's forms, or a TOML file's)."""
    bools = [key for key, (typ, _) in FIELDS.items() if typ is bool]
    assert len(bools) > 10
    for key in bools:
        section, name = key.split(".")
        for argv in ([f"--{key}", "maybe"], [f"--{key}=maybe"], [f"--{key}", "1", "--training.steps", "2"]):
            with pytest.raises(ConfigError, match=f"`{key}` is boolean: give true or false") as err:
                load_config(argv)
            assert "bare flag" in str(err.value), argv
        for value in ("1", '"yes"', '"true"'):
            with pytest.raises(ConfigError, match=f"`{key}` is boolean: give true or false") as err:
                load_config(["--config", write(tmp_path, f"[{section}]\n{name} = {value}\n")])
            assert "unquoted" in str(err.value)


@pytest.mark.parametrize(
    "key", ["parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree"]
)
def test_non_positive_degrees_are_rejected_by_plan(key):
    config = load_config([f"--{key}", "-3"])
    with pytest.raises(ConfigError, match=f"`{key}`"):
        plan(config, 4)


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
    assert "--model.flavor (str {debugmodel|1B|3B|8B|70B|405B}) = '8B'; code default 'debugmodel'" in text
    assert "--training.steps (int) = 7; code default 10000" in text
    assert "--training.seq_len (int) = 128" in help_text([])  # the default file's, not the code's 2048
    assert "training.stepz" in help_text(["--training.stepz", "1"])  # the error is shown, not raised


def test_config_file_from_the_environment(monkeypatch):
    from trainer.runtime.launch import training_argv

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
# to_toml round trip
# --------------------------------------------------------------------------------------------


def roundtrip(config: JobConfig, tmp_path: Path) -> JobConfig:
    return load_config(["--config", write(tmp_path, to_toml(config), "resolved.toml")])


def test_to_toml_roundtrips_defaults_and_overrides(tmp_path: Path):
    for argv in (
        [],
        ["--config", "llama3_8b.toml"],
        [
            "--optimizer.lr",
            "1.25e-7",
            "--training.peak_flops",
            "9.89e14",
            "--metrics.enable_tensorboard=false",
            "--mesh",
            "dp_replicate=2",
            "--training.global_batch_size",
            "-1",
            "--lr_scheduler.decay_ratio",
            "-1",
            "--training.defer_gradient_reduction",
            "--debug.seed",
            "123456789012",
        ],
    ):
        config = load_config(argv)
        back = roundtrip(config, tmp_path)
        assert back == config
        assert type(back.optimizer.lr) is float and type(back.training.steps) is int


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
def test_to_toml_roundtrips_bundled_configs(tmp_path: Path, name: str):
    config = load_config(["--config", name])
    assert roundtrip(config, tmp_path) == config


def test_to_toml_roundtrips_lists_and_extreme_numbers(tmp_path: Path):
    config = load_config(
        [
            "--training.dataset_path",
            'a.txt,dir/b "quoted".jsonl,C:\\data\\c.txt,é ✓',
            "--training.dataset_weights",
            "0.5,2,1e-300,3",
            "--checkpoint.exclude_from_loading",
            "optimizer,lr_scheduler",
            "--compile.components",
            "loss",
            "--debug.seed",
            str(2**63 - 1),
            "--optimizer.lr",
            "10",
            "--optimizer.eps",
            "5e-324",
            "--training.max_norm",
            "-1.7976931348623157e308",
            "--lr_scheduler.decay_ratio",
            "0.30000000000000004",
        ]
    )
    back = roundtrip(config, tmp_path)
    assert back == config
    assert type(back.training.dataset_path) is StrList and type(back.training.dataset_weights) is FloatList
    assert roundtrip(JobConfig(), tmp_path) == JobConfig()  # empty lists too


@pytest.mark.parametrize(
    "text",
    [
        'say "hi"',
        "C:\\path\\to\\dir",
        'both \\" and \\\\"',
        "trailing backslash \\",
        "unicode: é ✓ 🎭",
        "tab\there",
        "'single'",
    ],
)
def test_to_toml_roundtrips_awkward_strings(tmp_path: Path, text: str):
    config = load_config(["--job.description", text, "--job.dump_folder", text])
    back = roundtrip(config, tmp_path)
    assert back.job.description == text and back.job.dump_folder == text
    assert back == config


@pytest.mark.parametrize("text", ["line one\nline two", "cr\rlf", "bell\x07", "del\x7f"])
def test_to_toml_roundtrips_control_characters(tmp_path: Path, text: str):
    """A multi-line description (e.g. a TOML ``\"\"\"...\"\"\"`` string) must survive the
    resolved config that the trainer saves as ``config.toml``."""
    config = load_config(["--job.description", text])
    assert roundtrip(config, tmp_path) == config


# --------------------------------------------------------------------------------------------
# plan(config, world_size)
# --------------------------------------------------------------------------------------------


def test_plan_mesh_product_mismatch_names_degrees_and_ngpu():
    config = load_config(["--parallelism.data_parallel_shard_degree", "3"])
    with pytest.raises(ConfigError) as err:
        plan(config, 4)
    msg = str(err.value)
    assert "parallelism.data_parallel_shard_degree" in msg
    assert "dp_shard=3" in msg and "world size 4" in msg and "NGPU=3" in msg


def test_plan_infers_dp_shard():
    assert plan(load_config([]), 4).dims.dp_shard == 4
    p = plan(load_config(["--mesh", "dp_replicate=2"]), 4)
    assert (p.dims.dp_replicate, p.dims.dp_shard, p.dims.dp, p.dims.hsdp) == (2, 2, 4, True)
    assert plan(load_config(["--parallelism.data_parallel_shard_degree", "0"]), 2).dims.dp_shard == 2


def test_plan_cannot_infer_dp_shard():
    with pytest.raises(ConfigError, match="parallelism.data_parallel_shard_degree") as err:
        plan(load_config(["--mesh", "dp_replicate=2"]), 3)
    assert "NGPU" in str(err.value)


def test_plan_non_dividing_global_batch():
    config = load_config(["--training.global_batch_size", "10", "--training.local_batch_size", "4"])
    with pytest.raises(ConfigError, match="training.global_batch_size") as err:
        plan(config, 1)
    assert "10" in str(err.value)
    # 12 = 4 x 3 on one rank is fine, but not on 2 ranks (per micro-batch 8).
    config = load_config(["--training.global_batch_size", "12", "--training.local_batch_size", "4"])
    assert plan(config, 1).microbatches == 3
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        plan(config, 2)


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
    p = plan(load_config(argv), world)
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
        [sys.executable, "-m", "trainer.train", *argv],
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
