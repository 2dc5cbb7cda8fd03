"""The Hugging Face adapter for Qwen3 dense: ``Qwen3ForCausalLM``'s names, layout and ``config.json``.

Qwen3 is Llama's block with an RMSNorm on each query and key head (``q_norm`` / ``k_norm``, one
head wide), heads sized apart from the width and, in the small sizes, the output tied to the
embedding. The names are Llama's plus the two norms; RoPE is handled as for Llama
(``hf_llama3.py``), the norms' weights permuted within their one head as the rows of ``wq`` and
``wk`` are. Only values move, so a round trip is bit-exact.

A tied model has one matrix: ``named_parameters`` lists only ``tok_embeddings.weight``, the
export writes no ``lm_head.weight`` and sets ``tie_word_embeddings``, as transformers' own save does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.model import hf_llama3
from trainer.model.hf_llama3 import (
    CONFIG_FILE,
    HF_DTYPES,
    InteropError,
    _half_to_interleaved,
    _interleaved_to_half,
    _require,
    _rope_args,
    check_divisors,
    check_exportable,
    check_importable,
    family_hint,
    preview_names,
)
from trainer.model.llama3 import ModelArgs, Transformer

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
MODEL_FIELDS: tuple[str, ...] = ()
"""What a folder's config must match beyond the shapes and Llama's fields (``hf_architectures.py``)."""

NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def _hf_name(name: str) -> str:
    if name in hf_llama3._GLOBAL_NAMES:
        return hf_llama3._GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{NORM_NAMES.get(rest) or hf_llama3._LAYER_NAMES[rest]}"


def _check_supported(args: ModelArgs) -> None:
    """Refuse what a Qwen3 cannot express, naming our field."""
    wanted = {"qk_norm": True, "rope_scaling": False}
    differ = {k: getattr(args, k) for k, v in wanted.items() if getattr(args, k) != v}
    if differ:
        raise InteropError(
            f"{differ} cannot be a {ARCHITECTURE}, which needs {wanted}; to export, train a `model.name` = "
            '"qwen3" flavor (`qwen3_debug`, as train_configs/tiny_qwen3.toml, or a published size).'
        )


def hf_layout(args: ModelArgs) -> dict[str, tuple[str, torch.Size]]:
    """Our parameter name -> (Hugging Face name, shape), in the model's order; built from a
    meta-device model so it cannot drift from it (a parameter without a rule fails: ``KeyError``)."""
    _check_supported(args)
    with torch.device("meta"):
        model = Transformer(args)
    return {name: (_hf_name(name), p.shape) for name, p in model.named_parameters()}


def hf_pieces(args: ModelArgs) -> dict[str, tuple[str, None, torch.Size]]:
    """Hugging Face name -> (our name, None, shape): the export's view."""
    return {hf_name: (name, None, shape) for name, (hf_name, shape) in hf_layout(args).items()}


def head_permutation(name: str, args: ModelArgs) -> tuple[int, bool] | None:
    """(heads, is a norm weight) of a tensor whose rows the RoPE layout permutes, else None (the
    Qwen3-MoE adapter's q/k norms too)."""
    if name.endswith(tuple(NORM_NAMES)):
        return 1, True
    heads = hf_llama3._heads_of(name, args)
    return None if heads is None else (heads, False)


def permute_heads(
    name: str, tensor: torch.Tensor, args: ModelArgs, permute: Callable[..., torch.Tensor]
) -> torch.Tensor:
    how = head_permutation(name, args)
    if how is None:
        return tensor
    heads, is_norm = how
    return permute(tensor.view(-1, 1), heads).view(-1) if is_norm else permute(tensor, heads)


def to_hf_piece(hf_name: str, tensor: torch.Tensor, args: ModelArgs, pieces: dict[str, Any]) -> torch.Tensor:
    """Hugging Face tensor ``hf_name`` out of our full tensor it comes from."""
    return permute_heads(pieces[hf_name][0], tensor, args, _interleaved_to_half)


def _check(sd: dict[str, Any], expected: dict[str, torch.Size], what: str, args: ModelArgs) -> None:
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        tied = "tied" if args.tie_embeddings else "untied"
        raise InteropError(
            f"{what} does not match a {args.n_layers}-layer {ARCHITECTURE} with {tied} embeddings: missing keys "
            f"{preview_names(missing)}, unexpected keys {preview_names(unexpected)}." + family_hint(missing, unexpected)
        )
    wrong = [k for k, shape in expected.items() if tuple(sd[k].shape) != tuple(shape)]
    if wrong:
        raise InteropError(
            f"{what}: `{wrong[0]}` has shape {tuple(sd[wrong[0]].shape)} but the model args give "
            f"{tuple(expected[wrong[0]])}; the weights were made with other model args."
        )


def check_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> None:
    """Raise ``InteropError`` unless ``sd`` holds exactly the model's parameters (a tied matrix
    once), full, of ``args``' shapes."""
    _check(sd, {name: shape for name, (_, shape) in hf_layout(args).items()}, "the state dict", args)


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full state dict as ``Qwen3ForCausalLM``'s; unpermuted tensors are ours (no copy)."""
    check_state_dict(sd, args)
    pieces = hf_pieces(args)
    return {hf_name: to_hf_piece(hf_name, sd[name], args, pieces) for hf_name, (name, _, _) in pieces.items()}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A ``Qwen3ForCausalLM`` state dict as ours."""
    check_hf_shapes({k: tuple(v.shape) for k, v in hf_sd.items()}, args, tie_word_embeddings=args.tie_embeddings)
    return {
        name: read_box(name, args, tuple(slice(0, n) for n in shape), lambda n, box: hf_sd[n][box])
        for name, (_, shape) in hf_layout(args).items()
    }


def check_hf_shapes(shapes: dict[str, tuple[int, ...]], args: ModelArgs, *, tie_word_embeddings: bool) -> None:
    """Raise ``InteropError`` unless a folder's tensor shapes are ``Qwen3ForCausalLM``'s for ``args``.
    A tied folder may still hold ``lm_head.weight`` (some exporters write it): transformers ties
    over it, and so does the import."""
    if tie_word_embeddings and args.tie_embeddings:
        shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    _check(
        meta, {hf_name: shape for hf_name, (_, _, shape) in hf_pieces(args).items()}, "the Hugging Face folder", args
    )


def read_box(
    name: str,
    args: ModelArgs,
    box: tuple[slice, ...],
    read_hf: Callable[[str, tuple[slice, ...]], torch.Tensor],
    *,
    tie_word_embeddings: bool = False,
) -> torch.Tensor:
    """Our tensor ``name``'s ``box``, reading through ``read_hf(hf_name, hf_box)`` only what it
    needs: a q/k norm weight (one head wide) is read whole and permuted; the rest is Llama's."""
    if head_permutation(name, args) == (1, True):
        return permute_heads(name, read_hf(_hf_name(name), (slice(None),)), args, _half_to_interleaved)[box]
    return hf_llama3.read_box(name, args, box, read_hf, tie_word_embeddings=tie_word_embeddings)


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``Qwen3ForCausalLM`` that computes what our ``Transformer(args)`` computes."""
    _check_supported(args)
    if dtype not in HF_DTYPES:
        raise InteropError(f"cannot export in {dtype}; choose one of {', '.join(HF_DTYPES.values())}.")
    check_divisors(args)
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": HF_DTYPES[dtype],
    }
    check_exportable(cfg, moe=False)
    return cfg


def model_args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The ``ModelArgs`` of a ``Qwen3ForCausalLM`` ``config.json``; the inverse of ``hf_config``.

    What our model cannot express (a sliding window, biases, another activation, RoPE scaling)
    is an error rather than a silently different model.
    """
    check_importable(cfg, moe=False)
    unsupported = {
        k: cfg[k]
        for k, ours in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False))
        if k in cfg and cfg[k] != ours
    }
    if unsupported:
        raise InteropError(
            f"{CONFIG_FILE}: {unsupported} is not supported; trainer/model/llama3.py has SiLU, full attention "
            "and no biases."
        )
    rope = _rope_args(cfg)
    if rope["rope_scaling"]:
        raise InteropError(f"{CONFIG_FILE}: RoPE scaling is not supported for {ARCHITECTURE}.")
    dim, n_heads = _require(cfg, "hidden_size"), _require(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or dim // n_heads
    return ModelArgs(
        dim=dim,
        n_layers=_require(cfg, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_size=0 if head_dim * n_heads == dim else head_dim,
        vocab_size=_require(cfg, "vocab_size"),
        norm_eps=float(_require(cfg, "rms_norm_eps")),
        max_seq_len=_require(cfg, "max_position_embeddings"),
        qk_norm=True,
        ffn_hidden_size=_require(cfg, "intermediate_size"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **rope,
    )
