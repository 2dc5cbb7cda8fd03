"""The configuration's schema: every section and field, with its type, default, documentation
and allowed choices or limits. This is the file people read to learn what can be set.

Section and field names follow torchtitan v0.2.2 where a field exists there, so a torchtitan
config reads the same here. ``--help`` and the README's table are generated from these docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config.choices import DATASET_KINDS, MODEL_FLAVORS, TARGET_GPUS
from trainer.config.fault_tolerance_section import FaultTolerance
from trainer.config.fields import FloatList, StrList, fields_by_key, setting
from trainer.config.float8_section import Float8
from trainer.config.limits import MAX_LR, MAX_SEED, MAX_SEQ_LEN, MAX_TIMEOUT_SECONDS, MAX_WEIGHT_DECAY
from trainer.config.moe_section import MoE
from trainer.config.parallelism import Parallelism


@dataclass
class Job:
    dump_folder: str = setting(
        "./outputs",
        "Folder for everything the job writes: resolved config, TensorBoard logs, checkpoints. "
        "One job at a time: a running job holds a lock on it.",
    )
    description: str = setting("", "Free text describing the run; printed at start-up.")


@dataclass
class Machine:
    """The machine a config is sized for, so that planning it needs no environment variables."""

    gpu: str = setting(
        "",
        "The GPU this config is sized for (a `--target-gpu` name: h100, h200, a100, b200); empty: not stated. "
        "`--dry-run` and `--simulate` on a machine without GPUs plan for it when `--target-gpu` is not given.",
        ("", *TARGET_GPUS),
    )
    nodes: int = setting(
        0,
        "Nodes this config is sized for; 0: not stated. `--dry-run` and `--simulate` plan for "
        "`machine.nodes` x `machine.gpus_per_node` ranks when NGPU and NNODES are not set.",
        ge=0,
    )
    gpus_per_node: int = setting(0, "GPUs per node this config is sized for; 0: not stated.", ge=0)


@dataclass
class Model:
    name: str = setting(
        "llama3",
        "Model family: `llama3` or `qwen3` (dense), `moe` (Mixture-of-Experts: the debug MoE, Qwen3-MoE) or "
        "`deepseek_v3` (latent attention, group-limited routing).",
        tuple(MODEL_FLAVORS),
    )
    flavor: str = setting(
        "debugmodel", "Model size preset of the family.", tuple(dict.fromkeys(sum(MODEL_FLAVORS.values(), ())))
    )
    n_layers: int = setting(
        0,
        "Transformer blocks; 0 keeps the flavor's. Fewer blocks keep the flavor's width: a large "
        "shape that fits one GPU, for measuring it or planning it.",
        ge=0,
    )
    tokenizer_path: str = setting(
        "assets/tokenizer/shakespeare.model",
        "Tokenizer file: a SentencePiece `.model`, or a Hugging Face `tokenizer.json` (any `.json` file; "
        'needs `pip install -e ".[hf]"`). A relative path is resolved against the repository root '
        "when it does not exist relative to the working directory.",
    )
    converters: StrList = setting(  # noqa: RUF009 - an immutable tuple
        StrList(),
        "Conversions of the model before parallelising: `float8` trains its linear layers in float8 "
        '(`[float8]`; needs `pip install -e ".[float8]"`).',
        ("float8",),
    )


@dataclass
class Optimizer:
    name: str = setting(
        "AdamW",
        "`AdamW`, or `Muon`: Muon for the blocks' weight matrices (attention, feed-forward, experts), AdamW with "
        "these settings for the rest (docs/muon.md).",
        ("AdamW", "Muon"),
    )
    lr: float = setting(8e-4, "Peak learning rate.", ge=0.0, le=MAX_LR)
    beta1: float = setting(0.9, "AdamW beta1.", ge=0.0, lt=1.0)
    beta2: float = setting(0.95, "AdamW beta2.", ge=0.0, lt=1.0)
    eps: float = setting(1e-8, "AdamW epsilon.", ge=0.0, le=1.0)
    weight_decay: float = setting(
        0.1, "Decoupled weight decay, applied to matrices only (not norms).", ge=0.0, le=MAX_WEIGHT_DECAY
    )
    implementation: str = setting(
        "auto",
        "AdamW kernel: `fused` (one kernel, GPU), `foreach` (multi-tensor), `for-loop`, or "
        "`auto` (fused on CUDA, foreach elsewhere).",
        ("auto", "fused", "foreach", "for-loop"),
    )
    momentum: float = setting(0.95, "Muon's momentum.", ge=0.0, lt=1.0)
    nesterov: bool = setting(True, "Muon steps along the Nesterov momentum.")
    ns_steps: int = setting(5, "Muon's Newton–Schulz iterations.", ge=1, le=99)
    ns_coefficients: FloatList = setting(  # noqa: RUF009 - an immutable tuple
        FloatList((3.4445, -4.7750, 2.0315)),
        "Muon's Newton–Schulz coefficients a, b, c (torch.optim.Muon's defaults).",
    )
    adjust_lr_fn: str = setting(
        "match_rms_adamw",
        "How Muon scales `lr` by a matrix's shape: `match_rms_adamw` (0.2 x sqrt(max(rows, cols)): AdamW's "
        "`lr` and `weight_decay` carry over) or `original` (sqrt(max(1, rows / cols))).",
        ("original", "match_rms_adamw"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = setting(200, "Linear warm-up steps from ~0 to `optimizer.lr`.", ge=0)
    decay_ratio: float = setting(
        -1.0,
        "Fraction of the steps, at the end of training, over which the LR decays, reaching "
        "`min_lr_factor` on the last step; the steps between warm-up and decay hold the peak LR. "
        "-1 decays over all steps after warm-up.",
        ge=0.0,
        le=1.0,
        allowed=(-1.0,),
    )
    decay_type: str = setting("linear", "Shape of the decay.", ("linear", "sqrt", "cosine"))
    min_lr_factor: float = setting(0.0, "Final LR as a fraction of the peak LR.", ge=0.0, le=1.0)


@dataclass
class Training:
    dataset: str = setting(
        "shakespeare",
        "`shakespeare` (packed pre-training text), `shakespeare_dialogue` (prompt/response "
        "pairs with masked prompts and padding) or `chat` (multi-turn `messages`, loss on the "
        "assistant's tokens only).",
        DATASET_KINDS,
    )
    dataset_path: StrList = setting(  # noqa: RUF009 - an immutable tuple
        StrList(),
        "Your own data for the chosen kind: a .txt/.jsonl/.jsonl.gz file, a folder of them, or a folder written "
        "by scripts/prepare_data.py (memory-mapped); empty uses the bundled plays. Several paths (a "
        "TOML array, or comma-separated) train on their mixture, see `training.dataset_weights`.",
    )
    dataset_weights: FloatList = setting(  # noqa: RUF009 - an immutable tuple
        FloatList(),
        "With several `training.dataset_path`s: each one's share of every global batch, in the same "
        "order (normalised to sum to 1); empty gives every dataset the same share.",
        gt=0.0,
    )
    local_batch_size: int = setting(8, "Sequences per micro-batch on each data-parallel rank.", ge=1)
    global_batch_size: int = setting(
        -1,
        "Sequences per optimizer step over all data-parallel ranks and micro-batches. "
        "Gradient accumulation = global / (local x data-parallel degree). -1 means no accumulation.",
        ge=1,
        allowed=(-1,),
    )
    seq_len: int = setting(2048, "Tokens per sequence.", ge=1, le=MAX_SEQ_LEN)
    document_mask: bool = setting(
        False,
        "In packed samples (`shakespeare`), a token attends only to earlier tokens of its own "
        "document, RoPE positions restart at each document's BOS, and the label predicting a "
        "document's BOS from the previous document is ignored (see README, Document masking).",
    )
    loss_chunk_tokens: int = setting(
        -1,
        "Output projection + loss in chunks of this many tokens (each chunk's logits recomputed in "
        "backward); 0: unchunked; -1 (auto): on a GPU unchunked where the job with the whole logits fits in "
        "90% of the memory limit, else chunks of 1024; on the CPU always chunks of 1024. The start report "
        "and `--dry-run` say which and why.",
        ge=0,
        allowed=(-1,),
    )
    max_norm: float = setting(1.0, "Gradient clipping threshold on the true global grad norm; <= 0 disables clipping.")
    steps: int = setting(10000, "Optimizer steps to train.", ge=1)
    max_consecutive_skipped_steps: int = setting(
        20,
        "End the job (non-zero exit) after this many optimizer steps in a row were skipped "
        "(non-finite gradient norm, or no valid label token): the run has diverged or the data "
        "has no labels. 0 never ends it.",
        ge=0,
    )
    mixed_precision_param: str = setting(
        "auto",
        "Dtype of the parameters FSDP gathers for compute: `bfloat16`, `float32`, or `auto` "
        "(bfloat16 on GPU, float32 on CPU).",
        ("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = setting(
        "float32", "Dtype of gradient reduction across ranks.", ("float32", "bfloat16")
    )
    defer_gradient_reduction: bool = setting(
        False,
        "Skip FSDP's reduce-scatter on all but the last micro-batch: gradients accumulate "
        "unsharded (more memory) and are communicated once per step (less communication).",
    )
    check_memory: bool = setting(
        True,
        "Before building the model, estimate each rank's memory and stop (with the settings that "
        "would fit) when it exceeds the GPU's memory, or on CPU the machine's available memory "
        "shared by its ranks; false only prints the estimate.",
    )
    num_workers: int = setting(0, "Data loader worker processes per rank (0 loads in the training process).", ge=0)
    prefetch_factor: int = setting(2, "Micro-batches each data loader worker prepares ahead (workers > 0 only).", ge=1)
    data_timeout_seconds: int = setting(
        300,
        "The longest wait for one micro-batch before the job stops with an error naming the data "
        "loader (a stalled or hung worker, or a read of an unresponsive file system), instead of waiting silently.",
        ge=1,
        le=MAX_TIMEOUT_SECONDS,
    )
    peak_flops: float = setting(
        0.0, "Peak dense bf16 FLOP/s of one device, for MFU; 0 looks the GPU up in the built-in table.", ge=0.0
    )


@dataclass
class Comm:
    init_timeout_seconds: int = setting(
        300,
        "Collective timeout until the first step has finished (process-group start-up, building, "
        "loading a checkpoint, the first step) and for checkpoint saves.",
        ge=1,
        le=MAX_TIMEOUT_SECONDS,
    )
    train_timeout_seconds: int = setting(
        100,
        "Collective timeout from the second step on: a rank that stalls for longer (hung, "
        "stopped, dead) ends the job with an error naming this key instead of a silent hang. "
        "Must exceed the longest step.",
        ge=1,
        le=MAX_TIMEOUT_SECONDS,
    )


@dataclass
class Metrics:
    log_freq: int = setting(10, "Log every N steps (and the first and last step).", ge=1)
    enable_tensorboard: bool = setting(True, "Write TensorBoard scalars (rank 0).")
    enable_wandb: bool = setting(
        False,
        'Also log the scalars to Weights & Biases (rank 0; `pip install -e ".[wandb]"`): wandb\'s environment '
        "(`WANDB_MODE=offline`, `WANDB_PROJECT`, `WANDB_API_KEY`) decides where the run goes.",
    )
    save_tb_folder: str = setting(
        "tb", "TensorBoard folder inside `job.dump_folder`; each run gets a timestamped subfolder."
    )
    disable_color_printing: bool = setting(
        False, "Plain console output without ANSI colors (colors are only used on a terminal)."
    )


@dataclass
class ActivationCheckpoint:
    mode: str = setting(
        "none",
        "Recompute activations in backward instead of keeping them: `none`, `full` (every "
        "block), or `selective` (see `selective_ac_option`).",
        ("none", "full", "selective"),
    )
    selective_ac_option: str = setting(
        "op",
        "With `selective`: `op` keeps the outputs of matmuls, attention and collectives (TP's "
        "reduce-scatters, all-to-alls) and recomputes the rest in every block; an integer k fully "
        "checkpoints every k-th block.",
    )


@dataclass
class Compile:
    enable: bool = setting(False, "Compile with torch.compile: each transformer block, and the loss.")
    components: StrList = setting(StrList(("model", "loss")), "What to compile when enabled.", ("model", "loss"))  # noqa: RUF009
    backend: str = setting(
        "inductor",
        "torch.compile's backend: `inductor` (generated, fused kernels) or `aot_eager` (the same graphs, "
        "recomputation and gradients through AOTAutograd, run by eager kernels: to tell a numerical "
        "difference of the generated kernels from one of the graphs, and much quicker to compile).",
        ("inductor", "aot_eager"),
    )


@dataclass
class Profiling:
    enable_profiling: bool = setting(False, "Record torch.profiler traces (one per rank).")
    profile_freq: int = setting(10, "Trace one step every N steps (after a warm-up step).", ge=2)
    save_traces_folder: str = setting(
        "profile_traces",
        "Folder in `job.dump_folder`: `iteration_N/rankR_trace.json`, for Perfetto or chrome://tracing.",
    )
    enable_memory_snapshot: bool = setting(
        False, "Record CUDA memory history; dump a snapshot every `profile_freq` steps and on out-of-memory (GPU only)."
    )
    save_memory_snapshot_folder: str = setting(
        "memory_snapshot",
        "Folder in `job.dump_folder` for `rankR_memory_snapshot.pickle` files (open at pytorch.org/memory_viz).",
    )


@dataclass
class Checkpoint:
    enable: bool = setting(
        False,
        "Save checkpoints and resume from the newest complete one in `checkpoint.folder` at start.",
    )
    folder: str = setting(
        "checkpoint",
        "Folder inside `job.dump_folder`, or an object store's URL (`s3://bucket/run`, any fsspec protocol: "
        "docs/checkpoints.md); each checkpoint is `step-N` in it.",
    )
    interval: int = setting(500, "Save every N steps; the last step is always saved.", ge=1)
    keep_latest_k: int = setting(
        10, "Keep the newest k checkpoints of the current timeline, delete older ones; 0 keeps all.", ge=0
    )
    load_step: int = setting(
        -1,
        "Roll back to `step-N`: newer checkpoints are moved aside and a new timeline begins; rerunning "
        "with the same value continues that timeline. -1 takes the newest complete checkpoint.",
        ge=0,
        allowed=(-1,),
    )
    exclude_from_loading: StrList = setting(  # noqa: RUF009 - an immutable tuple
        StrList(),
        "Parts of the checkpoint not to restore when resuming (e.g. `optimizer,lr_scheduler`).",
        ("model", "optimizer", "lr_scheduler", "dataloader", "train_state"),
    )
    initial_load_path: str = setting(
        "",
        "A checkpoint folder (DCP `step-N`, local or a URL, or a local Hugging Face folder with "
        "`initial_load_in_hf`) to start from when there is no checkpoint to resume (also with `checkpoint.enable` off).",
    )
    initial_load_model_only: bool = setting(
        True, "From `initial_load_path`, load the weights only (fresh optimizer, step 0)."
    )
    initial_load_in_hf: bool = setting(
        False, "`initial_load_path` is a Hugging Face Llama folder (config.json + safetensors)."
    )
    last_save_model_only: bool = setting(
        False, "The final checkpoint holds the weights only (an export), cast to `checkpoint.export_dtype`."
    )
    export_dtype: str = setting(
        "float32", "Dtype of a model-only final checkpoint.", ("float32", "bfloat16", "float16")
    )
    async_mode: str = setting(
        "disabled",
        "`async` writes checkpoints in the background while training goes on (at most one in "
        "flight); `async_with_pinned_mem` also copies the state to pinned host memory in the background "
        "(CUDA only: the next optimizer step waits for that copy); `disabled` blocks until written.",
        ("disabled", "async", "async_with_pinned_mem"),
    )
    allow_data_change: bool = setting(
        False,
        "Resume although the data or the tokenizer differ from those the checkpoint was trained "
        "on (their fingerprints are compared at resume); the data order then continues at the "
        "checkpoint's step on the new data.",
    )
    create_seed_checkpoint: bool = setting(
        False,
        "Write the initial weights as `step-0` (model only) on one process and exit; runs on any "
        "mesh then start from exactly these weights.",
    )


@dataclass
class Validation:
    enable: bool = setting(
        False, "Evaluate the validation loss during training (`validation/loss`, `validation/perplexity`)."
    )
    dataset: str = setting(
        "", "Dataset kind of the validation set; empty uses `training.dataset`.", ("",) + DATASET_KINDS
    )
    dataset_path: str = setting(
        "",
        "Validation data (a file or folder as for `training.dataset_path`); empty uses the bundled "
        "held-out plays, which training on the bundled plays never sees.",
    )
    freq: int = setting(10, "Validate every this many steps, and after the last step.", ge=1)
    steps: int = setting(
        -1,
        "Validation batches of `validation.local_batch_size` per evaluation, in all (shared among the "
        "data-parallel ranks, so every mesh evaluates the same samples); -1 evaluates the whole set.",
        ge=1,
        allowed=(-1,),
    )
    local_batch_size: int = setting(8, "Validation sequences per batch on each data-parallel rank.", ge=1)
    seq_len: int = setting(
        -1,
        "Tokens per validation sequence; -1 uses `training.seq_len` (at most `training.seq_len`).",
        ge=1,
        le=MAX_SEQ_LEN,
        allowed=(-1,),
    )


@dataclass
class Debug:
    seed: int = setting(
        0,
        "Seed of the weight initialisation and the data order; same seed, same run on any mesh.",
        ge=0,
        le=MAX_SEED,
    )
    deterministic: bool = setting(False, "Use deterministic kernels (`torch.use_deterministic_algorithms`).")
    layout_invariant: bool = setting(
        False,
        "Bit-identical losses, grad norms, weights and optimizer state on every data-parallel layout (FSDP, HSDP, "
        "any accumulation) with the same global batch, `training.local_batch_size` and `training.seq_len`, "
        "resumes included: every sum in one fixed order, one CPU thread per rank, deterministic kernels on CUDA. "
        "Refuses TP, CP, PP, compile, a bfloat16 reduce, `training.defer_gradient_reduction` and the fused AdamW "
        "(see docs/reproducibility.md).",
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    machine: Machine = field(default_factory=Machine)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    moe: MoE = field(default_factory=MoE)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)

    def value(self, key: str) -> Any:
        """The setting ``section.name``, e.g. ``config.value("training.seq_len")``."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)


FIELDS = fields_by_key(JobConfig)
