"""The converters refuse a model that cannot exist, in both directions, in one line naming the
key or tensor: a ``config.json`` key out of range or inconsistent with another, a tensor holding
NaN or infinity, weights of the other family (dense for MoE, MoE for dense), and on export a
``model_args.json`` that no Hugging Face config can describe or that its tensors contradict.

Each case is one edit of a valid tiny folder or checkpoint, so the refusal is the edit's; the
unedited ones convert (``test_the_unedited_folders_convert``). Through the scripts' ``main``, a
few through the scripts themselves and through ``checkpoint.initial_load_in_hf``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import ROOT, run_ranks
from hf_helpers import run_script
from safetensors.torch import load_file, save_file

from trainer.checkpoint.folders import MODEL_ARGS_FILE
from trainer.checkpoint.hf_folders import save_hf_folder
from trainer.checkpoint.hf_load import load_hf_weights
from trainer.checkpoint.integrity import add_to_manifest
from trainer.checkpoint.model_entry import write_dcp_model
from trainer.entry import launch
from trainer.model.hf_llama3 import InteropError
from trainer.model.hf_qwen3_moe import MOE_FIELDS
from trainer.model.llama3 import ModelArgs, Transformer
from trainer.model.moe import MoEArgs

sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_hf
import convert_to_hf

MOE = MoEArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_size=32,
    vocab_size=256,
    rope_scaling=False,
    qk_norm=True,
    n_experts=8,
    top_k=2,
    moe_hidden_dim=32,
    max_seq_len=64,
)
LLAMA = ModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=64, rope_scaling=True, max_seq_len=64
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Hugging Face folder and a training checkpoint of each family (a few hundred kB)."""
    root = tmp_path_factory.mktemp("validation")
    for name, args in (("moe", MOE), ("llama", LLAMA)):
        model = Transformer(args)
        model.init_weights(0)
        params = {n: p.detach() for n, p in model.named_parameters()}
        save_hf_folder(root / f"{name}_hf", params, args, torch.float32)
        write_dcp_model(root / f"{name}_checkpoint", params, args)
    return {p.name: p for p in root.iterdir()}


def refused(main: Callable[[list[str]], None], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a script's ``main`` printed, refusing with exit code 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def edited_folder(source: Path, to: Path, config: dict[str, Any] | None = None, tensor: Any = None) -> Path:
    """A copy of the Hugging Face folder ``source`` with ``config`` merged into its config.json
    and ``tensor`` (name, index, value) written into one of its weights."""
    shutil.copytree(source, to)
    if config:
        path = to / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensor:
        name, index, value = tensor
        weights = load_file(to / "model.safetensors")
        weights[name][index] = value
        save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


def edited_checkpoint(source: Path, to: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the checkpoint ``source`` whose model_args.json ``edit`` changed, its checksums
    rewritten: the checkpoint is whole, only its model is impossible."""
    shutil.copytree(source, to)
    path = to / MODEL_ARGS_FILE
    values = json.loads(path.read_text())
    edit(values)
    path.write_text(json.dumps(values))
    add_to_manifest(to, [MODEL_ARGS_FILE])
    return to


# config.json edits of the MoE folder -> what the one line must say.
MOE_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "top-k above the experts": (
        {"num_experts_per_tok": 16},
        "`num_experts_per_tok` = 16 is more than `num_experts` = 8",
    ),
    "top-k 0": ({"num_experts_per_tok": 0}, "`num_experts_per_tok` = 0: it must be a whole number of at least 1"),
    "no experts": ({"num_experts": 0}, "`num_experts` = 0: a Mixture-of-Experts needs at least 1 expert"),
    "negative experts": ({"num_experts": -8}, "`num_experts` = -8: it must be a whole number of at least 1"),
    "experts as text": ({"num_experts": "8"}, "`num_experts` = '8': it must be a whole number"),
    "fractional experts": ({"num_experts": 7.5}, "`num_experts` = 7.5: it must be a whole number"),
    "expert width 0": ({"moe_intermediate_size": 0}, "`moe_intermediate_size` = 0: it must be a whole number"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "`num_key_value_heads` = 3 does not divide"),
    "kv heads 0": ({"num_key_value_heads": 0}, "`num_key_value_heads` = 0: it must be a whole number"),
    "heads 0": ({"num_attention_heads": 0}, "`num_attention_heads` = 0: it must be a whole number"),
    "odd head size": (
        {"head_dim": 31},
        "the head size (`head_dim`, or `hidden_size` / `num_attention_heads`) is 31: RoPE rotates pairs of a head's channels, so it must be even",
    ),
    "width 0": ({"hidden_size": 0}, "`hidden_size` = 0: it must be a whole number"),
    "vocabulary 0": ({"vocab_size": 0}, "`vocab_size` = 0: it must be a whole number"),
    "no layers": ({"num_hidden_layers": 0}, "`num_hidden_layers` = 0: it must be a whole number"),
    "layers as a flag": ({"num_hidden_layers": True}, "`num_hidden_layers` = True: it must be a whole number"),
    "no positions": ({"max_position_embeddings": 0}, "`max_position_embeddings` = 0: it must be a whole number"),
    "norm epsilon 0": ({"rms_norm_eps": 0}, "`rms_norm_eps` = 0: it must be a finite number above 0"),
    "norm epsilon NaN": ({"rms_norm_eps": math.nan}, "`rms_norm_eps` = nan: it must be a finite number above 0"),
    "RoPE base negative": ({"rope_theta": -1.0}, "`rope_theta` = -1.0: it must be a finite number above 0"),
    "sparse step 0": ({"decoder_sparse_step": 0}, "`decoder_sparse_step` = 0: every `decoder_sparse_step`-th"),
    "sparse step past the layers": ({"decoder_sparse_step": 3}, "no layer routes: `decoder_sparse_step` = 3"),
    "dense layer outside": ({"mlp_only_layers": [5]}, "`mlp_only_layers` names layers [5], outside the model's 2"),
    "every layer dense": (
        {"mlp_only_layers": [0, 1]},
        "no layer routes: `decoder_sparse_step` = 1 and `mlp_only_layers` = [0, 1] leave all 2 layers dense",
    ),
    "dense layers not a list": ({"mlp_only_layers": "0"}, "`mlp_only_layers` = '0': it must be a list of layer"),
}

LLAMA_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "FFN width 0": ({"intermediate_size": 0}, "`intermediate_size` = 0: it must be a whole number"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "`num_key_value_heads` = 3 does not divide"),
    "vocabulary negative": ({"vocab_size": -1}, "`vocab_size` = -1: it must be a whole number"),
    "norm epsilon infinite": ({"rms_norm_eps": math.inf}, "`rms_norm_eps` = inf: it must be a finite number"),
    "RoPE base 0 (transformers 5)": (
        {"rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
        "`rope_theta` = 0: it must be a finite number above 0",
    ),
    "RoPE factor 0": (
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 0.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },
        "the RoPE scaling `factor` = 0.0: it must be a finite number above 0",
    ),
}


@pytest.mark.parametrize(
    ("family", "case"),
    [("moe", case) for case in MOE_CONFIGS] + [("llama", case) for case in LLAMA_CONFIGS],
)
def test_an_impossible_config_is_not_imported(folders, tmp_path, capsys, family, case):
    edit, message = (MOE_CONFIGS if family == "moe" else LLAMA_CONFIGS)[case]
    folder = edited_folder(folders[f"{family}_hf"], tmp_path / "hf", config=edit)
    err = refused(convert_from_hf.main, [str(folder), str(tmp_path / "out")], capsys)
    assert f"config.json: {message}" in err, err
    assert not (tmp_path / "out").exists()


BAD_TENSORS = {
    "an expert's weight": ("model.layers.1.mlp.experts.3.up_proj.weight", (5, 7)),
    "the router": ("model.layers.0.mlp.gate.weight", (2, 0)),
    "a q norm": ("model.layers.1.self_attn.q_norm.weight", (4,)),
    "the embedding": ("model.embed_tokens.weight", (255, 63)),
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("case", BAD_TENSORS)
def test_a_non_finite_weight_is_not_imported_nor_loaded(folders, tmp_path, capsys, case, value):
    name, index = BAD_TENSORS[case]
    folder = edited_folder(folders["moe_hf"], tmp_path / "hf", tensor=(name, index, value))
    err = refused(convert_from_hf.main, [str(folder), str(tmp_path / "out")], capsys)
    assert f"model.safetensors: `{name}` holds NaN or infinite values" in err, err
    model = Transformer(MOE)
    with pytest.raises(InteropError, match=f"`{name}` holds NaN or infinite values"):
        load_hf_weights(model, MOE, folder)


def load_on_this_rank(folders: list[Path]) -> str | None:
    """Rank r loads ``folders[r]``; the error it raises, if any."""
    dist.init_process_group("gloo")
    try:
        load_hf_weights(Transformer(MOE), MOE, folders[dist.get_rank()])
    except InteropError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_a_non_finite_weight_one_rank_reads_fails_every_rank_with_its_line(folders, tmp_path):
    """As a NaN in one rank's shard: without agreeing, the other ranks would go on to their
    first collective and die there with a gloo traceback instead of the line."""
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    damaged = edited_folder(folders["moe_hf"], tmp_path / "hf", tensor=(name, (0, 0), math.nan))
    errors = run_ranks(load_on_this_rank, 2, [folders["moe_hf"], damaged])
    assert errors[0] == errors[1] and f"`{name}` holds NaN or infinite values" in str(errors[1])


# model_args.json edits of the MoE checkpoint -> what the one line must say (our field named).
MOE_ARGS: dict[str, tuple[dict[str, Any], str]] = {
    "top-k above the experts": ({"top_k": 16}, "`top_k` (config.json `num_experts_per_tok`) = 16 is more than"),
    "top-k 0": ({"top_k": 0}, "`top_k` (config.json `num_experts_per_tok`) = 0: it must be a whole number"),
    "no experts": ({"n_experts": 0}, "`n_experts` (config.json `num_experts`) = 0: a Mixture-of-Experts needs"),
    "kv heads not dividing": ({"n_kv_heads": 3}, "`n_kv_heads` (config.json `num_key_value_heads`) = 3 does not"),
    "heads 0": ({"n_heads": 0}, "`n_heads` (config.json `num_attention_heads`) = 0: it must be a whole number"),
    "expert width 0": ({"moe_hidden_dim": 0}, "`moe_hidden_dim` (config.json `moe_intermediate_size`) = 0"),
    "norm epsilon negative": ({"norm_eps": -1e-6}, "`norm_eps` (config.json `rms_norm_eps`) = -1e-06"),
    "RoPE base 0": ({"rope_theta": 0.0}, "`rope_theta` (config.json `rope_theta`) = 0.0"),
    "FFN multiple 0": ({"multiple_of": 0}, "`multiple_of` = 0: it must be a whole number of at least 1"),
    "a shared expert": ({"n_shared_experts": 1}, "{'n_shared_experts': 1} cannot be a Qwen3MoeForCausalLM"),
    "a dense first block": ({"n_dense_layers": 1}, "{'n_dense_layers': 1} cannot be a Qwen3MoeForCausalLM"),
    "sigmoid scores": ({"score_func": "sigmoid"}, "{'score_func': 'sigmoid'} cannot be a Qwen3MoeForCausalLM"),
}

LLAMA_ARGS: dict[str, tuple[dict[str, Any], str]] = {
    "vocabulary 0": ({"vocab_size": 0}, "`vocab_size` (config.json `vocab_size`) = 0: it must be a whole number"),
    "kv heads not dividing": ({"n_kv_heads": 3}, "`n_kv_heads` (config.json `num_key_value_heads`) = 3 does not"),
    # q/k norms make the args a Qwen3's (trainer/model/families.py), which has no RoPE scaling.
    "q/k norms": ({"qk_norm": True}, "{'rope_scaling': True} cannot be a Qwen3ForCausalLM"),
    "heads apart from the width": ({"head_size": 64}, "`head_size` = 64, but a LlamaForCausalLM has no q/k norms"),
    "positions 0": ({"max_seq_len": 0}, "`max_seq_len` (config.json `max_position_embeddings`) = 0"),
}


@pytest.mark.parametrize(
    ("family", "case"), [("moe", case) for case in MOE_ARGS] + [("llama", case) for case in LLAMA_ARGS]
)
def test_an_impossible_model_is_not_exported(folders, tmp_path, capsys, family, case):
    edit, message = (MOE_ARGS if family == "moe" else LLAMA_ARGS)[case]
    checkpoint = edited_checkpoint(folders[f"{family}_checkpoint"], tmp_path / "step-1", lambda v: v.update(edit))
    err = refused(convert_to_hf.main, [str(checkpoint), str(tmp_path / "out")], capsys)
    assert f"{checkpoint / MODEL_ARGS_FILE}: " in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_weights_of_the_other_family_are_named_as_such(folders, tmp_path, capsys):
    """A dense checkpoint whose model_args.json says MoE, and the other way round, on export;
    a folder whose config.json names the other family, on import."""
    as_moe = edited_checkpoint(
        folders["llama_checkpoint"],
        tmp_path / "as_moe",
        lambda v: v.update(n_experts=8, top_k=2, moe_hidden_dim=32, qk_norm=True, rope_scaling=False),
    )
    err = refused(convert_to_hf.main, [str(as_moe), str(tmp_path / "out")], capsys)
    assert "its tensors do not match its model_args.json" in err and "are a dense model's (no `experts`)" in err
    moe_as_dense = edited_checkpoint(
        folders["moe_checkpoint"],
        tmp_path / "as_dense",
        lambda v: [v.pop(k) for k in (*MOE_FIELDS, "qk_norm", "head_size") if k in v],
    )
    err = refused(convert_to_hf.main, [str(moe_as_dense), str(tmp_path / "out")], capsys)
    assert "are a Mixture-of-Experts model's (`experts`) but the config describes a dense one" in err, err
    dense_config = json.loads((folders["llama_hf"] / "config.json").read_text())
    moe_folder = edited_folder(folders["moe_hf"], tmp_path / "hf", config={**dense_config, "head_dim": None})
    err = refused(convert_from_hf.main, [str(moe_folder), str(tmp_path / "out")], capsys)
    assert "are a Mixture-of-Experts model's (`experts`)" in err, err
    assert not (tmp_path / "out").exists()


def test_a_value_beyond_the_export_dtype_is_not_written_as_infinity(folders, tmp_path, capsys):
    model = Transformer(MOE)
    model.init_weights(0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    params["layers.1.feed_forward.experts.w2"][6, 3, 1] = 1e5  # finite in float32 and bfloat16
    write_dcp_model(tmp_path / "step-1", params, MOE)
    err = refused(convert_to_hf.main, [str(tmp_path / "step-1"), str(tmp_path / "out"), "--dtype", "float16"], capsys)
    assert "`layers.1.feed_forward.experts.w2` (model.layers.1.mlp.experts.6.down_proj.weight) holds values" in err
    assert "the largest float16 number; export with `--dtype bfloat16` or `--dtype float32`" in err
    assert not (tmp_path / "out").exists()
    convert_to_hf.main([str(tmp_path / "step-1"), str(tmp_path / "out"), "--dtype", "bfloat16"])
    params["layers.0.attention.wk.weight"][0, 0] = math.nan
    write_dcp_model(tmp_path / "nan", params, MOE)
    err = refused(convert_to_hf.main, [str(tmp_path / "nan"), str(tmp_path / "out2")], capsys)
    assert "`layers.0.attention.wk.weight` (model.layers.0.self_attn.k_proj.weight) holds NaN or infinite" in err


def test_the_unedited_folders_convert(folders, tmp_path):
    for family in ("moe", "llama"):
        convert_from_hf.main([str(folders[f"{family}_hf"]), str(tmp_path / family / "checkpoint")])
        convert_to_hf.main([str(folders[f"{family}_checkpoint"]), str(tmp_path / family / "hf")])


def test_the_scripts_themselves_refuse_in_one_line(folders, tmp_path):
    cases = [
        (
            "convert_from_hf.py",
            edited_folder(folders["moe_hf"], tmp_path / "topk", config={"num_experts_per_tok": 16}),
            "`num_experts_per_tok` = 16 is more than `num_experts` = 8",
        ),
        (
            "convert_from_hf.py",
            edited_folder(
                folders["moe_hf"],
                tmp_path / "nan",
                tensor=("model.layers.0.mlp.experts.0.gate_proj.weight", 0, math.nan),
            ),
            "`model.layers.0.mlp.experts.0.gate_proj.weight` holds NaN or infinite values",
        ),
        (
            "convert_to_hf.py",
            edited_checkpoint(folders["moe_checkpoint"], tmp_path / "step-1", lambda v: v.update(top_k=16)),
            "`top_k` (config.json `num_experts_per_tok`) = 16 is more than `n_experts`",
        ),
    ]
    for script, given, message in cases:
        done = run_script(script, given, tmp_path / "out")
        err = done.stderr.strip()
        assert done.returncode == 2 and message in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


TINY = ["--training.steps", "1", "--training.seq_len", "32", "--metrics.enable_tensorboard=false", "--dry-run"]


def test_initial_load_in_hf_refuses_before_launch(folders, tmp_path, capsys, monkeypatch):
    """A folder of the other family, or of an impossible config, given to
    ``checkpoint.initial_load_in_hf``: one line from the plan, before any process starts."""
    monkeypatch.setenv("NGPU", "1")
    impossible = edited_folder(folders["moe_hf"], tmp_path / "topk", config={"num_experts_per_tok": 16})
    cases = [
        (["--model.name", "moe", "--model.flavor", "qwen3_moe_debug"], folders["llama_hf"], "holds a ModelArgs model"),
        ([], folders["moe_hf"], "holds a MoEArgs model"),
        (["--model.name", "moe", "--model.flavor", "qwen3_moe_debug"], impossible, "`num_experts_per_tok` = 16 is"),
    ]
    for flavor, folder, message in cases:
        argv = [*TINY, *flavor, "--job.dump_folder", str(tmp_path / "run")]
        argv += ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
        assert launch.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "config error: `checkpoint.initial_load_path`: " in err and message in err, err
        assert len(err.splitlines()) == 1, err
