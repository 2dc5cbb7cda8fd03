"""The job configuration: TOML file, command-line overrides, one typed tree.

Section and field names follow torchtitan v0.2.2 where a field exists there, so a torchtitan
config reads the same here. Every field carries its documentation (``--help`` prints it), and
every user mistake raises :class:`ConfigError` naming the key and the fix, before any process
group exists: a bad config must fail in seconds, never hang a collective.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "train_configs"
DEFAULT_CONFIG = CONFIG_DIR / "debug_model.toml"


def resolve_path(path: str) -> str:
    """A relative path that does not exist from the working directory is tried from the repo root."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not (REPO_ROOT / p).exists():
        return str(p)
    return str(REPO_ROOT / p)


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key and how to fix it."""


class StrList(tuple):
    """A list of strings: a TOML array, or comma-separated on the command line."""


def _field(default: Any, doc: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "choices": choices})


@dataclass
class Job:
    dump_folder: str = _field("./outputs", "Folder for everything the job writes: resolved config, TensorBoard logs.")
    description: str = _field("", "Free text describing the run; printed at start-up.")


@dataclass
class Model:
    name: str = _field("llama3", "Model family. Only `llama3` exists.", ("llama3",))
    flavor: str = _field(
        "debugmodel",
        "Model size preset.",
        ("debugmodel", "1B", "3B", "8B", "70B", "405B"),
    )
    tokenizer_path: str = _field(
        "assets/tokenizer/shakespeare.model",
        "SentencePiece `.model` file (a relative path is resolved against the repository root "
        "when it does not exist relative to the working directory).",
    )


@dataclass
class Optimizer:
    name: str = _field("AdamW", "Optimizer. Only AdamW exists.", ("AdamW",))
    lr: float = _field(8e-4, "Peak learning rate.")
    beta1: float = _field(0.9, "AdamW beta1.")
    beta2: float = _field(0.95, "AdamW beta2.")
    eps: float = _field(1e-8, "AdamW epsilon.")
    weight_decay: float = _field(0.1, "Decoupled weight decay, applied to matrices only (not norms).")
    implementation: str = _field(
        "auto",
        "AdamW kernel: `fused` (one kernel, GPU), `foreach` (multi-tensor), `for-loop`, or "
        "`auto` (fused on CUDA, foreach elsewhere).",
        ("auto", "fused", "foreach", "for-loop"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = _field(200, "Linear warm-up steps from ~0 to `optimizer.lr`.")
    decay_ratio: float = _field(
        -1.0,
        "Fraction of the steps, at the end of training, over which the LR decays; the steps "
        "between warm-up and decay hold the peak LR. -1 decays over all steps after warm-up.",
    )
    decay_type: str = _field("linear", "Shape of the decay.", ("linear", "sqrt", "cosine"))
    min_lr_factor: float = _field(0.0, "Final LR as a fraction of the peak LR.")


@dataclass
class Training:
    dataset: str = _field(
        "shakespeare",
        "`shakespeare` (packed pre-training text) or `shakespeare_dialogue` (prompt/response "
        "pairs with masked prompts and padding).",
        ("shakespeare", "shakespeare_dialogue"),
    )
    dataset_path: str = _field(
        "", "Your own .txt/.jsonl file or folder for the chosen dataset kind; empty uses the bundled plays."
    )
    local_batch_size: int = _field(8, "Sequences per micro-batch on each data-parallel rank.")
    global_batch_size: int = _field(
        -1,
        "Sequences per optimizer step over all data-parallel ranks and micro-batches. "
        "Gradient accumulation = global / (local x data-parallel degree). -1 means no accumulation.",
    )
    seq_len: int = _field(2048, "Tokens per sequence.")
    max_norm: float = _field(1.0, "Gradient clipping threshold on the true global grad norm; <= 0 disables clipping.")
    steps: int = _field(10000, "Optimizer steps to train.")
    mixed_precision_param: str = _field(
        "auto",
        "Dtype of the parameters FSDP gathers for compute: `bfloat16`, `float32`, or `auto` "
        "(bfloat16 on GPU, float32 on CPU).",
        ("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = _field(
        "float32", "Dtype of gradient reduction across ranks.", ("float32", "bfloat16")
    )
    defer_gradient_reduction: bool = _field(
        False,
        "Skip FSDP's reduce-scatter on all but the last micro-batch: gradients accumulate "
        "unsharded (more memory) and are communicated once per step (less communication).",
    )
    num_workers: int = _field(0, "Data loader worker processes per rank (0 loads in the training process).")
    prefetch_factor: int = _field(2, "Micro-batches each data loader worker prepares ahead (workers > 0 only).")
    peak_flops: float = _field(
        0.0, "Peak dense bf16 FLOP/s of one device, for MFU; 0 looks the GPU up in the built-in table."
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _field(
        1, "HSDP replicas: full model copies, each sharded over `data_parallel_shard_degree` ranks."
    )
    data_parallel_shard_degree: int = _field(
        -1, "FSDP shard degree; -1 infers it as world size / (replicate x tp x cp)."
    )
    tensor_parallel_degree: int = _field(
        1,
        "Tensor-parallel degree: attention heads, feed-forward units and the vocabulary are split "
        "over this many ranks, which see the same tokens (sequence parallel between blocks).",
    )
    context_parallel_degree: int = _field(
        1,
        "Context-parallel degree: each sequence is split over this many ranks (head-tail load "
        "balanced), which also shard the parameters together with dp_shard.",
    )
    context_parallel_backend: str = _field(
        "auto",
        "Attention across context-parallel shards: `ring` (PyTorch's ring attention, CUDA only), "
        "`allgather_kv` (all-gather keys and values, any device), or `auto` (ring on CUDA, "
        "allgather_kv elsewhere).",
        ("auto", "ring", "allgather_kv"),
    )
    context_parallel_rotate_method: str = _field(
        "allgather",
        "How the ring backend moves key/value shards between ranks.",
        ("allgather", "alltoall"),
    )
    fsdp_reshard_after_forward: str = _field(
        "default",
        "Free gathered parameters after forward: `always`, `never` (faster backward, more "
        "memory), or `default` (every block but the last one, whose backward runs at once).",
        ("default", "always", "never"),
    )
    disable_loss_parallel: bool = _field(
        False, "With tensor parallelism, gather the logits instead of a vocabulary-parallel loss."
    )
    enable_async_tensor_parallel: bool = _field(
        False,
        "Overlap tensor-parallel communication with the matmuls (CUDA only; needs "
        "`compile.enable`, since async TP is a torch.compile graph rewrite).",
    )


@dataclass
class Metrics:
    log_freq: int = _field(10, "Log every N steps (and the first and last step).")
    enable_tensorboard: bool = _field(True, "Write TensorBoard scalars (rank 0).")
    save_tb_folder: str = _field("tb", "TensorBoard folder inside `job.dump_folder`; each run gets a timestamped subfolder.")
    disable_color_printing: bool = _field(False, "Plain console output without ANSI colors.")


@dataclass
class ActivationCheckpoint:
    mode: str = _field(
        "none",
        "Recompute activations in backward instead of keeping them: `none`, `full` (every "
        "block), or `selective` (see `selective_ac_option`).",
        ("none", "full", "selective"),
    )
    selective_ac_option: str = _field(
        "op",
        "With `selective`: `op` keeps matmul and attention outputs and recomputes the rest in "
        "every block; an integer k fully checkpoints every k-th block.",
    )


@dataclass
class Compile:
    enable: bool = _field(False, "Compile with torch.compile: each transformer block, and the loss.")
    components: StrList = _field(
        StrList(("model", "loss")), "What to compile when enabled.", ("model", "loss")
    )


@dataclass
class Profiling:
    enable_profiling: bool = _field(False, "Record torch.profiler traces (one per rank).")
    profile_freq: int = _field(10, "Trace one step every N steps (after a warm-up step).")
    save_traces_folder: str = _field(
        "profile_traces", "Folder in `job.dump_folder`: `iteration_N/rankR_trace.json`, for Perfetto or chrome://tracing."
    )
    enable_memory_snapshot: bool = _field(
        False, "Record CUDA memory history; dump a snapshot every `profile_freq` steps and on out-of-memory (GPU only)."
    )
    save_memory_snapshot_folder: str = _field(
        "memory_snapshot", "Folder in `job.dump_folder` for `rankR_memory_snapshot.pickle` files (open at pytorch.org/memory_viz)."
    )


@dataclass
class Checkpoint:
    enable: bool = _field(
        False,
        "Save checkpoints and resume from the newest complete one in `checkpoint.folder` at start.",
    )
    folder: str = _field("checkpoint", "Folder inside `job.dump_folder`; each checkpoint is `step-N` in it.")
    interval: int = _field(500, "Save every N steps; the last step is always saved.")
    keep_latest_k: int = _field(10, "Keep the newest k checkpoints, delete older ones; 0 keeps all.")
    load_step: int = _field(-1, "Resume from `step-N` exactly; -1 takes the newest complete checkpoint.")
    exclude_from_loading: StrList = _field(
        StrList(),
        "Parts of the checkpoint not to restore when resuming (e.g. `optimizer,lr_scheduler`).",
        ("model", "optimizer", "lr_scheduler", "dataloader", "train_state"),
    )
    initial_load_path: str = _field(
        "",
        "A checkpoint folder (DCP `step-N`, or a Hugging Face folder with `initial_load_in_hf`) to "
        "start from when there is no checkpoint to resume (also with `checkpoint.enable` off).",
    )
    initial_load_model_only: bool = _field(
        True, "From `initial_load_path`, load the weights only (fresh optimizer, step 0)."
    )
    initial_load_in_hf: bool = _field(
        False, "`initial_load_path` is a Hugging Face Llama folder (config.json + safetensors)."
    )
    last_save_model_only: bool = _field(
        False, "The final checkpoint holds the weights only (an export), cast to `checkpoint.export_dtype`."
    )
    export_dtype: str = _field(
        "float32", "Dtype of a model-only final checkpoint.", ("float32", "bfloat16", "float16")
    )
    async_mode: str = _field(
        "disabled",
        "`async` writes checkpoints in the background while training goes on (at most one in "
        "flight); `disabled` blocks until written.",
        ("disabled", "async"),
    )
    create_seed_checkpoint: bool = _field(
        False,
        "Write the initial weights as `step-0` (model only) on one process and exit; runs on any "
        "mesh then start from exactly these weights.",
    )


@dataclass
class Debug:
    seed: int = _field(0, "Seed of the weight initialisation and the data order; same seed, same run on any mesh.")
    deterministic: bool = _field(False, "Use deterministic kernels (`torch.use_deterministic_algorithms`).")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)


MESH_DIMS = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "tp": "tensor_parallel_degree",
    "cp": "context_parallel_degree",
}


def _fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """All ``section.key`` names with their type and dataclass field."""
    out = {}
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f"{section.name}.{f.name}"] = (hints[f.name], f)
    return out


FIELDS = _fields()


def type_name(typ: type) -> str:
    return "comma-separated list" if typ is StrList else typ.__name__


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.5)
    hint = f" Did you mean `{close[0]}`?" if close else " Run with --help for the list of keys."
    return ConfigError(f"unknown config key `{key}`.{hint}")


def _coerce(key: str, value: Any, from_cli: bool) -> Any:
    """Convert ``value`` to the declared type of ``key`` or raise naming both."""
    typ, f = FIELDS[key]
    bad = ConfigError(f"`{key}` expects {type_name(typ)}, got {value!r}.")
    if typ is bool:
        if isinstance(value, bool):
            result = value
        elif from_cli and str(value).lower() in ("true", "false"):
            result = str(value).lower() == "true"
        else:
            raise bad
    elif typ is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            result = value
        elif from_cli:
            try:
                result = int(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
    elif typ is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            result = float(value)
        elif from_cli:
            try:
                result = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
    elif typ is StrList:
        if from_cli and isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise bad
        result = tuple(value)
    else:
        if not isinstance(value, str):
            raise bad
        result = value
    choices = f.metadata["choices"]
    items = result if isinstance(result, tuple) else (result,)
    for item in items:
        if choices is not None and item not in choices:
            raise ConfigError(f"`{key}` must be one of {', '.join(choices)}; got {item!r}.")
    return result


def _set(config: JobConfig, key: str, value: Any) -> None:
    section, name = key.split(".")
    setattr(getattr(config, section), name, value)


def resolve_config_path(name: str) -> Path:
    """``--config`` takes a path, or a file name inside ``train_configs/``."""
    for candidate in (Path(name), CONFIG_DIR / name):
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config file `{name}` not found (nor in {CONFIG_DIR}); available: {available}.")


def load_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: `{section}` must be a key inside a [section] table.")
    return data


def parse_mesh(spec: str) -> dict[str, int]:
    """``dp_replicate=2,dp_shard=2,tp=2`` -> the four parallelism degrees.

    The shorthand describes the whole mesh: a dimension it does not name is 1, except dp_shard,
    which is then inferred from the world size.
    """
    degrees = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1}
    for part in filter(None, spec.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_DIMS:
            raise ConfigError(
                f"--mesh: cannot read `{part}`; write e.g. `--mesh dp_replicate=2,dp_shard=2,tp=2` "
                f"with dimensions from {', '.join(MESH_DIMS)}."
            )
        try:
            degrees[name] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: `{name}` expects an integer, got {value!r}.") from None
    return {f"parallelism.{MESH_DIMS[k]}": v for k, v in degrees.items()}


def _split_cli(argv: list[str]) -> tuple[str | None, str | None, list[tuple[str, Any]]]:
    """Split argv into (--config, --mesh, [(key, raw value)]) without interpreting values."""
    config_name = mesh = None
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument `{arg}`; options look like `--section.key value`.")
        key, eq, value = arg[2:].partition("=")
        if key in ("config", "mesh"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"--{key} needs a value.")
                i += 1
                value = argv[i]
            if key == "config":
                config_name = value
            else:
                mesh = value
        elif key.replace("-", "_") in FIELDS:
            key = key.replace("-", "_")
            typ = FIELDS[key][0]
            if eq:
                overrides.append((key, value))
            elif typ is bool:
                if i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
                    i += 1
                    overrides.append((key, argv[i]))
                else:
                    overrides.append((key, True))
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"`--{key}` needs a value.")
                i += 1
                overrides.append((key, argv[i]))
        else:
            raise _unknown_key(key)
        i += 1
    return config_name, mesh, overrides


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [--config FILE] [--mesh dp_replicate=R,dp_shard=S,tp=T,cp=C] [--section.key VALUE ...]",
        "",
        "  --config FILE   TOML file, a path or a name inside train_configs/ (default: debug_model.toml)",
        "  --mesh SPEC     the whole mesh at once; unnamed dimensions are 1, dp_shard is inferred",
        "",
        "Every key can be set in the TOML file ([section] key = value) or as --section.key VALUE,",
        "--section.key=VALUE; a bare boolean flag means true.",
    ]
    section = None
    for key, (typ, f) in FIELDS.items():
        sec = key.split(".")[0]
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]"]
        choices = f" {{{'|'.join(f.metadata['choices'])}}}" if f.metadata["choices"] else ""
        default = ",".join(f.default) if typ is StrList else repr(f.default)
        lines.append(f"  --{key} ({type_name(typ)}{choices}, default {default})")
        lines.append(f"      {f.metadata['doc']}")
    return "\n".join(lines)


def load_config(argv: list[str]) -> JobConfig:
    """Defaults < TOML file < ``--mesh`` < ``--section.key`` overrides."""
    config_name, mesh, overrides = _split_cli(argv)
    path = resolve_config_path(config_name) if config_name else DEFAULT_CONFIG
    config = JobConfig()
    for section, values in load_toml(path).items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if key not in FIELDS:
                raise _unknown_key(key)
            _set(config, key, _coerce(key, value, from_cli=False))
    if mesh is not None:
        mesh_values = parse_mesh(mesh)
        for key, value in overrides:
            if key in mesh_values and _coerce(key, value, from_cli=True) != mesh_values[key]:
                raise ConfigError(f"`--{key} {value}` contradicts `--mesh {mesh}`; give one of them.")
        for key, value in mesh_values.items():
            _set(config, key, value)
    for key, value in overrides:
        _set(config, key, _coerce(key, value, from_cli=True))
    validate(config)
    return config


def validate(config: JobConfig) -> None:
    """Checks that need no world size (the mesh is checked by ``ParallelDims``)."""
    t = config.training
    positive = {
        "training.local_batch_size": t.local_batch_size,
        "training.seq_len": t.seq_len,
        "training.steps": t.steps,
        "metrics.log_freq": config.metrics.log_freq,
        "training.prefetch_factor": t.prefetch_factor,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"`{key}` must be >= 1, got {value}.")
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(f"`training.global_batch_size` must be >= 1 or -1, got {t.global_batch_size}.")
    if t.num_workers < 0:
        raise ConfigError(f"`training.num_workers` must be >= 0, got {t.num_workers}.")
    if config.lr_scheduler.warmup_steps < 0:
        raise ConfigError("`lr_scheduler.warmup_steps` must be >= 0.")
    ratio = config.lr_scheduler.decay_ratio
    if ratio != -1.0 and not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"`lr_scheduler.decay_ratio` must be in [0, 1] or -1, got {ratio}.")
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"`activation_checkpoint.selective_ac_option` must be `op` or a positive integer k "
                f"(checkpoint every k-th block), got {ac.selective_ac_option!r}."
            )
    if config.profiling.profile_freq < 2:
        raise ConfigError("`profiling.profile_freq` must be >= 2 (one warm-up step, then the traced step).")
    c = config.checkpoint
    if c.interval < 1:
        raise ConfigError(f"`checkpoint.interval` must be >= 1, got {c.interval}.")
    if c.keep_latest_k < 0:
        raise ConfigError(f"`checkpoint.keep_latest_k` must be >= 0 (0 keeps all), got {c.keep_latest_k}.")
    if c.load_step < -1:
        raise ConfigError(f"`checkpoint.load_step` must be a step >= 0 or -1 (newest), got {c.load_step}.")
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError("`checkpoint.initial_load_in_hf` needs `checkpoint.initial_load_path` (the Hugging Face folder).")
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError(
            "`checkpoint.initial_load_in_hf` loads weights only; set `checkpoint.initial_load_model_only` to true."
        )
    if not 0.0 <= config.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError("`lr_scheduler.min_lr_factor` must be in [0, 1].")
    o = config.optimizer
    non_negative = {"optimizer.lr": o.lr, "optimizer.eps": o.eps, "optimizer.weight_decay": o.weight_decay}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {value}.")
    for key, value in {"optimizer.beta1": o.beta1, "optimizer.beta2": o.beta2}.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"`{key}` must be in [0, 1), got {value}.")


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML, loadable again with ``--config``."""
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, tuple):
                text = "[" + ", ".join(json.dumps(item, ensure_ascii=False) for item in value) + "]"
            elif isinstance(value, str):
                # JSON string escapes are valid TOML basic-string escapes; TOML also forbids DEL.
                text = json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    return "\n".join(lines)
