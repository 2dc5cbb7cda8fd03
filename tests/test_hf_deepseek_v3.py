"""DeepSeek-V3 interop, transformers as an independent reference.

A tiny ``DeepseekV3ForCausalLM`` with every part of the architecture (query latent, YaRN, a dense
first block, group-limited sigmoid routing with a nonzero correction bias and the routed scaling
factor, a shared expert, value heads narrower than the query's), random weights saved by
transformers itself, is loaded through the trainer's own ``initial_load_in_hf`` loader: the
logits, the summed cross-entropy, every gradient and the weights after several AdamW steps on the
same batches must match transformers', the routing bias must come in with the weights, and the
folder must come back bit for bit through both converters; a model the format cannot hold is
refused in one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from deepseek_helpers import ours_from_hf, tiny_pair
from harness import ROOT
from hf_helpers import labelled_batch, load_ours, shifted
from transformers import DeepseekV3ForCausalLM

from trainer.checkpoint.hf_folders import load_hf_folder, save_hf_folder
from trainer.checkpoint.hf_load import check_folder_config
from trainer.loss import IGNORE_INDEX
from trainer.model.deepseek_v3 import FLAVORS
from trainer.model.hf_architectures import adapter_for_args, adapter_for_config
from trainer.model.hf_deepseek_v3 import (
    check_hf_shapes,
    from_hf_state_dict,
    hf_config,
    hf_layout,
    model_args_from_hf_config,
    read_box,
)
from trainer.model.hf_llama3 import InteropError

sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_hf
import convert_to_hf

SEQ_LEN = 32
LOGITS_TOL = 1e-5  # of the largest logit
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5  # of the largest gradient of the tensor
STEP_TOL = 3e-3  # of the tensor's largest entry (test_adamw_steps_match_transformers says why)
STEPS = 4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of ``test_deepseek_v3.tiny_pair``, saved by ``save_pretrained``."""
    hf, _ = tiny_pair()
    path = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    hf.save_pretrained(path)
    return path


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return labelled_batch(seed, 256, SEQ_LEN)


def theirs_as_ours(hf: DeepseekV3ForCausalLM, args, grads: bool) -> dict[str, torch.Tensor]:
    """transformers' parameters (or their gradients) under our names (its experts fused in memory)."""
    tensors = {n: (p.grad if grads else p.detach()) for n, p in hf.named_parameters()}
    return ours_from_hf({n: t for n, t in tensors.items() if t is not None}, args)


def test_the_routing_bias_comes_in_with_the_weights(hf_dir: Path) -> None:
    ours = load_ours(hf_dir)
    saved, _ = load_hf_folder(hf_dir)
    bias = ours.layers["1"].feed_forward.expert_bias
    assert bias.abs().max() > 0
    assert torch.equal(bias, saved["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_logits_loss_and_grads_match_transformers(hf_dir: Path) -> None:
    ours = load_ours(hf_dir)
    hf = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    tokens, labels = batch(2)
    with torch.no_grad():
        theirs_logits = hf(tokens).logits
        logits_diff = (ours(tokens) - theirs_logits).abs().max().item() / theirs_logits.abs().max().item()
    loss = ours(tokens, labels=labels)
    hf_loss = hf(tokens, labels=shifted(labels), num_items_in_batch=1).loss  # a sum: divided by 1
    loss.backward()
    hf_loss.backward()
    mine = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    theirs = theirs_as_ours(hf, ours.args, grads=True)
    assert sorted(mine) == sorted(theirs)
    grad_rel = max((mine[n] - g).abs().max().item() / g.abs().max().item() for n, g in theirs.items())
    assert logits_diff < LOGITS_TOL
    assert abs(loss.item() - hf_loss.item()) / hf_loss.item() < LOSS_RTOL
    assert grad_rel < GRAD_RTOL, grad_rel


def test_adamw_steps_match_transformers(hf_dir: Path) -> None:
    """The same batches, the same AdamW: every step's loss stays together, and so do the weights.
    Adam divides each gradient by its own running size, so the round-off in the tiny gradients of
    an expert few tokens reached becomes a step of up to the learning rate (the first step's
    gradients agree at 1e-5, the next ones' at 8e-5 once the weights differ by that): the weights
    are compared at 0.3% of their largest entry (measured 0.11%, ``experts.w2`` of the first MoE
    block; every other tensor under 0.011%)."""
    ours = load_ours(hf_dir)
    hf = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_ours = torch.optim.AdamW(ours.parameters(), **settings)
    opt_hf = torch.optim.AdamW(hf.parameters(), **settings)
    for step in range(STEPS):
        tokens, labels = batch(10 + step)
        n = int((labels != IGNORE_INDEX).sum())
        loss = ours(tokens, labels=labels) / n
        hf_loss = hf(tokens, labels=shifted(labels)).loss  # transformers' mean over the valid tokens
        for value, opt in ((loss, opt_ours), (hf_loss, opt_hf)):
            opt.zero_grad()
            value.backward()
            opt.step()
        assert loss.item() == pytest.approx(hf_loss.item(), rel=LOSS_RTOL), step
    mine = {n: p.detach() for n, p in ours.named_parameters()}
    theirs = theirs_as_ours(hf, ours.args, grads=False)
    assert sorted(mine) == sorted(theirs)
    worst = max((mine[n] - t).abs().max().item() / t.abs().max().item() for n, t in theirs.items())
    assert worst < STEP_TOL, worst


def test_export_is_bitwise(hf_dir: Path, tmp_path: Path) -> None:
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    ours = from_hf_state_dict(original, args)
    model = load_ours(hf_dir)
    loaded = {n: t.detach() for n, t in model.state_dict().items() if n in ours}
    assert sorted(loaded) == sorted(ours) and all(torch.equal(loaded[n], t) for n, t in ours.items())
    save_hf_folder(tmp_path / "out", ours, args, torch.float32)
    exported, exported_config = load_hf_folder(tmp_path / "out")
    assert model_args_from_hf_config(exported_config) == args
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").config.rope_parameters["rope_type"] == "yarn"


def test_boxes_are_slices_of_the_whole(hf_dir: Path) -> None:
    """What a rank reads under FSDP, TP or EP (rows, columns, a range of experts) equals the
    whole conversion sliced."""
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    whole = from_hf_state_dict(original, args)
    read = lambda n, box: original[n][box]  # noqa: E731
    for name, (_, shape) in hf_layout(args).items():
        box = tuple(slice(n // 4, n // 4 + max(1, n // 2)) for n in shape)
        assert torch.equal(read_box(name, args, box, read), whole[name][box]), name


def test_converters_round_trip(hf_dir: Path, tmp_path: Path) -> None:
    """Through the scripts: a training checkpoint (the routing biases in it), and back."""
    convert_from_hf.main([str(hf_dir), str(tmp_path / "ckpt")])
    convert_to_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"])
    original, _ = load_hf_folder(hf_dir)
    back, config = load_hf_folder(tmp_path / "back")
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], t) for n, t in original.items())


def test_the_folder_selects_this_adapter_and_a_flavor_of_another_shape_is_named(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    adapter = adapter_for_config(config)
    args = model_args_from_hf_config(config)
    assert adapter is adapter_for_args(args)
    assert check_folder_config(config, args, hf_dir) is adapter
    with pytest.raises(InteropError, match="kv_lora_rank") as err:
        check_folder_config(config, replace(args, kv_lora_rank=8), hf_dir)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [({"score_func": "softmax"}, "score_func"), ({"n_kv_heads": 2}, "n_kv_heads"), ({"qk_norm": True}, "qk_norm")],
)
def test_what_the_format_cannot_hold_is_refused_naming_our_field(change: dict, named: str) -> None:
    args = replace(FLAVORS["deepseek_v3_debug"], **change)
    with pytest.raises(InteropError, match=named) as err:
        hf_config(args, torch.float32)
    assert "\n" not in str(err.value)


def test_the_published_configs_load_into_their_flavors() -> None:
    """Hugging Face's deepseek-ai/DeepSeek-V3 and moonshotai/Moonlight-16B-A3B config.json, the
    keys that describe the model: they read back as our 671B and 16B flavors."""
    v3 = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False, "vocab_size": 129280,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    }  # fmt: skip
    moonlight = {
        **v3, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "rope_scaling": None, "vocab_size": 163840,
    }  # fmt: skip
    for config, flavor in ((v3, "671B"), (moonlight, "16B")):
        assert replace(model_args_from_hf_config(config), max_seq_len=FLAVORS[flavor].max_seq_len) == FLAVORS[flavor]


def test_a_multi_token_prediction_layer_is_named_not_dropped(hf_dir: Path) -> None:
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    shapes = {n: tuple(t.shape) for n, t in original.items()}
    extra = {
        n.replace("model.layers.2.", f"model.layers.{args.n_layers}."): s
        for n, s in shapes.items()
        if ".layers.2." in n
    }
    with pytest.raises(InteropError, match="multi-token prediction") as err:
        check_hf_shapes({**shapes, **extra}, args, tie_word_embeddings=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("key", "value"), [("kv_lora_rank", 0), ("qk_rope_head_dim", 7), ("v_head_dim", "128")])
def test_a_config_of_no_possible_latent_attention_is_refused_naming_its_key(hf_dir: Path, key: str, value) -> None:
    config = {**json.loads((hf_dir / "config.json").read_text()), key: value}
    with pytest.raises(InteropError, match=f"`{key}`") as err:
        model_args_from_hf_config(config)
    assert "\n" not in str(err.value)
