"""Whether a Hugging Face ``config.json`` describes a model that can exist: each key in range,
the keys consistent with each other.

transformers builds any model its config describes and fails only at the first forward (a
token choosing 16 of 8 experts), or never (a zero norm epsilon divides by zero on a zero
activation). The converters run these checks on every config they read and on every config
they are about to write, so an impossible model is one line naming the key, in both directions.
On export the keys are named by our ``ModelArgs`` fields (``name``), which the user can change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

OUR_FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "head_dim": "head_size",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_hidden_dim",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "num_experts": "n_experts",
    "num_experts_per_tok": "top_k",
    "moe_intermediate_size": "moe_hidden_dim",
}
"""``config.json`` key -> the ``ModelArgs`` field it is written from."""

_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
_MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def hf_key(key: str) -> str:
    """How an import names a key: as ``config.json`` spells it."""
    return f"`{key}`"


def our_field(key: str) -> str:
    """How an export names a key: our field, with the ``config.json`` key it becomes."""
    return f"`{OUR_FIELDS.get(key, key)}` (config.json `{key}`)"


def config_problem(cfg: dict[str, Any], *, moe: bool, name: Callable[[str], str] = hf_key) -> str | None:
    """The first reason ``cfg`` cannot be a model, with its fix, or None. Missing required keys
    are the adapters' to report; here only the values present are judged."""
    return next(_problems(cfg, moe, name), None)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(cfg: dict[str, Any], key: str, name: Callable[[str], str]) -> str | None:
    value = cfg[key]
    if not _is_int(value) or value < 1:
        return f"{name(key)} = {value!r}: it must be a whole number of at least 1"
    return None


def _positive_float(cfg: dict[str, Any], key: str, name: Callable[[str], str]) -> str | None:
    value = cfg[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        return f"{name(key)} = {value!r}: it must be a finite number above 0"
    return None


def _problems(cfg: dict[str, Any], moe: bool, name: Callable[[str], str]) -> Iterator[str]:
    sizes = _SIZES + (_MOE_SIZES if moe else ("intermediate_size",))
    if moe and "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
    if moe and cfg.get("num_experts") == 0:
        yield (
            f"{name('num_experts')} = 0: a Mixture-of-Experts needs at least 1 expert (a model without experts "
            "is a dense LlamaForCausalLM: convert it as one)"
        )
    for key in sizes:
        if key in cfg and (problem := _positive_int(cfg, key, name)):
            yield problem
    for key in _OPTIONAL_SIZES:
        if cfg.get(key) is not None and (problem := _positive_int(cfg, key, name)):
            yield problem
    for key in ("rms_norm_eps", "rope_theta"):
        if cfg.get(key) is not None and (problem := _positive_float(cfg, key, name)):
            yield problem
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv_heads) and heads % kv_heads:
        yield (
            f"{name('num_key_value_heads')} = {kv_heads} does not divide {name('num_attention_heads')} = {heads}: "
            f"each key/value head serves a whole group of query heads; use a divisor of {heads}"
        )
    head_dim = cfg.get("head_dim")
    if head_dim is None and _is_int(heads) and _is_int(cfg.get("hidden_size")):
        head_dim = cfg["hidden_size"] // heads
    if _is_int(head_dim) and head_dim % 2:
        yield (
            f"the head size ({name('head_dim')}, or {name('hidden_size')} / {name('num_attention_heads')}) is "
            f"{head_dim}: RoPE rotates pairs of a head's channels, so it must be even"
        )
    if moe:
        yield from _moe_problems(cfg, name)


def _moe_problems(cfg: dict[str, Any], name: Callable[[str], str]) -> Iterator[str]:
    experts, top_k = cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    if _is_int(experts) and _is_int(top_k) and top_k > experts:
        yield (
            f"{name('num_experts_per_tok')} = {top_k} is more than {name('num_experts')} = {experts}: a token "
            f"cannot choose more experts than there are; choose at most {experts}"
        )
    layers = cfg.get("num_hidden_layers")
    step = cfg.get("decoder_sparse_step")
    if step is not None and (not _is_int(step) or step < 1):
        yield (
            f"{name('decoder_sparse_step')} = {step!r}: every `decoder_sparse_step`-th layer routes, so it must be "
            "a whole number of at least 1"
        )
        return
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(_is_int(i) for i in dense):
        yield f"{name('mlp_only_layers')} = {dense!r}: it must be a list of layer indices"
        return
    if not _is_int(layers):
        return
    outside = sorted({i for i in dense if not 0 <= i < layers})
    if outside:
        yield (
            f"{name('mlp_only_layers')} names layers {outside}, outside the model's {layers} layers "
            f"(0 to {layers - 1}); name existing layers only"
        )
    routed = [i for i in range(layers) if i not in dense and (i + 1) % (step or 1) == 0]
    if not routed:
        yield (
            f"no layer routes: {name('decoder_sparse_step')} = {step} and {name('mlp_only_layers')} = {dense} leave "
            f"all {layers} layers dense, so the experts are never used; this is a dense model"
        )
