"""Each key's value checked where it is given: types, choices and declared limits on the command
line and in TOML, booleans in either form, and the resolved config's TOML round trip, naming the key."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from config_helpers import write

from trainer.config import (
    CONFIG_DIR,
    FIELDS,
    MESH_DIMS,
    ConfigError,
    FloatList,
    JobConfig,
    Limits,
    StrList,
    load_config,
    to_toml,
)
from trainer.config.dependent_settings import DEPENDENT

# --------------------------------------------------------------------------------------------
# Types, choices and limits
# --------------------------------------------------------------------------------------------


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
    ``build_training`` (after the process group exists) with torch's "Invalid learning rate"."""
    with pytest.raises(ConfigError, match=f"`{key}`"):
        load_config([f"--{key}", value])


UNBOUNDED = {
    "training.max_norm": "any finite value: <= 0 disables clipping",
    "optimizer.ns_coefficients": "any finite numbers (b is negative by default); validate counts three",
    **{
        f"parallelism.{name}": "a mesh degree, checked by resolve_job() with the world size"
        for name in MESH_DIMS.values()
    },
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
    are accepted. The base is the code's defaults, so no other rule gets in the way (with fault
    tolerance on for its own keys, which are refused without it)."""
    section, name = key.split(".")
    base = write(tmp_path, "[fault_tolerance]\nenable = true\n" if section == "fault_tolerance" else "", "base.toml")
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
            on = feature_on(key)
            assert getattr(getattr(load_config(["--config", base, *on, f"--{key}", text]), section), name) == value


FEATURES = {
    "training.prefetch_factor": ["--training.num_workers", "1"],
    "validation.seq_len": ["--validation.enable", "--training.seq_len", "1048576"],
    "checkpoint.": ["--checkpoint.enable"],
    "validation.": ["--validation.enable"],
    "profiling.": ["--profiling.enable_profiling"],
    "moe.": ["--model.name", "moe", "--model.flavor", "debugmoe"],
    "parallelism.expert_parallel_overlap_chunks": ["--parallelism.expert_parallel_degree", "2"],
    "parallelism.pipeline_parallel_": ["--parallelism.pipeline_parallel_degree", "2"],
    "optimizer.": ["--optimizer.name", "Muon"],
}
"""What turns on the feature of a key that acts only under another (``DEPENDENT``), by prefix."""


def feature_on(key: str) -> list[str]:
    """The settings under which ``key`` acts: :data:`FEATURES`' entry for a key of ``DEPENDENT``
    that the defaults leave unused."""
    if all(rule.unused(JobConfig()) is None for rule in DEPENDENT if key in rule.keys):
        return []
    return next(argv for prefix, argv in FEATURES.items() if key.startswith(prefix))


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
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading",
            "optimizer,lr_scheduler",
            "--compile.enable",
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
