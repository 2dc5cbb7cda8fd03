"""Every configuration rule that needs no world size, once.

Rules that need the world size or the model's shape live in ``trainer/plan.py`` (and the
parallelisms' own constraints beside them, in ``parallelisms/parallelize.py``).
"""

from __future__ import annotations

import math

from trainer.config.schema import FIELDS, FloatList, JobConfig
from trainer.data.samples import PACKED_KINDS
from trainer.runtime.errors import ConfigError


def validate(config: JobConfig) -> None:
    """Checks that need no world size (the mesh is checked by ``trainer/plan.py``)."""
    _finite(config)
    _training(config)
    _lr_scheduler(config)
    _optimizer(config)
    _activation_checkpoint(config)
    _checkpoint(config)
    _comm(config)
    _validation(config)
    if config.profiling.profile_freq < 2:
        raise ConfigError("`profiling.profile_freq` must be >= 2 (one warm-up step, then the traced step).")


def _finite(config: JobConfig) -> None:
    """An infinite or NaN float (``--optimizer.lr inf``) would train and checkpoint garbage."""
    for key, (typ, _) in FIELDS.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if typ is float and not math.isfinite(value):
            raise ConfigError(f"`{key}` must be a finite number, got {value}.")
        if typ is FloatList and not all(math.isfinite(item) for item in value):
            raise ConfigError(f"`{key}` must hold finite numbers, got {list(value)}.")


def _training(config: JobConfig) -> None:
    training = config.training
    positive = {
        "training.local_batch_size": training.local_batch_size,
        "training.seq_len": training.seq_len,
        "training.steps": training.steps,
        "metrics.log_freq": config.metrics.log_freq,
        "training.prefetch_factor": training.prefetch_factor,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"`{key}` must be >= 1, got {value}.")
    if training.global_batch_size != -1 and training.global_batch_size < 1:
        raise ConfigError(f"`training.global_batch_size` must be >= 1 or -1, got {training.global_batch_size}.")
    _mixture(training)
    non_negative = {
        "training.num_workers": training.num_workers,
        "training.max_consecutive_skipped_steps": training.max_consecutive_skipped_steps,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {value}.")
    if training.document_mask and training.dataset not in PACKED_KINDS:
        raise ConfigError(
            f"`training.document_mask` separates the documents packed into a sample, but "
            f"`training.dataset` = {training.dataset!r} holds one example per sample: there is "
            f"nothing to mask. Turn `training.document_mask` off, or use a packed kind "
            f"({', '.join(PACKED_KINDS)})."
        )


def _mixture(training) -> None:
    paths, weights = training.dataset_path, training.dataset_weights
    if weights and len(weights) != len(paths):
        raise ConfigError(
            f"`training.dataset_weights` has {len(weights)} weight(s) for {len(paths)} `training.dataset_path`(s); "
            "give one weight per path, in the same order (or none for equal shares)."
        )
    if any(weight <= 0 for weight in weights):
        raise ConfigError(
            f"`training.dataset_weights` must all be > 0, got {list(weights)}; drop a dataset's path to leave it out."
        )
    if len(set(paths)) != len(paths):
        raise ConfigError(f"`training.dataset_path` names a path twice: {list(paths)}; give each dataset once.")


def _lr_scheduler(config: JobConfig) -> None:
    schedule = config.lr_scheduler
    if schedule.warmup_steps < 0:
        raise ConfigError("`lr_scheduler.warmup_steps` must be >= 0.")
    if schedule.decay_ratio != -1.0 and not 0.0 <= schedule.decay_ratio <= 1.0:
        raise ConfigError(f"`lr_scheduler.decay_ratio` must be in [0, 1] or -1, got {schedule.decay_ratio}.")
    if not 0.0 <= schedule.min_lr_factor <= 1.0:
        raise ConfigError("`lr_scheduler.min_lr_factor` must be in [0, 1].")


def _optimizer(config: JobConfig) -> None:
    optimizer = config.optimizer
    non_negative = {
        "optimizer.lr": optimizer.lr,
        "optimizer.eps": optimizer.eps,
        "optimizer.weight_decay": optimizer.weight_decay,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {value}.")
    for key, value in {"optimizer.beta1": optimizer.beta1, "optimizer.beta2": optimizer.beta2}.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"`{key}` must be in [0, 1), got {value}.")


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
    if checkpoint.interval < 1:
        raise ConfigError(f"`checkpoint.interval` must be >= 1, got {checkpoint.interval}.")
    if checkpoint.keep_latest_k < 0:
        raise ConfigError(f"`checkpoint.keep_latest_k` must be >= 0 (0 keeps all), got {checkpoint.keep_latest_k}.")
    if checkpoint.load_step < -1:
        raise ConfigError(f"`checkpoint.load_step` must be a step >= 0 or -1 (newest), got {checkpoint.load_step}.")
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_path:
        raise ConfigError(
            "`checkpoint.initial_load_in_hf` needs `checkpoint.initial_load_path` (the Hugging Face folder)."
        )
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        raise ConfigError(
            "`checkpoint.initial_load_in_hf` loads weights only; set `checkpoint.initial_load_model_only` to true."
        )


def _comm(config: JobConfig) -> None:
    comm = config.comm
    for key, value in {
        "comm.init_timeout_seconds": comm.init_timeout_seconds,
        "comm.train_timeout_seconds": comm.train_timeout_seconds,
    }.items():
        if value < 1:
            raise ConfigError(f"`{key}` must be >= 1 second, got {value}.")


def _validation(config: JobConfig) -> None:
    validation, training = config.validation, config.training
    if not validation.enable:
        return
    for key, value in {
        "validation.freq": validation.freq,
        "validation.local_batch_size": validation.local_batch_size,
    }.items():
        if value < 1:
            raise ConfigError(f"`{key}` must be >= 1, got {value}.")
    if validation.steps == 0 or validation.steps < -1:
        raise ConfigError(f"`validation.steps` must be >= 1, or -1 for the whole set; got {validation.steps}.")
    if validation.seq_len != -1 and not 1 <= validation.seq_len <= training.seq_len:
        raise ConfigError(
            f"`validation.seq_len` = {validation.seq_len} must be in [1, `training.seq_len` = {training.seq_len}] "
            "(the model's RoPE table is sized for training), or -1 for the training length."
        )
