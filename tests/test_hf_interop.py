"""Hugging Face interop: bit-exact conversions, transformers computing our logits, the scripts.

Two shapes: the debug flavor (16 heads over 8 KV heads, plain RoPE) and a tiny GQA model with
Llama 3.1 RoPE scaling (8 heads over 2 KV heads). With head_dim 8 and theta 500000 the tiny
model's four RoPE frequencies fall into all three bands of the scaling (kept, blended, divided),
so a wrong scaling, like a wrong q/k permutation, shows in the logits.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_helpers import CONFIGS, SEQ_LEN, assert_same_tensors, build_model, run_script
from transformers import LlamaForCausalLM

from trainer.checkpoint.folders import read_model_args
from trainer.checkpoint.hf_folders import HFFolder, load_hf_folder, save_hf_folder
from trainer.checkpoint.model_entry import read_dcp_model, write_dcp_model
from trainer.model.hf_llama3 import (
    InteropError,
    from_hf_state_dict,
    hf_config,
    model_args_from_hf_config,
    to_hf_state_dict,
)
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer
from trainer.runtime.errors import ConfigError

LOGITS_TOL = 1e-5


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest) -> Transformer:
    return build_model(request.param)


def assert_same_shapes(got: ModelArgs, want: ModelArgs) -> None:
    """Equal up to fields that do not change the weights (how the FFN size or vocab was derived)."""
    for field in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_seq_len",
    ):
        assert getattr(got, field) == getattr(want, field), field
    if want.rope_scaling:
        assert got.rope_scaling_factor == want.rope_scaling_factor


def logits_max_abs_diff(model: Transformer, hf_dir: Path) -> float:
    hf = LlamaForCausalLM.from_pretrained(hf_dir)
    assert hf.dtype == torch.float32
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (hf(tokens).logits - model(tokens)).abs().max().item()


# --------------------------------------------------------------------------------------------
# Bit-exact conversions
# --------------------------------------------------------------------------------------------


def test_round_trip_is_bitwise(model: Transformer):
    args, sd = model.args, model.state_dict()
    hf_sd = to_hf_state_dict(sd, args)
    assert hf_sd["model.layers.1.mlp.gate_proj.weight"] is sd["layers.1.feed_forward.w1.weight"]
    assert hf_sd["model.layers.1.mlp.up_proj.weight"] is sd["layers.1.feed_forward.w3.weight"]
    assert hf_sd["model.layers.1.mlp.down_proj.weight"] is sd["layers.1.feed_forward.w2.weight"]
    assert hf_sd["lm_head.weight"] is sd["output.weight"]
    assert not torch.equal(hf_sd["model.layers.0.self_attn.k_proj.weight"], sd["layers.0.attention.wk.weight"])
    assert_same_tensors(from_hf_state_dict(hf_sd, args), sd)


def test_folder_round_trip_is_bitwise(model: Transformer, tmp_path: Path):
    save_hf_folder(tmp_path, model.state_dict(), model.args, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    hf_sd, config = load_hf_folder(tmp_path)
    args = model_args_from_hf_config(config)
    assert_same_shapes(args, model.args)
    assert_same_tensors(from_hf_state_dict(hf_sd, args), model.state_dict())


def test_sharded_folder(tmp_path: Path):
    model = build_model("gqa_rope_scaling")
    save_hf_folder(tmp_path, model.state_dict(), model.args, torch.float32, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    hf_sd, config = load_hf_folder(tmp_path)
    assert_same_tensors(from_hf_state_dict(hf_sd, model_args_from_hf_config(config)), model.state_dict())
    assert logits_max_abs_diff(model, tmp_path) < LOGITS_TOL  # from_pretrained reads the shards too


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_config_round_trip_keeps_flavor_settings(flavor: str):
    args = replace(FLAVORS[flavor], vocab_from_tokenizer=False)
    assert model_args_from_hf_config(hf_config(args, torch.bfloat16)) == replace(args, n_kv_heads=args.kv_heads)


@pytest.mark.parametrize("ffn_dim_multiplier", [None, 0.3, 1.7])
def test_config_round_trip_any_ffn_size(ffn_dim_multiplier: float | None):
    args = replace(ModelArgs(), dim=320, multiple_of=96, ffn_dim_multiplier=ffn_dim_multiplier)
    config = hf_config(args, torch.float32)
    assert model_args_from_hf_config(config).ffn_hidden_dim == config["intermediate_size"] == args.ffn_hidden_dim


def test_config_json_fields():
    config = hf_config(CONFIGS["gqa_rope_scaling"], torch.bfloat16)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 8)
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert hf_config(CONFIGS["debugmodel"], torch.float32)["rope_scaling"] is None


# --------------------------------------------------------------------------------------------
# transformers computes our logits
# --------------------------------------------------------------------------------------------


def test_transformers_logits_match(model: Transformer, tmp_path: Path):
    save_hf_folder(tmp_path, model.state_dict(), model.args, torch.float32)
    diff = logits_max_abs_diff(model, tmp_path)
    print(f"logits max abs diff ({model.args.dim=}, {model.args.rope_scaling=}): {diff:.3g}")
    assert diff < LOGITS_TOL


def test_rope_scaling_changes_the_logits(tmp_path: Path):
    """The control for the test above: the same weights without the scaling are far off."""
    model = build_model("gqa_rope_scaling")
    save_hf_folder(tmp_path, model.state_dict(), model.args, torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    assert logits_max_abs_diff(model, tmp_path) > 1e-3


def test_folder_saved_by_transformers_converts_back(tmp_path: Path):
    """``save_pretrained`` writes its own spelling (transformers 5: ``rope_parameters``, ``dtype``)."""
    model = build_model("gqa_rope_scaling")
    save_hf_folder(tmp_path / "ours", model.state_dict(), model.args, torch.float32)
    LlamaForCausalLM.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    hf_sd, config = load_hf_folder(tmp_path / "theirs")
    args = model_args_from_hf_config(config)
    assert_same_shapes(args, model.args)
    assert_same_tensors(from_hf_state_dict(hf_sd, args), model.state_dict())


def test_tied_embeddings_become_the_output_matrix():
    model = build_model("gqa_rope_scaling")
    hf_sd = to_hf_state_dict(model.state_dict(), model.args)
    del hf_sd["lm_head.weight"]
    ours = from_hf_state_dict(hf_sd, model.args, tie_word_embeddings=True)
    assert torch.equal(ours["output.weight"], ours["tok_embeddings.weight"])
    assert ours["output.weight"].data_ptr() != ours["tok_embeddings.weight"].data_ptr()


# --------------------------------------------------------------------------------------------
# Training checkpoints and the scripts
# --------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as intended
def test_read_dcp_model_takes_only_the_model(tmp_path: Path):
    """A full training checkpoint: the optimizer, scheduler and train state are left unread."""
    model = build_model("gqa_rope_scaling")
    sd = model.state_dict()
    state = {
        "model": sd,
        "optimizer": {"state": {name: {"exp_avg": torch.zeros_like(t)} for name, t in sd.items()}},
        "train_state": {"step": 3},
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert_same_tensors(read_dcp_model(tmp_path), sd)


def test_scripts_end_to_end(tmp_path: Path):
    args = CONFIGS["debugmodel"]
    model = build_model("debugmodel")
    write_dcp_model(tmp_path / "ckpt", model.state_dict(), args)
    assert read_model_args(tmp_path / "ckpt") == args

    done = run_script("convert_to_hf.py", tmp_path / "ckpt", tmp_path / "hf", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    done = run_script("convert_from_hf.py", tmp_path / "hf", tmp_path / "back")
    assert done.returncode == 0, done.stderr

    assert_same_tensors(read_dcp_model(tmp_path / "back"), model.state_dict())
    assert_same_shapes(read_model_args(tmp_path / "back"), args)


def test_convert_to_hf_defaults_to_bfloat16(tmp_path: Path):
    args = CONFIGS["gqa_rope_scaling"]
    model = build_model("gqa_rope_scaling")
    write_dcp_model(tmp_path / "ckpt", model.state_dict(), args)
    done = run_script("convert_to_hf.py", tmp_path / "ckpt", tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    hf_sd, config = load_hf_folder(tmp_path / "hf")
    assert config["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in hf_sd.values()} == {torch.bfloat16}
    ours = from_hf_state_dict(hf_sd, args)
    assert torch.equal(
        ours["layers.0.attention.wq.weight"], model.state_dict()["layers.0.attention.wq.weight"].bfloat16()
    )


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_not_a_checkpoint(tmp_path: Path):
    with pytest.raises(InteropError, match="is not a torch.distributed.checkpoint folder"):
        read_dcp_model(tmp_path)
    with pytest.raises(InteropError, match="missing does not exist; pass a `{dump_folder}/checkpoint/step-N`"):
        read_dcp_model(tmp_path / "missing")

    args = CONFIGS["gqa_rope_scaling"]
    write_dcp_model(tmp_path / "checkpoint" / "step-10", build_model("gqa_rope_scaling").state_dict(), args)
    with pytest.raises(InteropError, match=r"It holds \[step-10\]: pass one of those folders"):
        read_dcp_model(tmp_path / "checkpoint")

    done = run_script("convert_to_hf.py", tmp_path / "checkpoint", tmp_path / "hf")
    assert done.returncode == 2
    assert "convert_to_hf: error:" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as intended
def test_checkpoint_without_model(tmp_path: Path):
    dcp.save({"optimizer": {"lr": torch.tensor(1.0)}}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(InteropError, match=r"no `model` entry \(top-level entries: \['optimizer'\]\)"):
        read_dcp_model(tmp_path)


def test_missing_and_unexpected_keys(tmp_path: Path):
    args = CONFIGS["gqa_rope_scaling"]
    sd = build_model("gqa_rope_scaling").state_dict()
    hf_sd = to_hf_state_dict(sd, args)
    del hf_sd["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(InteropError, match=r"missing keys \[model\.layers\.1\.self_attn\.v_proj\.weight\]"):
        from_hf_state_dict(hf_sd, args)
    with pytest.raises(InteropError, match=r"unexpected keys \[_orig_mod\.norm\.weight\]"):
        to_hf_state_dict({**sd, "_orig_mod.norm.weight": sd["norm.weight"]}, args)
    with pytest.raises(InteropError, match=r"missing keys \[layers\.1\.ffn_norm\.weight\]"):
        write_dcp_model(tmp_path, {k: t for k, t in sd.items() if k != "layers.1.ffn_norm.weight"}, args)


def test_wrong_shapes_name_the_key():
    args = CONFIGS["gqa_rope_scaling"]
    sd = build_model("gqa_rope_scaling").state_dict()
    with pytest.raises(
        InteropError, match=r"`tok_embeddings.weight` has shape \(256, 64\) but the model args give \(512, 64\)"
    ):
        to_hf_state_dict(sd, replace(args, vocab_size=512))


def test_unsupported_configs():
    config = hf_config(CONFIGS["gqa_rope_scaling"], torch.float32)
    with pytest.raises(InteropError, match="RoPE scaling .* is not supported"):
        model_args_from_hf_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(InteropError, match="has no `rope_theta`"):
        model_args_from_hf_config({k: v for k, v in config.items() if k != "rope_theta"})
    with pytest.raises(InteropError, match="only LlamaForCausalLM converts"):
        model_args_from_hf_config({**config, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(InteropError, match="no biases"):
        model_args_from_hf_config({**config, "attention_bias": True})


def test_folder_errors(tmp_path: Path):
    args = CONFIGS["gqa_rope_scaling"]
    sd = build_model("gqa_rope_scaling").state_dict()
    with pytest.raises(InteropError, match="has no config.json"):
        load_hf_folder(tmp_path)
    with pytest.raises(InteropError, match="is not a torch.distributed.checkpoint folder"):
        read_model_args(tmp_path)

    save_hf_folder(tmp_path / "hf", sd, args, torch.float32)
    with pytest.raises(InteropError, match=r"already holds \['config.json', 'model.safetensors'\]"):
        save_hf_folder(tmp_path / "hf", sd, args, torch.float32)
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(InteropError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_folder(tmp_path / "hf")

    write_dcp_model(tmp_path / "ckpt", sd, args)
    with pytest.raises(InteropError, match="is not empty"):
        write_dcp_model(tmp_path / "ckpt", sd, args)
    (tmp_path / "ckpt" / "model_args.json").unlink()  # another trainer's checkpoint
    with pytest.raises(InteropError, match="model_args.json does not exist; the trainer writes it"):
        read_model_args(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model_args.json").write_text(json.dumps({"dim": 64, "n_expert": 8}))
    with pytest.raises(InteropError, match=r"unknown ModelArgs fields \['n_expert'\]"):
        read_model_args(tmp_path / "ckpt")


def test_damaged_hf_folders_are_named(tmp_path: Path):
    """Each file of a folder damaged as a torn download leaves it: an InteropError naming the file
    (which the converters print as one line), not the JSON or safetensors parser's traceback."""
    args = CONFIGS["gqa_rope_scaling"]
    sd = build_model("gqa_rope_scaling").state_dict()
    save_hf_folder(tmp_path / "single", sd, args, torch.float32)
    save_hf_folder(tmp_path / "sharded", sd, args, torch.float32, max_shard_bytes=200_000)
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    for damaged, how in (
        (tmp_path / "single" / "config.json", "not valid JSON"),
        (tmp_path / "sharded" / "model.safetensors.index.json", "not valid JSON"),
        (shard, "not a readable safetensors file"),
    ):
        intact = damaged.read_bytes()
        damaged.write_bytes(intact[: len(intact) // 2])
        with pytest.raises(InteropError, match=f"{damaged.name} .*{how}"):
            load_hf_folder(damaged.parent)
        damaged.write_bytes(intact)


def test_safetensors_is_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    args = CONFIGS["gqa_rope_scaling"]
    save_hf_folder(tmp_path, build_model("gqa_rope_scaling").state_dict(), args, torch.float32)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ConfigError, match=r"pip install safetensors"):
        HFFolder(tmp_path)
