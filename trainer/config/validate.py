"""Every configuration rule that needs no world size, once: each field's limits, declared in the
schema and checked here by one loop, then the rules that tie fields together.

Rules that need the world size or the model's shape live in ``trainer/planning/job_plan.py`` (and the
parallelisms' own constraints beside them, in ``parallelisms/parallelize.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any
from urllib.parse import urlsplit

from trainer.config.choices import MOE_FAMILIES, PACKED_DATASET_KINDS
from trainer.config.fault_tolerance_section import FaultTolerance
from trainer.config.fields import FloatList
from trainer.config.limits import Limits
from trainer.config.schema import FIELDS, JobConfig, Training
from trainer.runtime.errors import ConfigError


def validate(config: JobConfig) -> None:
    """Checks that need no world size (the mesh is checked by ``trainer/planning/job_plan.py``)."""
    for key, (typ, f) in FIELDS.items():
        section, name = key.split(".")
        _check_value(key, typ, f.metadata["limits"], getattr(getattr(config, section), name))
    _urls(config)
    _muon(config)
    _training(config)
    _activation_checkpoint(config)
    _checkpoint(config)
    _validation(config)
    _moe(config)
    _fault_tolerance(config)


BIAS_UPDATE_RATE_CAUTION = 0.1
BALANCE_LOSS_WEIGHT_CAUTION = 1.0


def cautions(config: JobConfig) -> list[str]:
    """Values inside their range that no run would want, each with the reason: the job runs (a
    study may mean them), and its start report and ``--dry-run`` say what they do."""
    moe, found = config.moe, []
    if config.model.name in MOE_FAMILIES and moe.bias_update_rate > BIAS_UPDATE_RATE_CAUTION:
        found.append(
            f"`moe.bias_update_rate` = {moe.bias_update_rate:g} moves a routing bias by up to twice that each step, "
            "against router scores in [0, 1]: within a few steps the biases, not the router, choose every "
            "token's experts (DeepSeek-V3 uses 0.001)."
        )
    if config.model.name in MOE_FAMILIES and moe.balance_loss_weight > BALANCE_LOSS_WEIGHT_CAUTION:
        found.append(
            f"`moe.balance_loss_weight` = {moe.balance_loss_weight:g} weighs a balancing loss of about 1 per layer "
            "against the language model's 2 to 10: the gradient serves balance more than language "
            "(usual weights are 0.0001 to 0.01)."
        )
    return found


def _check_value(key: str, typ: type, limits: Limits | None, value: Any) -> None:
    """The schema's declared limits, and finiteness for every float: an infinite or NaN value
    (``--optimizer.lr inf``) would train and checkpoint garbage."""
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"`{key}` must be a finite number, got {value}.")
    if typ is FloatList and not all(math.isfinite(item) for item in value):
        raise ConfigError(f"`{key}` must hold finite numbers, got {list(value)}.")
    if limits is None:
        return
    if typ is FloatList:
        if not all(limits.admits(item) for item in value):
            raise ConfigError(f"`{key}` must all be {limits.describe()}, got {list(value)}.")
    elif not limits.admits(value):
        raise ConfigError(f"`{key}` must be {limits.describe()}, got {value}.")


URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
URL_KEYS = ("checkpoint.folder", "checkpoint.initial_load_path")
"""The path settings that may name an object store (fsspec URLs: ``trainer/checkpoint/location.py``)."""


def is_url(path: str) -> bool:
    return bool(URL.match(path))


def _urls(config: JobConfig) -> None:
    """A URL in another path key would be taken as a local folder (``s3://b`` -> ``./s3:/b``) and
    the files lost with the machine; one with credentials would write them into config.toml."""
    for key in FIELDS:
        section, name = key.split(".")
        if not name.endswith(("_path", "folder")):
            continue
        value = getattr(getattr(config, section), name)
        for path in value if isinstance(value, tuple) else (value,):
            if not (isinstance(path, str) and is_url(path)):
                continue
            if key not in URL_KEYS:
                raise ConfigError(
                    f"`{key}` = {path!r} is a URL: only {' and '.join(f'`{k}`' for k in URL_KEYS)} may name an "
                    "object store; copy the file to a local disk (or mount the bucket) and give its path."
                )
            if "@" in urlsplit(path).netloc:
                raise ConfigError(
                    f"`{key}` holds credentials in its URL, which would be written to config.toml and the logs: "
                    "give them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for S3, "
                    "GOOGLE_APPLICATION_CREDENTIALS for GCS) or the store's own configuration, and the URL without them."
                )


def _muon(config: JobConfig) -> None:
    coefficients = config.optimizer.ns_coefficients
    if len(coefficients) != 3:
        raise ConfigError(
            f"`optimizer.ns_coefficients` holds {len(coefficients)} numbers, {list(coefficients)}: the Newton–Schulz "
            "iteration takes three (a, b, c), e.g. `--optimizer.ns_coefficients 3.4445,-4.7750,2.0315`."
        )


def _training(config: JobConfig) -> None:
    training = config.training
    _mixture(training)
    if training.document_mask and training.dataset not in PACKED_DATASET_KINDS:
        raise ConfigError(
            f"`training.document_mask` separates the documents packed into a sample, but "
            f"`training.dataset` = {training.dataset!r} holds one example per sample: there is "
            f"nothing to mask. Turn `training.document_mask` off, or use a packed kind "
            f"({', '.join(PACKED_DATASET_KINDS)})."
        )


def _mixture(training: Training) -> None:
    paths, weights = training.dataset_path, training.dataset_weights
    if weights and len(weights) != len(paths):
        raise ConfigError(
            f"`training.dataset_weights` has {len(weights)} weight(s) for {len(paths)} `training.dataset_path`(s); "
            "give one weight per path, in the same order (or none for equal shares)."
        )
    if len(set(paths)) != len(paths):
        raise ConfigError(f"`training.dataset_path` names a path twice: {list(paths)}; give each dataset once.")


def _activation_checkpoint(config: JobConfig) -> None:
    checkpointing = config.activation_checkpoint
    if checkpointing.mode == "selective" and checkpointing.selective_ac_option != "op":
        option = checkpointing.selective_ac_option
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"`activation_checkpoint.selective_ac_option` must be `op` or a positive integer k "
                f"(checkpoint every k-th block), got {option!r}."
            )


def _checkpoint(config: JobConfig) -> None:
    checkpoint = config.checkpoint
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_path:
        raise ConfigError(
            "`checkpoint.initial_load_in_hf` needs `checkpoint.initial_load_path` (the Hugging Face folder)."
        )
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        raise ConfigError(
            "`checkpoint.initial_load_in_hf` loads weights only; set `checkpoint.initial_load_model_only` to true."
        )


def _validation(config: JobConfig) -> None:
    validation, training = config.validation, config.training
    if validation.enable and validation.seq_len > training.seq_len:
        raise ConfigError(
            f"`validation.seq_len` = {validation.seq_len} must be in [1, `training.seq_len` = {training.seq_len}] "
            "(the model's RoPE table is sized for training), or -1 for the training length."
        )


def _moe(config: JobConfig) -> None:
    moe = config.moe
    if moe.balance_loss_layers == "pooled" and moe.balance_loss_scope != "global_batch":
        raise ConfigError(
            f"`moe.balance_loss_layers` = 'pooled' counts the expert frequencies over every layer of the whole "
            f"step, but `moe.balance_loss_scope` = {moe.balance_loss_scope!r} counts them per rank-local part; use "
            f"`moe.balance_loss_scope` = 'global_batch' or `moe.balance_loss_layers` = 'per_layer'."
        )


def _fault_tolerance(config: JobConfig) -> None:
    """What a replica group needs that its own mesh cannot check; torchft's presence is checked
    with the mesh (``trainer/planning/job_plan.py``)."""
    ft = config.fault_tolerance
    if not ft.enable:
        _ignored_without_enable(ft)
        return
    if ft.replica_id >= ft.group_count:
        raise ConfigError(
            f"`fault_tolerance.replica_id` = {ft.replica_id} must be below `fault_tolerance.group_count` = "
            f"{ft.group_count}: each group reads its own data shard."
        )
    if ft.min_replica_size > ft.group_count:
        raise ConfigError(
            f"`fault_tolerance.min_replica_size` = {ft.min_replica_size} exceeds `fault_tolerance.group_count` = "
            f"{ft.group_count}: no step could ever commit."
        )
    if config.debug.layout_invariant:
        raise ConfigError(
            "`debug.layout_invariant` fixes the order of every sum inside one job; the sum over replica groups "
            "is outside it: turn off one of `debug.layout_invariant` and `fault_tolerance.enable`."
        )


def _ignored_without_enable(ft: FaultTolerance) -> None:
    """A ``[fault_tolerance]`` key set while fault tolerance is off would change nothing: refused,
    so that a job meant to be one replica group never trains alone as a plain job."""
    for f in dataclasses.fields(ft):
        if f.name != "enable" and getattr(ft, f.name) != f.default:
            raise ConfigError(
                f"`fault_tolerance.{f.name}` = {getattr(ft, f.name)!r} is set but `fault_tolerance.enable` is off, so "
                "it would change nothing: set `fault_tolerance.enable` to run this job as a replica group, or drop it."
            )
