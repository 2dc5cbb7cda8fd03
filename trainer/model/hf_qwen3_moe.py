"""The Hugging Face adapter for our MoE: ``Qwen3MoeForCausalLM``'s names, layout and ``config.json``.

Qwen3-MoE is our MoE with softmax scores, top-k, ``norm_topk_prob`` as ``route_norm``, no routed
scaling, no shared expert, no dense first layers, and RMSNorm on each query and key head. Two
layouts differ from ours: the experts, which we stack into three 3-D parameters
(``w1``/``w3``/``w2`` = ``gate``/``up``/``down``, one slice per expert) and Hugging Face folders
store as one 2-D tensor per expert; and RoPE, handled as for Llama (``hf_llama3.py``), the q/k
norms' weights permuted within the head like the rows of ``wq`` / ``wk``. Both only move values,
so a round trip is bit-exact.

The balancing losses differ by definition, not by a layout: ours is per layer, ``E * sum_i f_i
P_i`` with ``f`` the share of the ``k x T`` choices (1 when balanced), averaged over layers when
logged; transformers' ``load_balancing_loss_func`` pools the router outputs of all layers into one
``f`` and one ``P`` and does not divide by ``k``. ``transformers_balancing_loss`` is theirs, for
comparing a run with a Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch

from trainer.model import hf_experts, hf_llama3
from trainer.model.hf_experts import Piece
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
)
from trainer.model.hf_qwen3 import NORM_NAMES, head_permutation, permute_heads
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.model.moe import MoEArgs, out_of_range

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"

_MOE_NAMES = {"feed_forward.router.gate.weight": "mlp.gate.weight", **NORM_NAMES}


def _layer_hf_name(rest: str) -> str:
    return _MOE_NAMES[rest] if rest in _MOE_NAMES else hf_llama3._LAYER_NAMES[rest]


def _hf_name(name: str) -> str:
    if name in hf_llama3._GLOBAL_NAMES:
        return hf_llama3._GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_layer_hf_name(rest)}"


def _check_supported(args: MoEArgs) -> None:
    """Refuse what Qwen3-MoE cannot express, naming our field."""
    wanted = {
        "n_shared_experts": 0,
        "n_dense_layers": 0,
        "score_func": "softmax",
        "route_scale": 1.0,
        "qk_norm": True,
        "rope_scaling": False,
    }
    differ = {k: getattr(args, k) for k, v in wanted.items() if getattr(args, k) != v}
    if differ:
        raise InteropError(
            f"{differ} cannot be a {ARCHITECTURE}, which needs {wanted}; to export, train a flavor it can hold "
            "(`qwen3_moe_debug`, as train_configs/tiny_qwen3_moe.toml, or the `qwen3_*` ones)."
        )


def hf_pieces(args: MoEArgs) -> dict[str, Piece]:
    """Hugging Face name -> ``Piece``, in our model's order, each expert's tensors together.

    Built from a meta-device model so it cannot drift from it; a parameter without a rule here
    fails loudly (``KeyError``).
    """
    _check_supported(args)
    with torch.device("meta"):
        model = Transformer(args)
    return hf_experts.pieces(((n, p.shape) for n, p in model.named_parameters()), args.n_experts, _hf_name)


def hf_layout(args: MoEArgs) -> dict[str, tuple[str, torch.Size]]:
    """Our parameter name -> (Hugging Face name, with ``*`` for the expert, shape), in the model's order."""
    return hf_experts.layout(hf_pieces(args), args.n_experts)


def to_hf_piece(hf_name: str, tensor: torch.Tensor, args: MoEArgs, pieces: dict[str, Piece]) -> torch.Tensor:
    """Hugging Face tensor ``hf_name`` out of our full tensor ``tensor`` it comes from."""
    name, expert, _ = pieces[hf_name]
    return tensor[expert] if expert is not None else permute_heads(name, tensor, args, _interleaved_to_half)


def check_state_dict(sd: dict[str, torch.Tensor], args: MoEArgs) -> None:
    """Raise ``InteropError`` unless ``sd`` holds exactly our MoE's parameters, full, of ``args``' shapes."""
    expected = {name: shape for name, (_, shape) in hf_layout(args).items()}
    _check(sd, expected, "the state dict", args)


def _check(sd: dict[str, Any], expected: dict[str, torch.Size], what: str, args: MoEArgs) -> None:
    hf_experts.check_tensors(sd, expected, what, f"a {args.n_layers}-layer {ARCHITECTURE} of {args.n_experts} experts")


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: MoEArgs) -> dict[str, torch.Tensor]:
    """Our full state dict as ``Qwen3MoeForCausalLM``'s; expert tensors are views of ours."""
    check_state_dict(sd, args)
    pieces = hf_pieces(args)
    return {hf_name: to_hf_piece(hf_name, sd[name], args, pieces) for hf_name, (name, _, _) in pieces.items()}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: MoEArgs) -> dict[str, torch.Tensor]:
    """A ``Qwen3MoeForCausalLM`` state dict as ours (experts stacked into new tensors)."""
    check_hf_shapes({k: tuple(v.shape) for k, v in hf_sd.items()}, args, tie_word_embeddings=False)
    return {
        name: read_box(name, args, tuple(slice(0, n) for n in shape), lambda n, box: hf_sd[n][box])
        for name, (_, shape) in hf_layout(args).items()
    }


def check_hf_shapes(shapes: dict[str, tuple[int, ...]], args: MoEArgs, *, tie_word_embeddings: bool) -> None:
    """Raise ``InteropError`` unless a folder's tensor shapes are ``Qwen3MoeForCausalLM``'s for ``args``."""
    if tie_word_embeddings and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes = {**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    _check(
        meta, {hf_name: shape for hf_name, (_, _, shape) in hf_pieces(args).items()}, "the Hugging Face folder", args
    )


def read_box(
    name: str,
    args: MoEArgs,
    box: tuple[slice, ...],
    read_hf: Callable[[str, tuple[slice, ...]], torch.Tensor],
    *,
    tie_word_embeddings: bool = False,
) -> torch.Tensor:
    """Our tensor ``name``'s ``box``, reading through ``read_hf(hf_name, hf_box)`` only what it
    needs: the experts' box is the box of each expert it covers, stacked; a q/k norm weight
    (one head wide) is read whole and permuted; the rest is Llama's."""
    if hf_experts.EXPERTS in name:
        return hf_experts.read_experts(name, args.n_experts, box, read_hf)
    if head_permutation(name, args) == (1, True):
        return permute_heads(name, read_hf(_hf_name(name), (slice(None),)), args, _half_to_interleaved)[box]
    if name.endswith("router.gate.weight"):
        return read_hf(_hf_name(name), box)
    return hf_llama3.read_box(name, args, box, read_hf, tie_word_embeddings=tie_word_embeddings)


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def hf_config(args: MoEArgs, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``Qwen3MoeForCausalLM`` that computes what our ``Transformer(args)`` computes.

    ``intermediate_size`` (the dense MLP of ``mlp_only_layers``, none here) is written as our
    unused dense width so that the config is complete.
    """
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
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
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
        "tie_word_embeddings": False,
        "torch_dtype": HF_DTYPES[dtype],
    }
    check_exportable(cfg, moe=True)
    return cfg


def model_args_from_hf_config(cfg: dict[str, Any]) -> MoEArgs:
    """The ``MoEArgs`` of a ``Qwen3MoeForCausalLM`` ``config.json``; the inverse of ``hf_config``.

    What our MoE cannot express (dense layers between MoE ones, a sliding window, biases, RoPE
    scaling) is an error rather than a silently different model; a config that describes no
    possible model (``check_importable``) is refused before that, naming the key.
    """
    check_importable(cfg, moe=True)
    unsupported = {
        k: cfg[k]
        for k, ours in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("use_sliding_window", False),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
        )
        if k in cfg and cfg[k] != ours
    }
    if unsupported:
        raise InteropError(
            f"{CONFIG_FILE}: {unsupported} is not supported; trainer/model/moe.py has SiLU experts in every "
            "layer, full attention and no biases."
        )
    rope = _rope_args(cfg)
    if rope["rope_scaling"]:
        raise InteropError(f"{CONFIG_FILE}: RoPE scaling is not supported for {ARCHITECTURE}.")
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n_experts is None:
        raise InteropError(f"{CONFIG_FILE} has no `num_experts`; a {ARCHITECTURE} config needs it.")
    dim, n_heads = _require(cfg, "hidden_size"), _require(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or dim // max(n_heads, 1)
    args = MoEArgs(
        dim=dim,
        n_layers=_require(cfg, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_size=0 if head_dim * n_heads == dim else head_dim,
        vocab_size=_require(cfg, "vocab_size"),
        norm_eps=float(_require(cfg, "rms_norm_eps")),
        max_seq_len=_require(cfg, "max_position_embeddings"),
        qk_norm=True,
        n_experts=n_experts,
        top_k=_require(cfg, "num_experts_per_tok"),
        moe_hidden_dim=_require(cfg, "moe_intermediate_size"),
        route_norm=bool(cfg.get("norm_topk_prob", False)),
        **rope,
    )
    problem = out_of_range(args, lambda name: f"`{_CONFIG_KEYS.get(name, name)}`")
    if problem:
        raise InteropError(f"{CONFIG_FILE}: {problem}; no {ARCHITECTURE} can be built of it.")
    return args


_CONFIG_KEYS = {
    "n_layers": "num_hidden_layers",
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "n_experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
}
"""Our ``MoEArgs`` field -> the ``config.json`` key it is read from."""


MOE_FIELDS = tuple(f.name for f in fields(MoEArgs) if f.name not in {f.name for f in fields(ModelArgs)})
"""The fields an MoE adds to Llama's: with ``head_dim`` and ``qk_norm``, what a folder's config must match."""
MODEL_FIELDS = MOE_FIELDS
"""What a folder's config must match beyond the shapes (``hf_architectures.py``)."""


# --------------------------------------------------------------------------------------------
# transformers' balancing loss
# --------------------------------------------------------------------------------------------


def transformers_balancing_loss(probs: Sequence[torch.Tensor], chosen: Sequence[torch.Tensor]) -> torch.Tensor:
    """``load_balancing_loss_func`` of transformers (no padding mask) from each MoE layer's router
    outputs (``Router.forward``'s ``probs`` and ``chosen``, tokens x experts and tokens x k).

    ``E * sum_i f_i P_i`` over all layers' tokens pooled: ``f_i`` the choices of expert ``i`` per
    token-layer (k when all go to it), ``P_i`` its mean probability. With one layer it is ``k``
    times ours; with several the pooling makes it another function of the routing.
    """
    n_experts = probs[0].shape[1]
    all_probs, all_chosen = torch.cat(list(probs)), torch.cat(list(chosen))
    f = torch.bincount(all_chosen.flatten(), minlength=n_experts).float() / all_probs.shape[0]
    return n_experts * (f * all_probs.mean(0)).sum()
