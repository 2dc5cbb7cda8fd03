"""Qwen3 dense interop, transformers as an independent reference.

A tiny ``Qwen3ForCausalLM`` (heads apart from the width, q/k norms far from one) with random
weights, saved by transformers itself, tied and untied, is loaded through the trainer's own
``initial_load_in_hf`` path; the logits, the summed cross-entropy, every gradient, and the
weights after several AdamW steps on the same batches must match transformers', and the folder
must come back bit for bit through both converters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import ROOT
from hf_helpers import labelled_batch, load_ours, shifted
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.checkpoint.hf_folders import load_hf_folder, save_hf_folder
from trainer.checkpoint.hf_load import check_folder_config, load_hf_weights
from trainer.loss import IGNORE_INDEX
from trainer.model.hf_architectures import adapter_for_args, adapter_for_config
from trainer.model.hf_llama3 import InteropError
from trainer.model.hf_qwen3 import (
    from_hf_state_dict,
    hf_config,
    hf_layout,
    model_args_from_hf_config,
    read_box,
    to_hf_state_dict,
)
from trainer.model.llama3 import FLAVORS as LLAMA_FLAVORS
from trainer.model.llama3 import Transformer, model_args, num_params, whole_model
from trainer.model.qwen3 import FLAVORS

sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_hf
import convert_to_hf

SEQ_LEN = 64
LOGITS_TOL = 1e-5
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5  # of the largest gradient of the tensor
STEP_TOL = 1e-4  # of the tensor's largest entry: Adam divides round-off in a near-zero gradient by its own size
STEPS = 4


def hf_model_config(tie: bool) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # apart from hidden_size / heads, as Qwen3-0.6B's 128 of 1024 / 16
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=tie,
        rope_theta=1000000.0,
    )


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with random weights (norms far from one), saved by ``save_pretrained``."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_model_config(request.param))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(
                1 + 0.3 * torch.randn(p.shape, generator=gen)
                if p.dim() == 1
                else 0.1 * torch.randn(p.shape, generator=gen)
            )
    path = tmp_path_factory.mktemp("qwen3") / "hf"
    model.save_pretrained(path)
    return path


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return labelled_batch(seed, 512, SEQ_LEN)


def test_the_tie_is_kept(hf_dir: Path):
    ours = load_ours(hf_dir)
    tied = json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"]
    assert ours.args.tie_embeddings is tied
    assert (ours.output.weight is ours.tok_embeddings.weight) is tied
    names = [n for n, _ in ours.named_parameters()]
    assert ("output.weight" in names) is not tied
    saved, _ = load_hf_folder(hf_dir)
    assert ("lm_head.weight" in saved) is not tied


def test_logits_loss_and_grads_match_transformers(hf_dir: Path):
    ours = load_ours(hf_dir)
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir)
    tokens, labels = batch(2)
    with torch.no_grad():
        logits_diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    loss = ours(tokens, labels=labels)
    hf_loss = hf(tokens, labels=shifted(labels), num_items_in_batch=1).loss  # a sum: divided by 1
    loss.backward()
    hf_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    ours_grads = to_hf_state_dict(grads, ours.args)
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert sorted(ours_grads) == sorted(theirs)
    grad_rel = max((ours_grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in theirs.items())
    assert logits_diff < LOGITS_TOL
    assert abs(loss.item() - hf_loss.item()) / hf_loss.item() < LOSS_RTOL
    assert grad_rel < GRAD_RTOL


def test_adamw_steps_match_transformers(hf_dir: Path):
    """The same batches, the same AdamW: the losses and the weights stay together step after
    step (a tied embedding gets both its gradients, or its weights part)."""
    ours = load_ours(hf_dir)
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir)
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
    mine = to_hf_state_dict({n: p.detach() for n, p in ours.named_parameters()}, ours.args)
    theirs = {n: p.detach() for n, p in hf.named_parameters()}
    assert sorted(mine) == sorted(theirs)
    worst = max((mine[n] - t).abs().max().item() / t.abs().max().item() for n, t in theirs.items())
    assert worst < STEP_TOL


def test_export_is_bitwise(hf_dir: Path, tmp_path: Path):
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    ours = from_hf_state_dict(original, args)
    loaded = {n: p.detach() for n, p in load_ours(hf_dir).named_parameters()}
    assert list(loaded) == list(ours) and all(torch.equal(loaded[n], t) for n, t in ours.items())
    save_hf_folder(tmp_path / "out", ours, args, torch.float32)
    exported, exported_config = load_hf_folder(tmp_path / "out")
    assert model_args_from_hf_config(exported_config) == args
    assert exported_config["tie_word_embeddings"] is args.tie_embeddings
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_boxes_are_slices_of_the_whole(hf_dir: Path):
    """What a rank reads under FSDP or TP (rows, columns cutting through heads) equals the
    whole conversion sliced."""
    original, config = load_hf_folder(hf_dir)
    args = model_args_from_hf_config(config)
    whole = from_hf_state_dict(original, args)
    read = lambda n, box: original[n][box]  # noqa: E731
    for name, (_, shape) in hf_layout(args).items():
        box = tuple(slice(n // 4, n // 4 + max(1, n // 2)) for n in shape)
        assert torch.equal(read_box(name, args, box, read), whole[name][box]), name


def test_converters_round_trip(hf_dir: Path, tmp_path: Path):
    """Through the scripts: a training checkpoint (a tied matrix saved once), and back."""
    convert_from_hf.main([str(hf_dir), str(tmp_path / "ckpt")])
    convert_to_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "back"), "--dtype", "float32"])
    original, _ = load_hf_folder(hf_dir)
    back, config = load_hf_folder(tmp_path / "back")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], t) for n, t in original.items())


# Hugging Face's Qwen/Qwen3-*/config.json, the keys that differ between the sizes.
PUBLISHED = {
    "0.6B": (1024, 28, 16, 3072, True),
    "1.7B": (2048, 28, 16, 6144, True),
    "4B": (2560, 36, 32, 9728, True),
    "8B": (4096, 36, 32, 12288, False),
    "14B": (5120, 40, 40, 17408, False),
    "32B": (5120, 64, 64, 25600, False),
}
PUBLISHED_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Qwen's model cards: total and non-embedding parameters, in billions.
PUBLISHED_COUNTS = {
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
}


def published(flavor: str) -> dict:
    dim, layers, heads, ffn, tie = PUBLISHED[flavor]
    return {
        **PUBLISHED_COMMON,
        "hidden_size": dim,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": ffn,
        "tie_word_embeddings": tie,
    }


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_configs_load_into_their_flavor(flavor: str):
    """``initial_load_in_hf`` of the published folder into our flavor passes the config check;
    the tie is part of the model."""
    args = model_args(flavor, 151665, 4096, flavors=FLAVORS)
    assert check_folder_config(published(flavor), args, Path(flavor)).ARCHITECTURE == "Qwen3ForCausalLM"
    flipped = {**published(flavor), "tie_word_embeddings": not args.tie_embeddings}
    with pytest.raises(InteropError, match="tie_embeddings"):
        check_folder_config(flipped, args, Path(flavor))


@pytest.mark.parametrize("flavor", list(PUBLISHED_COUNTS))
def test_published_parameter_counts(flavor: str):
    total, non_embedding = PUBLISHED_COUNTS[flavor]
    model = whole_model(FLAVORS[flavor])
    counted = num_params(model)
    assert counted / 1e9 == pytest.approx(total, rel=0.02)
    embedding = FLAVORS[flavor].vocab_size * FLAVORS[flavor].dim
    assert (counted - embedding * (1 if FLAVORS[flavor].tie_embeddings else 2)) / 1e9 == pytest.approx(
        non_embedding, rel=0.02
    )


def test_each_family_has_its_adapter():
    assert adapter_for_args(FLAVORS["qwen3_debug"]).ARCHITECTURE == "Qwen3ForCausalLM"
    assert adapter_for_config(published("8B")).ARCHITECTURE == "Qwen3ForCausalLM"
    assert hf_config(FLAVORS["qwen3_debug"], torch.bfloat16)["tie_word_embeddings"] is True
    with pytest.raises(InteropError, match="cannot be a Qwen3ForCausalLM"):
        hf_config(LLAMA_FLAVORS["debugmodel"], torch.bfloat16)


def test_a_llama_folder_is_not_a_qwen3_flavor(tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    ).save_pretrained(tmp_path)
    args = model_args_from_hf_config(hf_config(FLAVORS["qwen3_debug"], torch.float32))
    with pytest.raises(InteropError, match="qk_norm: False there, True here"):
        load_hf_weights(Transformer(args), args, tmp_path)


def test_unsupported_configs_are_one_line_errors():
    cfg = hf_config(FLAVORS["qwen3_debug"], torch.float32)
    for key, value, says in (
        ("use_sliding_window", True, "use_sliding_window"),
        ("attention_bias", True, "attention_bias"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "RoPE scaling"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
    ):
        with pytest.raises(InteropError, match=says) as err:
            model_args_from_hf_config({**cfg, key: value})
        assert "\n" not in str(err.value)
