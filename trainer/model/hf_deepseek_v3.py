"""The Hugging Face adapter for DeepSeek-V3: ``DeepseekV3ForCausalLM``'s names, layout and ``config.json``.

Our blocks are DeepSeek's with other names (``mla.py`` keeps torchtitan's), and their RoPE
rotates adjacent channel pairs as DeepSeek's weights expect (``rope_interleave``), so no tensor
is permuted. Two layouts differ: the routed experts, which we stack into three 3-D parameters
and a folder stores as one 2-D tensor per expert (as for Qwen3-MoE), and the aux-loss-free
routing bias, our MoE's ``expert_bias`` buffer, which is the router's ``e_score_correction_bias``
there: exported and imported with the weights, since it moves every token's choice of experts.
Both only move values, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from trainer.model import hf_experts, hf_llama3
from trainer.model.deepseek_v3 import DeepSeekV3Args
from trainer.model.hf_experts import Piece
from trainer.model.hf_llama3 import (
    HF_DTYPES,
    InteropError,
    _require,
    check_exportable,
    check_importable,
)
from trainer.model.hf_qwen3_moe import MOE_FIELDS
from trainer.model.llama3 import Transformer
from trainer.model.moe import MoEArgs, out_of_range

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
CONFIG_FILE = hf_llama3.CONFIG_FILE

_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_CARRIED_BUFFER = "feed_forward.expert_bias"


def _hf_name(name: str) -> str:
    if name in hf_llama3._GLOBAL_NAMES:
        return hf_llama3._GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _check_supported(args: DeepSeekV3Args) -> None:
    """Refuse what ``DeepseekV3ForCausalLM`` cannot express, naming our field."""
    wanted = {"score_func": "sigmoid", "qk_norm": False, "rope_scaling": False, "tie_embeddings": False}
    differ = {k: getattr(args, k) for k, v in wanted.items() if getattr(args, k) != v}
    if args.n_kv_heads not in (None, args.n_heads):
        differ["n_kv_heads"] = args.n_kv_heads
    if differ:
        raise InteropError(
            f"{differ} cannot be a {ARCHITECTURE}, which needs {wanted} and a key/value latent per head; "
            'to export, train a `model.name` = "deepseek_v3" flavor (train_configs/tiny_deepseek_v3.toml).'
        )


def _tensors(args: DeepSeekV3Args) -> list[tuple[str, torch.Size]]:
    """Our model's parameters and the routing biases, by name and shape, in the model's order."""
    with torch.device("meta"):
        model = Transformer(args)
    carried = [(n, b.shape) for n, b in model.named_buffers() if n.endswith(_CARRIED_BUFFER)]
    return [(n, p.shape) for n, p in model.named_parameters()] + carried


def hf_pieces(args: DeepSeekV3Args) -> dict[str, Piece]:
    """Hugging Face name -> ``Piece``, in our model's order, each expert's tensors together.

    Built from a meta-device model so it cannot drift from it; a tensor without a rule here
    fails loudly (``KeyError``).
    """
    _check_supported(args)
    return hf_experts.pieces(_tensors(args), args.n_experts, _hf_name)


def hf_layout(args: DeepSeekV3Args) -> dict[str, tuple[str, torch.Size]]:
    """Our tensor name -> (Hugging Face name, with ``*`` for the expert, shape), in the model's
    order; the routing biases (buffers) included."""
    return hf_experts.layout(hf_pieces(args), args.n_experts)


def to_hf_piece(hf_name: str, tensor: torch.Tensor, args: DeepSeekV3Args, pieces: dict[str, Piece]) -> torch.Tensor:
    """Hugging Face tensor ``hf_name`` out of our full tensor ``tensor`` it comes from."""
    _, expert, _ = pieces[hf_name]
    return tensor[expert] if expert is not None else tensor


def check_state_dict(sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> None:
    """Raise ``InteropError`` unless ``sd`` holds exactly our model's parameters and routing
    biases, full, of ``args``' shapes."""
    _check(sd, {name: shape for name, (_, shape) in hf_layout(args).items()}, "the state dict", args)


def _check(sd: dict[str, Any], expected: dict[str, torch.Size], what: str, args: DeepSeekV3Args) -> None:
    hf_experts.check_tensors(sd, expected, what, f"a {args.n_layers}-layer {ARCHITECTURE} of {args.n_experts} experts")


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    """Our full state dict (the routing biases with it) as ``DeepseekV3ForCausalLM``'s folder
    holds it; expert tensors are views of ours."""
    check_state_dict(sd, args)
    pieces = hf_pieces(args)
    return {hf_name: to_hf_piece(hf_name, sd[name], args, pieces) for hf_name, (name, _, _) in pieces.items()}


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    """A ``DeepseekV3ForCausalLM`` folder's tensors as ours (experts stacked into new tensors)."""
    check_hf_shapes({k: tuple(v.shape) for k, v in hf_sd.items()}, args, tie_word_embeddings=False)
    return {
        name: read_box(name, args, tuple(slice(0, n) for n in shape), lambda n, box: hf_sd[n][box])
        for name, (_, shape) in hf_layout(args).items()
    }


def check_hf_shapes(shapes: dict[str, tuple[int, ...]], args: DeepSeekV3Args, *, tie_word_embeddings: bool) -> None:
    """Raise ``InteropError`` unless a folder's tensor shapes are ``DeepseekV3ForCausalLM``'s for ``args``.
    The published folders' multi-token prediction layer (the block after the last) is named apart."""
    mtp = f"model.layers.{args.n_layers}."
    if any(name.startswith(mtp) for name in shapes):
        raise InteropError(
            f"the Hugging Face folder holds a multi-token prediction layer (`{mtp}*`, the config's "
            "`num_nextn_predict_layers`), which meshtrain does not build: save the folder without those tensors "
            "(and with `num_nextn_predict_layers` 0) to train its other weights."
        )
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    expected = {hf_name: shape for hf_name, (_, _, shape) in hf_pieces(args).items()}
    _check(meta, expected, "the Hugging Face folder", args)


def read_box(
    name: str,
    args: DeepSeekV3Args,
    box: tuple[slice, ...],
    read_hf: Callable[[str, tuple[slice, ...]], torch.Tensor],
    *,
    tie_word_embeddings: bool = False,
) -> torch.Tensor:
    """Our tensor ``name``'s ``box``, reading through ``read_hf(hf_name, hf_box)`` only what it
    needs: the experts' box is the box of each expert it covers, stacked; every other box is the
    Hugging Face tensor's own."""
    if hf_experts.EXPERTS in name:
        return hf_experts.read_experts(name, args.n_experts, box, read_hf)
    return read_hf(_hf_name(name), box)


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def hf_config(args: DeepSeekV3Args, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of a ``DeepseekV3ForCausalLM`` that computes what our ``Transformer(args)``
    computes, RoPE in transformers 5's spelling (``rope_parameters``, YaRN's fields with it)."""
    _check_supported(args)
    if dtype not in HF_DTYPES:
        raise InteropError(f"cannot export in {dtype}; choose one of {', '.join(HF_DTYPES.values())}.")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.yarn_factor > 1:
        rope = {
            "rope_type": "yarn",
            "rope_theta": float(args.rope_theta),
            "factor": float(args.yarn_factor),
            "original_max_position_embeddings": args.yarn_original_context,
            "beta_fast": float(args.yarn_beta_fast),
            "beta_slow": float(args.yarn_beta_slow),
            "mscale": float(args.yarn_mscale),
            "mscale_all_dim": float(args.yarn_mscale_all_dim),
        }
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_act": "silu",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_routed_experts": args.n_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k,
        "first_k_dense_replace": args.n_dense_layers,
        "n_group": args.n_groups,
        "topk_group": args.topk_groups,
        "norm_topk_prob": args.route_norm,
        "routed_scaling_factor": float(args.route_scale),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "num_hidden_layers": args.n_layers,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "head_dim": args.qk_rope_head_dim,
        "rope_interleave": True,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": HF_DTYPES[dtype],
    }
    check_exportable({"num_attention_heads": args.n_heads, "hidden_size": args.dim}, moe=False)
    return cfg


def model_args_from_hf_config(cfg: dict[str, Any]) -> DeepSeekV3Args:
    """The ``DeepSeekV3Args`` of a ``DeepseekV3ForCausalLM`` ``config.json``; the inverse of
    ``hf_config``. What our blocks cannot express (other RoPE scalings, biases, another activation,
    RoPE not on adjacent pairs) is an error rather than a silently different model; the published
    configs' multi-token prediction module (``num_nextn_predict_layers``) is not built here, and
    its tensors, which the folders keep as an extra layer, are refused by the shape check."""
    check_importable({k: v for k, v in cfg.items() if k in ("hidden_size", "num_attention_heads")}, moe=False)
    unsupported = {
        k: cfg[k]
        for k, ours in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True))
        if k in cfg and cfg[k] != ours
    }
    if cfg.get("num_key_value_heads") not in (None, cfg.get("num_attention_heads")):
        unsupported["num_key_value_heads"] = cfg["num_key_value_heads"]
    if unsupported:
        raise InteropError(
            f"{CONFIG_FILE}: {unsupported} is not supported; trainer/model/mla.py has SiLU experts, no biases, a "
            "key/value latent per head and RoPE on adjacent channel pairs."
        )
    for key, least in (("kv_lora_rank", 1), ("qk_nope_head_dim", 1), ("qk_rope_head_dim", 2), ("v_head_dim", 1)):
        value = _require(cfg, key)
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < least
            or (key == "qk_rope_head_dim" and value % 2)
        ):
            even = ", even (RoPE turns channel pairs)" if key == "qk_rope_head_dim" else ""
            raise InteropError(
                f"{CONFIG_FILE}: `{key}` = {value!r}: it must be a whole number of at least {least}{even}."
            )
    rope = cfg.get("rope_parameters") or {
        "rope_theta": cfg.get("rope_theta", 10000.0),
        **(cfg.get("rope_scaling") or {}),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise InteropError(f"{CONFIG_FILE}: RoPE {rope_type!r} is not supported; DeepSeek-V3's is plain or YaRN.")
    yarn: dict[str, Any] = {}
    if rope_type == "yarn":
        yarn = {
            "yarn_factor": float(rope["factor"]),
            "yarn_original_context": int(rope["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rope.get("beta_fast", 32.0)),
            "yarn_beta_slow": float(rope.get("beta_slow", 1.0)),
            "yarn_mscale": float(rope.get("mscale", 1.0)),
            "yarn_mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
        }
    args = DeepSeekV3Args(
        dim=_require(cfg, "hidden_size"),
        n_layers=_require(cfg, "num_hidden_layers"),
        n_heads=_require(cfg, "num_attention_heads"),
        vocab_size=_require(cfg, "vocab_size"),
        norm_eps=float(_require(cfg, "rms_norm_eps")),
        max_seq_len=_require(cfg, "max_position_embeddings"),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=False,
        ffn_hidden_size=_require(cfg, "intermediate_size"),
        n_experts=_require(cfg, "n_routed_experts"),
        top_k=_require(cfg, "num_experts_per_tok"),
        moe_hidden_dim=_require(cfg, "moe_intermediate_size"),
        n_shared_experts=cfg.get("n_shared_experts") or 0,
        n_dense_layers=cfg.get("first_k_dense_replace", 0),
        score_func="sigmoid",
        route_norm=bool(cfg.get("norm_topk_prob", False)),
        route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        n_groups=cfg.get("n_group") or 1,
        topk_groups=cfg.get("topk_group") or 1,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=_require(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_require(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_require(cfg, "qk_rope_head_dim"),
        v_head_dim=_require(cfg, "v_head_dim"),
        **yarn,
    )
    problem = out_of_range(args, lambda name: f"`{_CONFIG_KEYS.get(name, name)}`")
    if problem:
        raise InteropError(f"{CONFIG_FILE}: {problem}; no {ARCHITECTURE} can be built of it.")
    return args


_CONFIG_KEYS = {
    "n_layers": "num_hidden_layers",
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "n_experts": "n_routed_experts",
    "top_k": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
    "n_groups": "n_group",
    "topk_groups": "topk_group",
    "n_dense_layers": "first_k_dense_replace",
}
"""Our field -> the ``config.json`` key it is read from."""


MODEL_FIELDS = MOE_FIELDS + tuple(
    f.name for f in fields(DeepSeekV3Args) if f.name not in {f.name for f in fields(MoEArgs)}
)
"""What a folder's config must match beyond the shapes: the routing and experts, the latents, YaRN."""
