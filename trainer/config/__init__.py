"""The job configuration: ``schema`` (what can be set), ``choices`` (what its choice fields
offer), ``parser`` (TOML and command line), ``validate`` (the rules). The names below are the
package's public API. It imports only the ground floor (``trainer/runtime/errors.py``), never torch
or the data stack, so ``--help`` and any tool can load it anywhere."""

from trainer.config.dependent_settings import acting
from trainer.config.fields import FloatList, StrList, type_name
from trainer.config.limits import Limits
from trainer.config.parser import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    MESH_DIMS,
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
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Debug,
    FaultTolerance,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from trainer.config.validate import cautions, is_url, validate
from trainer.runtime.errors import ConfigError

__all__ = [
    "CONFIG_DIR",
    "DEFAULT_CONFIG",
    "FIELDS",
    "MESH_DIMS",
    "REPO_ROOT",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Debug",
    "FaultTolerance",
    "FloatList",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Limits",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "StrList",
    "Training",
    "Validation",
    "acting",
    "cautions",
    "changed_settings",
    "help_text",
    "is_url",
    "load_config",
    "load_toml",
    "parse_mesh",
    "resolve_config_path",
    "resolve_path",
    "to_toml",
    "type_name",
    "validate",
]
