"""The Hugging Face round trip of docs/hf.md, as a user runs it: train
``train_configs/tiny_qwen3_moe.toml`` (or ``tiny_qwen3.toml``, dense with a tied output, or
``tiny_deepseek_v3.toml``, whose learned routing bias is exported with the weights) a few
steps through ``./run_train.sh``, export the checkpoint with ``convert_to_hf.py``, load it with
transformers' ``AutoModelForCausalLM``, compare its logits with ours, and import it back with
``convert_from_hf.py``, bit for bit.
The debug MoE, with its shared expert and dense first block, is refused in one line instead.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import run_train
from hf_helpers import run_script
from transformers import AutoModelForCausalLM

from trainer.checkpoint.folders import read_model_args
from trainer.checkpoint.model_entry import load_dcp_model, read_dcp_model
from trainer.model.llama3 import Transformer

pytestmark = pytest.mark.launcher

LOGITS_TOL = 1e-5  # as test_hf_qwen3_moe.py: fp32 round-off of the same model
SHORT = ["--training.steps", "2", "--checkpoint.interval", "2", "--training.seq_len", "32"]
SHORT += ["--training.local_batch_size", "2", "--training.global_batch_size", "4", "--model.n_layers", "2"]


@pytest.mark.parametrize(
    ("config", "architecture"),
    [
        ("tiny_qwen3_moe.toml", "Qwen3MoeForCausalLM"),
        ("tiny_qwen3.toml", "Qwen3ForCausalLM"),
        ("tiny_deepseek_v3.toml", "DeepseekV3ForCausalLM"),
    ],
)
def test_a_tiny_run_goes_to_transformers_and_back(tmp_path: Path, config: str, architecture: str):
    dump = tmp_path / "run"
    done = run_train(1, ["--config", config, "--job.dump_folder", str(dump), *SHORT])
    assert done.returncode == 0, done.stderr[-3000:]
    step = dump / "checkpoint" / "step-2"
    exported = run_script("convert_to_hf.py", step, tmp_path / "hf", "--dtype", "float32")
    assert exported.returncode == 0 and "warning" not in exported.stderr, exported.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]

    args = read_model_args(step)
    ours = Transformer(args)
    load_dcp_model(ours, step)  # a tied matrix, saved once, given to both its names
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(tokens) - theirs(tokens).logits).abs().max().item() < LOGITS_TOL

    imported = run_script("convert_from_hf.py", tmp_path / "hf", tmp_path / "back")
    assert imported.returncode == 0, imported.stderr
    trained, back = read_dcp_model(step), read_dcp_model(tmp_path / "back")
    assert replace(read_model_args(tmp_path / "back"), vocab_from_tokenizer=True) == args  # a flavor's flag
    for name, tensor in back.items():
        assert torch.equal(tensor, trained[name]), name


def test_the_debug_moe_is_refused_at_export_in_one_line(tmp_path: Path):
    dump = tmp_path / "run"
    seed = ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
    done = run_train(1, ["--config", "debug_moe.toml", "--job.dump_folder", str(dump), *seed, *SHORT])
    assert done.returncode == 0, done.stderr[-3000:]
    refused = run_script("convert_to_hf.py", dump / "checkpoint" / "step-0", tmp_path / "hf")
    err = refused.stderr.strip()
    assert refused.returncode == 2 and len(err.splitlines()) == 1, err
    assert "{'n_shared_experts': 1, 'n_dense_layers': 1} cannot be a Qwen3MoeForCausalLM" in err
    assert "train a flavor it can hold (`qwen3_moe_debug`, as train_configs/tiny_qwen3_moe.toml" in err
    assert not (tmp_path / "hf").exists()
