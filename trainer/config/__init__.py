"""The job configuration: ``schema`` (what can be set), ``parser`` (TOML and command line),
``validate`` (the rules). The names below are the package's public API."""

from trainer.config.parser import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    REPO_ROOT,
    changed_settings,
    help_text,
    load_config,
    load_toml,
    parse_mesh,
    resolve_config_path,
    resolve_path,
    to_toml,
)
from trainer.config.schema import (
    FIELDS,
    MESH_DIMS,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    ConfigError,
    Debug,
    FloatList,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    StrList,
    Training,
    Validation,
    type_name,
)
from trainer.config.validate import validate

__all__ = [
    "CONFIG_DIR", "DEFAULT_CONFIG", "REPO_ROOT", "changed_settings", "help_text", "load_config", "load_toml", "parse_mesh",
    "resolve_config_path", "resolve_path", "to_toml", "type_name", "FIELDS", "MESH_DIMS",
    "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "ConfigError", "Debug", "FloatList", "Job", "JobConfig",
    "LRScheduler", "Metrics", "Model", "Optimizer", "Parallelism", "Profiling", "StrList", "Training", "Validation",
    "validate",
]
