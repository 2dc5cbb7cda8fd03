"""Settings that act only under another (``trainer/config/dependent_settings.py``), every one of
them: refused in one line naming the key where its feature is off, kept where it is on, and kept
for later when the config file sets it for a feature the command line turns off. A key added to
the table without a case here fails ``test_every_dependent_setting_has_a_case``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli_w

from trainer.config import ConfigError, acting, load_config, to_toml
from trainer.config.dependent_settings import DEPENDENT

MOE = {"model.name": "moe", "model.flavor": "debugmoe"}
EXACT = {**MOE, "moe.balance_loss_weight": 0.01}
HELD = {**EXACT, "activation_checkpoint.mode": "full"}
CHECKPOINT = {"checkpoint.enable": True}


class Case:
    def __init__(self, key: str, value: Any, on: dict[str, Any], off: dict[str, Any], case: str = ""):
        self.key, self.value, self.on, self.off = key, value, on, off
        self.id = f"{key}={value}" + (f" ({case})" if case else "")


MUON = {"optimizer.name": "Muon"}
CASES = [
    Case("optimizer.momentum", 0.9, MUON, {}),
    Case("optimizer.nesterov", False, MUON, {}),
    Case("optimizer.ns_steps", 3, MUON, {}),
    Case("optimizer.ns_coefficients", [3.0, -4.0, 2.0], MUON, {}),
    Case("optimizer.adjust_lr_fn", "original", MUON, {}),
    Case("float8.recipe_name", "rowwise", {"model.converters": ["float8"]}, {}),
    Case("float8.enable_fsdp_float8_all_gather", True, {"model.converters": ["float8"]}, {}),
    Case("float8.precompute_float8_dynamic_scale_for_fsdp", True, {"model.converters": ["float8"]}, {}),
    Case("float8.filter_fqns", ["attention.wk"], {"model.converters": ["float8"]}, {}),
    Case("float8.moe_experts", True, {"model.converters": ["float8"]}, {}),
    Case("moe.bias_update_rate", 0.01, MOE, {}),
    Case("moe.balance_loss_weight", 0.02, MOE, {}),
    Case("moe.balance_loss_scope", "micro_batch", EXACT, MOE),
    Case("moe.balance_loss_layers", "pooled", EXACT, MOE),
    Case("moe.held_forwards", "prepass", EXACT, {**EXACT, "moe.balance_loss_scope": "micro_batch"}, "no exact scope"),
    Case("moe.held_forwards", "device", HELD, MOE, "no balancing loss"),
    Case("moe.held_forwards", "host", HELD, {**HELD, "activation_checkpoint.mode": "selective"}, "selective AC"),
    Case("moe.held_forwards", "device", HELD, {**HELD, "parallelism.pipeline_parallel_degree": 2}, "pipeline"),
    Case("moe.held_forwards", "device", HELD, {**HELD, "training.loss_chunk_tokens": 0}, "whole logits"),
    Case(
        "moe.held_forwards",
        "host",
        HELD,
        {**HELD, "parallelism.tensor_parallel_degree": 2, "parallelism.disable_loss_parallel": True},
        "gathered logits",
    ),
    Case("compile.backend", "aot_eager", {"compile.enable": True}, {}),
    Case("compile.components", ["model"], {"compile.enable": True}, {}),
    Case("activation_checkpoint.selective_ac_option", "2", {"activation_checkpoint.mode": "selective"}, {}),
    Case("parallelism.expert_parallel_overlap_chunks", 3, {"parallelism.expert_parallel_degree": 2}, {}),
    *(
        Case(f"parallelism.pipeline_parallel_{name}", value, {"parallelism.pipeline_parallel_degree": 2}, {})
        for name, value in (
            ("schedule", "GPipe"),
            ("microbatch_size", 2),
            ("layers_per_stage", 2),
            ("first_stage_less_layers", 0),
            ("last_stage_less_layers", 0),
        )
    ),
    Case("parallelism.context_parallel_backend", "allgather_kv", {"parallelism.context_parallel_degree": 2}, {}),
    Case("parallelism.context_parallel_rotate_method", "alltoall", {"parallelism.context_parallel_degree": 2}, {}),
    Case("parallelism.disable_loss_parallel", True, {"parallelism.tensor_parallel_degree": 2}, {}),
    Case(
        "training.loss_chunk_tokens",
        48,
        {},
        {"parallelism.tensor_parallel_degree": 2, "parallelism.disable_loss_parallel": True},
    ),
    Case("training.prefetch_factor", 4, {"training.num_workers": 1}, {}),
    Case("lr_scheduler.decay_type", "cosine", {}, {"lr_scheduler.decay_ratio": 0.0}),
    Case("lr_scheduler.min_lr_factor", 0.5, {}, {"lr_scheduler.decay_ratio": 0.0}),
    *(
        Case(f"checkpoint.{name}", value, CHECKPOINT, {})
        for name, value in (
            ("interval", 7),
            ("keep_latest_k", 3),
            ("load_step", 2),
            ("exclude_from_loading", ["optimizer"]),
            ("last_save_model_only", True),
            ("async_mode", "async"),
            ("folder", "saves"),
            ("allow_data_change", True),
        )
    ),
    Case("checkpoint.folder", "seeds", {"checkpoint.create_seed_checkpoint": True}, {}, "seed checkpoint"),
    Case(
        "checkpoint.allow_data_change",
        True,
        {"checkpoint.initial_load_path": "somewhere", "checkpoint.initial_load_model_only": False},
        {"checkpoint.initial_load_path": "somewhere"},
        "a full initial state",
    ),
    Case("checkpoint.export_dtype", "bfloat16", {**CHECKPOINT, "checkpoint.last_save_model_only": True}, CHECKPOINT),
    Case("checkpoint.initial_load_model_only", False, {"checkpoint.initial_load_path": "somewhere"}, {}),
    *(
        Case(f"validation.{name}", value, {"validation.enable": True}, {})
        for name, value in (
            ("dataset", "chat"),
            ("dataset_path", "held_out.jsonl"),
            ("freq", 7),
            ("steps", 3),
            ("local_batch_size", 2),
            ("seq_len", 16),
        )
    ),
    Case("metrics.save_tb_folder", "board", {}, {"metrics.enable_tensorboard": False}),
    Case("profiling.profile_freq", 5, {"profiling.enable_profiling": True}, {}),
    Case("profiling.profile_freq", 5, {"profiling.enable_memory_snapshot": True}, {}, "memory snapshots"),
    Case("profiling.save_traces_folder", "traces", {"profiling.enable_profiling": True}, {}),
    Case("profiling.save_memory_snapshot_folder", "snapshots", {"profiling.enable_memory_snapshot": True}, {}),
]


def flags(settings: dict[str, Any]) -> list[str]:
    """``settings`` as command-line flags."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    return [f"--{key}={text(value)}" for key, value in settings.items()]


def toml_file(tmp_path: Path, settings: dict[str, Any]) -> str:
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    path = tmp_path / "job.toml"
    path.write_text(tomli_w.dumps(sections))
    return str(path)


def refused(argv: list[str], key: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(argv)
    message = str(caught.value)
    assert message.startswith(f"`{key}` = ") and "would change nothing" in message and "\n" not in message, message
    assert f"drop `{key}`" in message.lower(), message
    return message


def value_of(config: Any, key: str) -> Any:
    section, name = key.split(".")
    value = getattr(getattr(config, section), name)
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_setting_that_would_change_nothing_is_refused_naming_it(tmp_path: Path, case: Case):
    empty = toml_file(tmp_path, {})
    refused(["--config", empty, *flags({**case.off, case.key: case.value})], case.key)
    # The same in one file: a file's setting for a feature the same file leaves off is refused too.
    refused(["--config", toml_file(tmp_path, {**case.off, case.key: case.value})], case.key)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_it_acts_where_its_feature_is_on(tmp_path: Path, case: Case):
    config = load_config(["--config", toml_file(tmp_path, {}), *flags({**case.on, case.key: case.value})])
    assert value_of(config, case.key) == case.value
    assert value_of(acting(config), case.key) == case.value


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_files_setting_is_kept_for_later_when_the_command_line_turns_its_feature_off(tmp_path: Path, case: Case):
    """``--validation.enable=false`` on a file whose ``[validation]`` is set: the run goes on, its
    saved config holds what it does (the key at its default), and loads again."""
    changed = {key: value for key, value in case.off.items() if case.on.get(key) != value}
    turned_off = {key: value for key, value in case.on.items() if key not in case.off}
    defaults = load_config(["--config", toml_file(tmp_path, {})])
    off = {**{key: value_of(defaults, key) for key in turned_off}, **changed}
    config = load_config(["--config", toml_file(tmp_path, {**case.on, case.key: case.value}), *flags(off)])
    assert value_of(config, case.key) == case.value
    saved = acting(config)
    assert value_of(saved, case.key) == value_of(defaults, case.key)
    (tmp_path / "saved.toml").write_text(to_toml(saved))
    assert load_config(["--config", str(tmp_path / "saved.toml")]) == saved
    # Given on the command line itself, it is refused: the user asks for it now.
    refused(["--config", toml_file(tmp_path, case.on), *flags({**off, case.key: case.value})], case.key)


def test_every_dependent_setting_has_a_case():
    assert {key for rule in DEPENDENT for key in rule.keys} == {case.key for case in CASES}


def test_the_bundled_configs_set_nothing_that_would_change_nothing():
    for path in sorted(Path(__file__).resolve().parents[1].glob("train_configs/*.toml")):
        config = load_config(["--config", str(path)])
        assert acting(config) == config, path.name
