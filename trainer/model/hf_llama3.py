"""The Hugging Face adapter for our Llama 3: ``LlamaForCausalLM``'s names, layout and ``config.json``.

The names map one to one, but the query and key projections do not: our RoPE (Meta's) rotates
adjacent pairs ``(2j, 2j + 1)`` of each head, Hugging Face's rotates ``(j, j + head_dim / 2)``.
Permuting the output rows of ``wq`` and ``wk`` within each head turns one layout into the other,
so the attention scores, and hence the logits, are unchanged. The permutation only moves
values, so a round trip is bit-exact.

Everything here works on full (unsharded) tensors in one process, without a process group: the
converters run on a laptop, and the trainer shards what they return itself. Reading and writing
folders is ``trainer/checkpoint/hf_folders.py``'s job (safetensors) and
``trainer/checkpoint/folders.py``'s (training checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.model.hf_config_checks import config_problem, our_field
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer
from trainer.model.rope import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
from trainer.runtime.errors import UserError

CONFIG_FILE = "config.json"
MODEL_FIELDS: tuple[str, ...] = ()
"""What a folder's config must match beyond the shapes and ``hf_load.HF_FIELDS`` (``hf_architectures.py``)."""

HF_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
"""The dtypes an export may use, with their ``config.json`` spelling."""

_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_PREVIEW = 8


class InteropError(UserError, ValueError):
    """A checkpoint, folder, config or state dict that cannot be converted; the message says why."""


# --------------------------------------------------------------------------------------------
# Names, shapes and the RoPE permutation
# --------------------------------------------------------------------------------------------


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _expected(args: ModelArgs) -> dict[str, tuple[str, torch.Size]]:
    """Our parameter name -> (Hugging Face name, shape), in the model's order.

    Built from a meta-device ``Transformer`` so the names and shapes cannot drift from the
    model; a parameter added there without a rule here fails loudly (``KeyError``).
    """
    with torch.device("meta"):
        model = Transformer(args)
    return {name: (_hf_name(name), p.shape) for name, p in model.named_parameters()}


def preview_names(names: list[str]) -> str:
    """The first few of ``names`` and how many there are: error messages stay one readable line."""
    shown = ", ".join(names[:_PREVIEW])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > _PREVIEW else ''}]"


def family_hint(missing: list[str], unexpected: list[str]) -> str:
    """What the tensors are when they are the other family's, dense for MoE or MoE for dense: the
    config (``config.json``, ``model_args.json``) or the chosen flavor names the wrong model."""
    if any(".experts." in k for k in unexpected) and not any(".experts." in k for k in missing):
        return (
            " The tensors are a Mixture-of-Experts model's (`experts`) but the config describes a dense one: "
            "the folder's config and weights disagree, or a dense flavor was chosen for an MoE model."
        )
    if any(".experts." in k for k in missing) and not any(".experts." in k for k in unexpected):
        return (
            " The tensors are a dense model's (no `experts`) but the config describes a Mixture-of-Experts: "
            "the config and weights disagree, or an MoE flavor was chosen for a dense model."
        )
    return ""


def _check_state_dict(sd: dict[str, torch.Tensor], expected: dict[str, torch.Size], what: str, args: ModelArgs) -> None:
    """Raise ``InteropError`` naming every missing or unexpected key, or the first wrong shape."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise InteropError(
            f"{what} does not match a {args.n_layers}-layer Llama 3: missing keys {preview_names(missing)}, "
            f"unexpected keys {preview_names(unexpected)}. Convert only the model's weights, with the exact "
            f"parameter names (no wrapper prefixes such as `_orig_mod.`), and the ModelArgs they were made with."
            + family_hint(missing, unexpected)
        )
    for key, shape in expected.items():
        tensor = sd[key]
        if isinstance(tensor, DTensor):
            raise InteropError(
                f"{what}: `{key}` is a sharded DTensor; pass full tensors (`tensor.full_tensor()`, or "
                f"`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`)."
            )
        if tensor.shape != shape:
            raise InteropError(
                f"{what}: `{key}` has shape {tuple(tensor.shape)} but the model args give {tuple(shape)}; "
                f"the weights were made with other ModelArgs ({_describe(args)} here)."
            )


def check_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Raise ``InteropError`` unless ``sd`` holds exactly ``Transformer(args)``'s parameters, full."""
    _check_state_dict(sd, {k: shape for k, (_, shape) in _expected(args).items()}, "the state dict", args)


def _describe(args: ModelArgs) -> str:
    return (
        f"dim={args.dim}, n_layers={args.n_layers}, n_heads={args.n_heads}, n_kv_heads={args.kv_heads}, "
        f"vocab_size={args.vocab_size}, ffn_hidden_dim={args.ffn_hidden_dim}"
    )


def _heads_of(name: str, args: ModelArgs) -> int | None:
    """How many RoPE heads ``name``'s output rows hold, or None when it is not rotated."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows ``(j, pair)`` of each head -> ``(pair, j)``: Meta's pairs ``(2j, 2j+1)`` become HF's ``(j, j+d/2)``."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``_interleaved_to_half``."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full state dict as ``LlamaForCausalLM``'s; tensors keep their dtype and device.

    Unpermuted tensors are returned as they are (no copy), so the result aliases ``sd``.
    """
    expected = _expected(args)
    _check_state_dict(sd, {k: shape for k, (_, shape) in expected.items()}, "the state dict", args)
    return {hf_name: to_hf_tensor(name, sd[name], args) for name, (hf_name, _) in expected.items()}


def hf_layout(args: ModelArgs) -> dict[str, tuple[str, torch.Size]]:
    """Our parameter name -> (Hugging Face name, shape), in the model's order."""
    return _expected(args)


def hf_pieces(args: ModelArgs) -> dict[str, tuple[str, None, torch.Size]]:
    """Hugging Face name -> (our name, None, shape): the export's view, shared with MoE adapters
    whose tensors are slices of ours (``hf_qwen3_moe.hf_pieces``)."""
    return {hf_name: (name, None, shape) for name, (hf_name, shape) in _expected(args).items()}


def to_hf_piece(hf_name: str, tensor: torch.Tensor, args: ModelArgs, pieces: dict[str, Any]) -> torch.Tensor:
    """Hugging Face tensor ``hf_name`` out of our full tensor it comes from."""
    return to_hf_tensor(pieces[hf_name][0], tensor, args)


def to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """One full tensor of ours in Hugging Face's layout (``to_hf_state_dict`` for one entry)."""
    heads = _heads_of(name, args)
    return tensor if heads is None else _interleaved_to_half(tensor, heads)


def from_hf_state_dict(
    hf_sd: dict[str, torch.Tensor], args: ModelArgs, *, tie_word_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict as ours; tensors keep their dtype and device.

    ``tie_word_embeddings`` is ``config.json``'s flag: Llama 3.2 (1B, 3B) shares the embedding
    with ``lm_head`` and its folders omit ``lm_head.weight``. Our output projection is a separate
    matrix, so it starts as a copy of the embedding and the two train apart from there.
    """
    expected = _expected(args)
    if tie_word_embeddings and "lm_head.weight" not in hf_sd and "model.embed_tokens.weight" in hf_sd:
        hf_sd = {**hf_sd, "lm_head.weight": hf_sd["model.embed_tokens.weight"].clone()}
    _check_state_dict(hf_sd, dict(expected.values()), "the Hugging Face state dict", args)
    out: dict[str, torch.Tensor] = {}
    for name, (hf_name, _) in expected.items():
        heads = _heads_of(name, args)
        out[name] = hf_sd[hf_name] if heads is None else _half_to_interleaved(hf_sd[hf_name], heads)
    return out


def check_hf_shapes(shapes: dict[str, tuple[int, ...]], args: ModelArgs, *, tie_word_embeddings: bool) -> None:
    """Raise ``InteropError`` unless a folder's tensor shapes (no data read) are ``LlamaForCausalLM``'s
    for ``args``: the check ``from_hf_state_dict`` makes, for a loader that reads slices."""
    expected = _expected(args)
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    if tie_word_embeddings and "lm_head.weight" not in meta and "model.embed_tokens.weight" in meta:
        meta["lm_head.weight"] = meta["model.embed_tokens.weight"]
    _check_state_dict(meta, dict(expected.values()), "the Hugging Face state dict", args)


def read_box(
    name: str,
    args: ModelArgs,
    box: tuple[slice, ...],
    read_hf: Callable[[str, tuple[slice, ...]], torch.Tensor],
    *,
    tie_word_embeddings: bool = False,
) -> torch.Tensor:
    """``from_hf_state_dict(...)[name][box]``, reading through ``read_hf(hf_name, hf_box)`` only the
    Hugging Face rows it needs: the box itself, or for ``wq`` / ``wk`` the whole heads covering its rows.

    The RoPE permutation reorders rows within each head and never across heads, so the heads
    ``h0..h1`` covering rows ``start..stop`` of our tensor are rows ``h0 * hd .. h1 * hd`` of
    Hugging Face's, permuted as ``h1 - h0`` heads; a box that cuts through a head is sliced after
    permuting. ``box`` holds one ``slice(start, stop)`` per dimension.
    """
    hf_name = _hf_name(name)
    if hf_name == "lm_head.weight" and tie_word_embeddings:
        hf_name = "model.embed_tokens.weight"
    heads = _heads_of(name, args)
    if heads is None:
        return read_hf(hf_name, box)
    rows, cols = box
    hd = args.head_dim
    first, last = rows.start // hd, -(-rows.stop // hd)
    covering = read_hf(hf_name, (slice(first * hd, last * hd), cols))
    return _half_to_interleaved(covering, last - first)[rows.start - first * hd : rows.stop - first * hd]


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` that computes what ``Transformer(args)`` computes.

    RoPE uses the pre-5.0 spelling (``rope_theta`` and ``rope_scaling``) that the published
    Llama 3.1 folders use, which transformers 4 and 5 both read. ``max_position_embeddings`` is
    the length our RoPE table was built for; transformers warns when it is below Llama 3.1's
    original context of 8192, which changes nothing for the ``llama3`` rotation itself.
    """
    if dtype not in HF_DTYPES:
        raise InteropError(f"cannot export in {dtype}; choose one of {', '.join(HF_DTYPES.values())}.")
    check_divisors(args)
    differ = [f"`qk_norm` = {args.qk_norm}" for _ in range(args.qk_norm)] + [
        f"`head_size` = {args.head_size}" for _ in range(args.head_dim * args.n_heads != args.dim)
    ]
    if differ:
        raise InteropError(
            f"the model args cannot be exported: {', '.join(differ)}, but a LlamaForCausalLM has no q/k norms "
            'and heads of `dim` / `n_heads` channels; `model.name` = "qwen3" (Qwen3ForCausalLM) and the MoE have them.'
        )
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
        }
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": HF_DTYPES[dtype],
    }
    check_exportable(cfg, moe=False)
    return cfg


def check_divisors(args: ModelArgs) -> None:
    """Refuse the fields the ``config.json`` sizes are divided by before any size is computed
    from them (a ``ZeroDivisionError`` names nothing)."""
    check_exportable({"num_attention_heads": args.n_heads}, moe=False)
    if not isinstance(args.multiple_of, int) or isinstance(args.multiple_of, bool) or args.multiple_of < 1:
        raise InteropError(
            f"the model args cannot be exported: `multiple_of` = {args.multiple_of!r}: it must be a whole number "
            "of at least 1."
        )


def check_exportable(cfg: dict[str, Any], *, moe: bool) -> None:
    """Refuse to write a ``config.json`` that describes no possible model, naming our field."""
    problem = config_problem(cfg, moe=moe, name=our_field)
    if problem:
        raise InteropError(f"the model args cannot be exported: {problem}.")


def check_importable(cfg: dict[str, Any], *, moe: bool) -> None:
    """Refuse a ``config.json`` that describes no possible model, naming its key."""
    problem = config_problem(cfg, moe=moe)
    if problem:
        raise InteropError(f"{CONFIG_FILE}: {problem}.")


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise InteropError(f"{CONFIG_FILE} has no `{key}`; a LlamaForCausalLM config needs it.")
    return cfg[key]


def _rope_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and the Llama 3.1 scaling fields of ``ModelArgs`` from either RoPE spelling.

    transformers 5 writes ``rope_parameters`` (theta and scaling together); earlier versions
    and the published Llama folders write ``rope_theta`` and ``rope_scaling``.
    """
    if cfg.get("rope_parameters") is not None:
        params = cfg["rope_parameters"]
        if "rope_theta" not in params:
            raise InteropError(f"{CONFIG_FILE}: `rope_parameters` has no `rope_theta`.")
        theta = params["rope_theta"]
        scaling = None if params.get("rope_type", "default") == "default" else params
    else:
        theta = _require(cfg, "rope_theta")
        scaling = cfg.get("rope_scaling")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise InteropError(f"{CONFIG_FILE}: `rope_theta` = {theta!r}: it must be a finite number above 0.")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": scaling is not None}
    if scaling is None:
        return out
    rope_type = scaling.get("rope_type", scaling.get("type"))
    constants = {
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
    }
    if rope_type != "llama3" or "factor" not in scaling or any(scaling.get(k) != v for k, v in constants.items()):
        raise InteropError(
            f"{CONFIG_FILE}: RoPE scaling {scaling} is not supported; trainer/model/llama3.py implements only "
            f"rope_type `llama3` with a `factor` and {constants}."
        )
    factor = scaling["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise InteropError(
            f"{CONFIG_FILE}: the RoPE scaling `factor` = {factor!r}: it must be a finite number above 0."
        )
    out["rope_scaling_factor"] = float(factor)
    return out


def _ffn_args(dim: int, intermediate_size: int) -> dict[str, Any]:
    """``multiple_of`` / ``ffn_dim_multiplier`` whose ``ffn_hidden_dim`` is exactly ``intermediate_size``.

    A flavor of the same width that gives the size is preferred, so a published Llama 3 comes
    back with its flavor's own settings; otherwise the size itself is the multiple, with a
    multiplier shrinking the 8/3 * dim base below it when the FFN is narrower than that.
    """
    candidates = [(f.multiple_of, f.ffn_dim_multiplier) for f in FLAVORS.values() if f.dim == dim]
    base = ModelArgs(dim=dim, multiple_of=1).ffn_hidden_dim
    candidates.append((intermediate_size, None if base <= intermediate_size else intermediate_size / base))
    for multiple_of, multiplier in candidates:
        args = ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if args.ffn_hidden_dim == intermediate_size:
            return {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}
    raise InteropError(
        f"{CONFIG_FILE}: no multiple_of / ffn_dim_multiplier gives intermediate_size={intermediate_size} "
        f"for hidden_size={dim} in trainer/model/llama3.py's FFN sizing."
    )


def model_args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The ``ModelArgs`` of a ``LlamaForCausalLM`` ``config.json``; the inverse of ``hf_config``.

    Everything our model cannot express (biases, another activation, a head size other than
    hidden_size / heads, another RoPE scaling) is an error rather than a silently different model.
    """
    architectures = cfg.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures or cfg.get("model_type", "llama") != "llama":
        raise InteropError(
            f"{CONFIG_FILE} describes {architectures} (model_type {cfg.get('model_type')!r}); "
            f"only LlamaForCausalLM converts to trainer/model/llama3.py's Llama 3."
        )
    unsupported = {
        k: cfg[k]
        for k, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
        if k in cfg and cfg[k] != ours
    }
    if unsupported:
        raise InteropError(
            f"{CONFIG_FILE}: {unsupported} is not supported; trainer/model/llama3.py has SiLU and no biases."
        )
    check_importable(cfg, moe=False)
    dim = _require(cfg, "hidden_size")
    n_heads = _require(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise InteropError(
            f"{CONFIG_FILE}: head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={dim}; "
            f"trainer/model/llama3.py derives the head size as hidden_size / heads."
        )
    return ModelArgs(
        dim=dim,
        n_layers=_require(cfg, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        vocab_size=_require(cfg, "vocab_size"),
        norm_eps=float(_require(cfg, "rms_norm_eps")),
        max_seq_len=_require(cfg, "max_position_embeddings"),
        **_ffn_args(dim, _require(cfg, "intermediate_size")),
        **_rope_args(cfg),
    )
