"""Qwen3 dense as a family of the trainer: its flavors are the config's choices, a checkpoint's
args name it, the memory plan and MFU count a tied matrix once (and its output matmul), and the
attention FLOPs follow the heads, not the width."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.checkpoint.folders import checkpoint_model_differences, model_keys
from trainer.config import load_config
from trainer.config.choices import MODEL_FLAVORS
from trainer.metrics.accounting import model_flops_per_token
from trainer.model.families import FAMILIES, family_of
from trainer.model.llama3 import FLAVORS as LLAMA_FLAVORS
from trainer.model.llama3 import Transformer, num_params, whole_model
from trainer.model.qwen3 import FLAVORS
from trainer.planning.job_plan import resolve_job
from trainer.planning.memory_plan import estimate


def test_the_config_choices_are_the_families_flavors() -> None:
    assert {name: tuple(flavors) for name, flavors in FAMILIES.items()} == MODEL_FLAVORS


def test_a_checkpoint_s_args_name_their_family_and_flavor() -> None:
    assert family_of(FLAVORS["8B"]) == "qwen3" and family_of(LLAMA_FLAVORS["8B"]) == "llama3"
    assert model_keys(FLAVORS["8B"]) == '`model.name` = "qwen3", `model.flavor` = "8B"'
    differ = checkpoint_model_differences(FLAVORS["0.6B"], replace(FLAVORS["0.6B"], tie_embeddings=False))
    assert differ == ["tie_embeddings: True there, False here"]
    assert "model.name: llama3 there, qwen3 here" in checkpoint_model_differences(LLAMA_FLAVORS["8B"], FLAVORS["8B"])


def test_the_tied_matrix_is_one_parameter_counted_once() -> None:
    tied = FLAVORS["0.6B"]
    untied = replace(tied, tie_embeddings=False)
    table = tied.vocab_size * tied.dim
    assert num_params(whole_model(untied)) - num_params(whole_model(tied)) == table
    # FLOPs: the output projection's matmul is there whether its matrix is tied or not.
    assert num_params(whole_model(tied), exclude_embedding=True) == num_params(whole_model(untied), True)
    assert model_flops_per_token(tied, 4096) == model_flops_per_token(untied, 4096)
    model = Transformer(replace(FLAVORS["qwen3_debug"], vocab_size=256))
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("tok_embeddings.weight") == 1


def test_attention_flops_follow_the_heads() -> None:
    """Qwen3-0.6B's 16 heads of 128 are twice its width of 1024: 12 L h q S, not 12 L d S."""
    args, seq = FLAVORS["0.6B"], 4096
    params = num_params(whole_model(args), exclude_embedding=True)
    assert model_flops_per_token(args, seq) == 6 * params + 12 * args.n_layers * 16 * 128 * seq


def test_the_memory_plan_holds_one_table_when_tied() -> None:
    def workload(tie: bool):
        config = load_config(["--config", "qwen3_0_6b.toml"])
        plan = resolve_job(config, 1, "cpu", limit=2**40)  # on the CPU every gradient is counted
        return replace(plan.workload, tied_embeddings=tie)

    tied, untied = workload(True), workload(False)
    assert tied.tied_embeddings  # the plan reads it from the flavor
    table = tied.vocab_size * tied.dim
    assert untied.params - tied.params == table
    # fp32 parameters, gradients and AdamW's two moments: 16 bytes of the second table.
    assert estimate(untied).model_state - estimate(tied).model_state == pytest.approx(16 * table, rel=1e-6)


def test_a_qwen3_folder_s_model_is_built_with_the_tie() -> None:
    model = Transformer(replace(FLAVORS["qwen3_debug"], vocab_size=256))
    model.init_weights(0)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)  # drawn small: see init_std
    with torch.no_grad():
        model.tok_embeddings.weight[3].fill_(1.0)
    assert torch.equal(model.output.weight[3], torch.ones(model.args.dim))
