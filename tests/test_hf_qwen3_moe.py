"""Qwen3-MoE interop, transformers as an independent reference for the MoE model.

A tiny ``Qwen3MoeForCausalLM`` (2 layers, 8 experts, top-2, renormalised, a head size apart from
the width) with random weights, saved by transformers itself, is loaded through the trainer's
own ``initial_load_in_hf`` path; the logits, the summed cross-entropy and every gradient must
match transformers', and the folder must come back bit for bit through both converters. The
router weights are large enough that routing is decisive (no top-k ties at round-off) and the
norm weights are far from one, so a wrong expert order or q/k-norm permutation shows.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from harness import ROOT
from hf_helpers import load_ours
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from trainer.checkpoint.hf_folders import load_hf_folder, save_hf_folder
from trainer.checkpoint.hf_load import check_folder_config, load_hf_weights
from trainer.loss import IGNORE_INDEX
from trainer.model.hf_architectures import adapter_for_config
from trainer.model.hf_llama3 import InteropError
from trainer.model.hf_qwen3_moe import (
    from_hf_state_dict,
    hf_config,
    hf_layout,
    model_args_from_hf_config,
    read_box,
    to_hf_state_dict,
    transformers_balancing_loss,
)
from trainer.model.llama3 import FLAVORS as LLAMA_FLAVORS
from trainer.model.llama3 import Transformer, model_args
from trainer.model.moe import FLAVORS, Balancing, Router, balance_part, moe_layers

sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_hf
import convert_to_hf

SEQ_LEN = 64
LOGITS_TOL = 1e-5  # as the dense Llama test (test_hf_interop.py)
LOSS_RTOL = 1e-6  # the summed loss is ~1000: fp32 round-off of a 128-term sum
GRAD_RTOL = 1e-5  # of the largest gradient of the tensor
AUX_TOL = 2e-6  # a few float32 ulps of losses near 2.5

HF_CONFIG = Qwen3MoeConfig(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # apart from hidden_size / heads, as Qwen3's
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=SEQ_LEN,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with random weights, saved by ``save_pretrained`` (per-expert tensors)."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(HF_CONFIG)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                std = 0.5 if name.endswith("mlp.gate.weight") else 0.1
                p.copy_(std * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    model.save_pretrained(path)
    return path


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, HF_CONFIG.vocab_size, (2, SEQ_LEN), generator=gen)
    labels = torch.randint(0, HF_CONFIG.vocab_size, (2, SEQ_LEN), generator=gen)
    labels[:, -1] = IGNORE_INDEX  # transformers shifts its labels: the last position predicts nothing
    return tokens, labels


def hf_grads(hf: Qwen3MoeForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' gradients under the folder's names: its in-memory experts are fused
    (``gate_up_proj``, ``down_proj``: experts x out x in), the folder's are per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        prefix, _, kind = name.rpartition(".experts.")
        if not prefix:
            out[name] = p.grad
            continue
        for e, grad in enumerate(p.grad):
            if kind == "gate_up_proj":
                gate, up = grad.chunk(2)
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.experts.{e}.down_proj.weight"] = grad
    return out


def test_logits_loss_and_grads_match_transformers(hf_dir: Path):
    ours = load_ours(hf_dir)
    hf = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    assert hf.dtype == torch.float32
    tokens, labels = batch()
    hf_labels = torch.cat([torch.full((2, 1), IGNORE_INDEX), labels[:, :-1]], dim=1)
    with torch.no_grad():
        logits_diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    loss = ours(tokens, labels=labels)
    hf_loss = hf(tokens, labels=hf_labels, num_items_in_batch=1).loss  # a sum: divided by 1
    loss.backward()
    hf_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    ours_grads = to_hf_state_dict(grads, model_args_from_hf_config(HF_CONFIG.to_dict()))
    theirs = hf_grads(hf)
    assert sorted(ours_grads) == sorted(theirs)
    grad_rel = max((ours_grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in theirs.items())
    loss_rel = abs(loss.item() - hf_loss.item()) / hf_loss.item()
    assert logits_diff < LOGITS_TOL
    assert loss_rel < LOSS_RTOL
    assert grad_rel < GRAD_RTOL


def test_export_is_bitwise(hf_dir: Path, tmp_path: Path):
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    ours = from_hf_state_dict(original, args)
    loaded = {n: p.detach() for n, p in load_ours(hf_dir).named_parameters()}
    assert all(torch.equal(loaded[n], t) for n, t in ours.items()) and list(loaded) == list(ours)
    save_hf_folder(tmp_path / "out", ours, args, torch.float32)
    exported, exported_config = load_hf_folder(tmp_path / "out")
    assert model_args_from_hf_config(exported_config) == args
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_boxes_are_slices_of_the_whole(hf_dir: Path):
    """What a rank reads under expert parallelism, FSDP or TP (a box of experts, rows, columns)
    equals the whole conversion sliced: the loader's boxes cut through experts and heads."""
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    whole = from_hf_state_dict(original, args)
    read = lambda n, box: original[n][box]  # noqa: E731
    for name, (_, shape) in hf_layout(args).items():
        box = tuple(slice(n // 4, n // 4 + max(1, n // 2)) for n in shape)
        assert torch.equal(read_box(name, args, box, read), whole[name][box]), name


# Hugging Face's Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json, the keys that matter.
PUBLISHED = {
    "qwen3_30b_a3b": {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
    },
    "qwen3_235b_a22b": {
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
    },
}
PUBLISHED_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_configs_load_into_their_flavor(flavor: str):
    """``initial_load_in_hf`` of the published folder into our flavor passes the config check."""
    args = model_args(flavor, 151665, 4096, flavors=FLAVORS)
    check_folder_config({**PUBLISHED_COMMON, **PUBLISHED[flavor]}, args, Path(flavor))
    with pytest.raises(InteropError, match="route_norm: False there, True here"):
        check_folder_config({**PUBLISHED_COMMON, **PUBLISHED[flavor], "norm_topk_prob": False}, args, Path(flavor))


def test_a_folder_of_the_other_kind_is_refused(hf_dir: Path):
    args = LLAMA_FLAVORS["debugmodel"]
    with pytest.raises(InteropError, match="holds a MoEArgs model .* `model.flavor` is a ModelArgs one"):
        load_hf_weights(Transformer(args), args, hf_dir)


def test_converters_round_trip(hf_dir: Path, tmp_path: Path):
    """Through the scripts: a training checkpoint of MoE args, and back to the same folder."""
    convert_from_hf.main([str(hf_dir), str(tmp_path / "ckpt")])
    convert_to_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"])
    original, _ = load_hf_folder(hf_dir)
    back, config = load_hf_folder(tmp_path / "back")
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], t) for n, t in original.items())


def test_balancing_loss_against_transformers(hf_dir: Path):
    """The whole batch in one forward. Per layer, ours (global_batch scope) is transformers'
    divided by k; over layers transformers pools, which ``transformers_balancing_loss`` gives."""
    ours = load_ours(hf_dir)
    hf = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    tokens, _ = batch()
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in moe_layers(ours):
        layer.router.register_forward_hook(lambda _m, _i, out: routed.append((out[0], out[1])))
    with torch.no_grad():
        ours(tokens)
        out = hf(tokens, output_router_logits=True)
    k, n_tokens = HF_CONFIG.num_experts_per_tok, tokens.numel()
    balancing = Balancing(weight=1.0, scope="global_batch", global_tokens=n_tokens)
    per_layer = []
    for (probs, chosen), logits in zip(routed, out.router_logits, strict=True):
        counts = torch.bincount(chosen.flatten(), minlength=HF_CONFIG.num_experts).float()
        per_layer.append(balance_part(probs, chosen, counts, counts, tokens.shape[0], balancing))
        theirs = load_balancing_loss_func((logits,), HF_CONFIG.num_experts, k)
        assert abs(k * per_layer[-1].item() - float(theirs)) < AUX_TOL
    pooled = transformers_balancing_loss([p for p, _ in routed], [c for _, c in routed])
    mean_layers = k * torch.stack(per_layer).mean().item()
    assert isinstance(out.aux_loss, torch.Tensor)
    assert abs(pooled.item() - out.aux_loss.item()) < AUX_TOL
    assert abs(mean_layers - out.aux_loss.item()) > 10 * AUX_TOL  # the two definitions differ


def test_router_matches_qwen3_options():
    """Softmax scores, the top-k renormalised: the chosen weights sum to one, probs to one."""
    args = model_args_from_hf_config(HF_CONFIG.to_dict())
    router = Router(args)
    probs, chosen, weights = router(torch.randn(5, args.dim), torch.zeros(args.n_experts))
    assert torch.allclose(probs.sum(-1), torch.ones(5)) and torch.allclose(weights.sum(-1), torch.ones(5))
    assert torch.equal(weights, probs.gather(1, chosen) / probs.gather(1, chosen).sum(-1, keepdim=True))


def test_unsupported_models_are_one_line_errors():
    with pytest.raises(InteropError, match="config.json describes \\['MixtralForCausalLM'\\]"):
        adapter_for_config({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    with pytest.raises(InteropError, match="n_shared_experts"):
        hf_config(FLAVORS["debugmoe"], torch.float32)
    with pytest.raises(InteropError, match="mlp_only_layers"):
        model_args_from_hf_config({**HF_CONFIG.to_dict(), "mlp_only_layers": [0]})


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"num_experts": 0}, "`num_experts` = 0"),  # was refused as "unexpected keys"
        ({"num_experts": -2}, "`num_experts` = -2"),
        ({"num_experts_per_tok": 0}, "`num_experts_per_tok` = 0"),
        ({"num_experts_per_tok": 16}, "`num_experts_per_tok` = 16"),
        ({"moe_intermediate_size": 0}, "`moe_intermediate_size` = 0"),
        ({"num_hidden_layers": 0}, "`num_hidden_layers` = 0"),
        ({"hidden_size": 0}, "`hidden_size` = 0"),
        ({"num_attention_heads": 0}, "`num_attention_heads` = 0"),
        ({"num_key_value_heads": 3}, "`num_key_value_heads` = 3"),
        ({"vocab_size": 0}, "`vocab_size` = 0"),
    ],
)
def test_a_config_no_model_can_be_built_of_is_one_line_naming_the_key(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict, named: str
):
    """Through the import script: each MoE config key out of its range is named with its value
    (the ranges themselves: ``test_hf_validation.py``)."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(SystemExit) as exited:
        convert_from_hf.main([str(folder), str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "ckpt").exists()
