"""Hugging Face folders read slice by slice and written tensor by tensor: each rank reads only
what it holds, bit for bit what the whole folder gives, and an export holds one tensor at a time."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import BASE_ARGV, ROOT, run_cases, trainer_for
from hf_helpers import CONFIGS, assert_same_tensors, build_model, one_at_a_time, run_script
from hf_tokenizer import build
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from trainer.checkpoint.hf_folders import HFFolder, export_hf_folder, load_hf_folder, save_hf_folder
from trainer.checkpoint.hf_load import load_hf_weights
from trainer.checkpoint.model_entry import write_dcp_model
from trainer.config import load_config
from trainer.data.tokenizer import load_tokenizer
from trainer.model.hf_llama3 import InteropError, check_hf_shapes, from_hf_state_dict, read_box
from trainer.model.llama3 import Transformer
from trainer.model.tiled_init import local_slice
from trainer.planning.job_plan import resolve_job


def _boxes(shape: torch.Size, cuts: int) -> list[tuple[slice, ...]]:
    """Every box of ``shape`` whose edges fall on one of ``cuts + 1`` evenly spaced cuts per dimension."""
    edges = [sorted({round(n * k / cuts) for k in range(cuts + 1)}) for n in shape]
    spans = [[slice(a, b) for i, a in enumerate(e) for b in e[i + 1 :]] for e in edges]
    return [tuple(box) for box in itertools.product(*spans)]


@pytest.mark.parametrize("tied", [False, True])
def test_sliced_reads_equal_the_whole_conversion(tmp_path: Path, tied: bool):
    """Every box of every tensor, read alone from a bf16 sharded folder, equals the whole folder
    converted and sliced: boxes cutting through heads (head_dim 8, cuts every 64 / 7 rows) and
    columns, tensors spread over several files, and a tied ``lm_head`` read from the embedding."""
    model = build_model("gqa_rope_scaling")
    args = model.args
    save_hf_folder(tmp_path, model.state_dict(), args, torch.bfloat16, max_shard_bytes=20_000)
    if tied:
        _drop_lm_head(tmp_path)
    whole, _ = load_hf_folder(tmp_path)
    want = from_hf_state_dict(whole, args, tie_word_embeddings=tied)
    folder = HFFolder(tmp_path)
    assert len(folder.files) > 2
    check_hf_shapes(folder.shapes, args, tie_word_embeddings=tied)
    for name, tensor in want.items():
        for box in _boxes(tensor.shape, 7):
            got = read_box(name, args, box, folder.read, tie_word_embeddings=tied)
            assert got.dtype == torch.bfloat16 and torch.equal(got, tensor[box]), (name, box)


def _drop_lm_head(folder: Path) -> None:
    """Turn a saved folder into a tied one (Llama 3.2's layout): no ``lm_head.weight``."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    holder = index["weight_map"].pop("lm_head.weight")
    tensors = load_file(folder / holder)
    del tensors["lm_head.weight"]
    save_file(tensors, folder / holder, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))


def test_sliced_load_checks_names_and_shapes(tmp_path: Path):
    model = build_model("gqa_rope_scaling")
    save_hf_folder(tmp_path, model.state_dict(), model.args, torch.float32, max_shard_bytes=20_000)
    _drop_lm_head(tmp_path)
    shapes = HFFolder(tmp_path).shapes
    with pytest.raises(InteropError, match=r"missing keys \[lm_head\.weight\]"):
        check_hf_shapes(shapes, model.args, tie_word_embeddings=False)
    with pytest.raises(InteropError, match=r"`model.embed_tokens.weight` has shape \(256, 64\)"):
        check_hf_shapes(shapes, replace(model.args, vocab_size=512), tie_word_embeddings=True)


def hf_load_worker(argv: list[str], folder: str) -> list[str]:
    """Load ``folder`` into the model of ``argv`` on this mesh; the names of the parameters whose
    local shard differs from today's whole-folder conversion, sliced (or has the wrong dtype)."""
    p, job = trainer_for(argv)
    load_hf_weights(job.model, p.model_args, Path(folder))
    whole, config = load_hf_folder(folder)
    want = from_hf_state_dict(whole, p.model_args, tie_word_embeddings=bool(config.get("tie_word_embeddings")))
    wrong = []
    for name, param in job.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        expected = local_slice(want[name].to(local.dtype), param)
        if local.dtype != torch.float32 or not torch.equal(local.detach(), expected):
            wrong.append(name)
    return wrong


@pytest.mark.slow
def test_sliced_load_equals_the_whole_folder_on_every_mesh(tmp_path: Path):
    """FSDP, TP and PP ranks each read their own boxes of a bf16 sharded folder, and hold exactly
    what converting the whole folder and slicing it gives (one launch of two ranks)."""
    p = resolve_job(load_config(BASE_ARGV), 1)
    source = Transformer(p.model_args)
    source.init_weights(5)
    save_hf_folder(tmp_path, source.state_dict(), p.model_args, torch.bfloat16, max_shard_bytes=400_000)
    meshes = {"fsdp": "dp_shard=2", "tp": "tp=2", "pp": "pp=2"}
    argv = BASE_ARGV + ["--training.local_batch_size", "4"]
    cases = {name: (hf_load_worker, argv + ["--mesh", mesh], str(tmp_path)) for name, mesh in meshes.items()}
    for name, ranks in run_cases(2, cases).items():
        assert ranks == [[], []], name


def test_export_streams_one_tensor_at_a_time(tmp_path: Path):
    """Each tensor is read once, and the previous one is gone by the time the next is read: the
    export never holds a shard, let alone the model."""
    model = build_model("gqa_rope_scaling")
    sd = model.state_dict()
    read, order = one_at_a_time(sd)
    export_hf_folder(tmp_path, read, model.args, torch.float32, max_shard_bytes=20_000)
    assert order == list(sd)
    whole, _ = load_hf_folder(tmp_path)
    assert_same_tensors(from_hf_state_dict(whole, model.args), sd)


@pytest.mark.parametrize("kind", ["huggingface", "sentencepiece"])
def test_export_folder_loads_in_transformers_with_its_tokenizer(tmp_path: Path, kind: str):
    """The script's sharded bf16 export under a private umask: shards, index, configs and the
    tokenizer, all 0644, and transformers loads the model, its generation config and tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = build(tmp_path / "tok") if kind == "huggingface" else ROOT / "assets/tokenizer/shakespeare.model"
    args = CONFIGS["gqa_rope_scaling"]
    write_dcp_model(tmp_path / "ckpt", build_model("gqa_rope_scaling").state_dict(), args)
    old = os.umask(0o077)
    try:
        done = run_script(
            "convert_to_hf.py",
            tmp_path / "ckpt",
            tmp_path / "hf",
            "--tokenizer",
            tokenizer,
            "--max-shard-bytes",
            "20000",
        )
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "hf"
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json"] if kind == "huggingface" else ["tokenizer.model"]
    assert set(names) == {
        *shards,
        "model.safetensors.index.json",
        "config.json",
        "generation_config.json",
        *tokenizer_files,
    }
    assert {oct((out / n).stat().st_mode & 0o777) for n in names} == {"0o644"}
    assert LlamaForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    loaded = load_tokenizer(str(tokenizer))
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (loaded.bos_id, loaded.eos_id)
    if kind == "huggingface":
        assert AutoTokenizer.from_pretrained(out).encode("To be", add_special_tokens=False) == loaded.encode(
            "To be", bos=False, eos=False
        )
