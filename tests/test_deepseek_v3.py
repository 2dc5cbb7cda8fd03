"""DeepSeek-V3's shape against transformers' ``DeepseekV3ForCausalLM``: a tiny random model with
every part of the architecture (query and key/value latents, YaRN, a dense first block, group-
limited sigmoid routing with the correction bias and the routed scaling factor, a shared expert)
computes the same logits as ours given its weights; the 671B flavor has DeepSeek's published
parameter counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from deepseek_helpers import tiny_pair

from trainer.checkpoint.folders import model_keys, read_model_args, write_model_args
from trainer.config import load_config
from trainer.config.choices import MOE_FAMILIES
from trainer.metrics.accounting import model_flops_per_token
from trainer.model.deepseek_v3 import FLAVORS
from trainer.model.families import FAMILIES, family_of
from trainer.model.llama3 import num_params, whole_model
from trainer.model.moe import MoEArgs, active_params
from trainer.planning.job_plan import resolve_job

LOGITS_TOL = 1e-5


def test_the_tiny_model_computes_transformers_logits() -> None:
    hf, ours = tiny_pair()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(tokens).logits
        mine = ours(tokens)
    assert (mine - theirs).abs().max().item() < LOGITS_TOL * theirs.abs().max().item()
    # The routing bias moves the choice: without it the logits part.
    with torch.no_grad():
        for layer in list(ours.layers.values())[1:]:
            layer.feed_forward.expert_bias.zero_()
        assert (ours(tokens) - theirs).abs().max().item() > 1e-3


def test_the_671b_flavor_has_deepseek_s_parameter_counts() -> None:
    """671B in all and 37B a token meets (DeepSeek-V3's report; the multi-token prediction module's
    14B are not in the 671B, and not here)."""
    args = FLAVORS["671B"]
    total = num_params(whole_model(args))
    assert total / 1e9 == pytest.approx(671, rel=0.002)
    assert active_params(args, total) / 1e9 == pytest.approx(37, rel=0.02)


def test_the_16b_flavor_has_moonlight_s_parameter_counts() -> None:
    """Moonlight-16B-A3B: 16B in all (15.96B), 3B a token meets."""
    args = FLAVORS["16B"]
    total = num_params(whole_model(args))
    assert total / 1e9 == pytest.approx(15.96, abs=0.01)
    assert active_params(args, total) / 1e9 == pytest.approx(2.9, abs=0.1)


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_the_memory_plan_counts_the_latent_attention_s_parameters(flavor: str) -> None:
    """The plan's parameters (``Workload.params``, from the shapes alone) are the model's, the
    latent projections and their norms included; without the latents they would be Llama's
    attention of ``dim``-wide heads."""
    mesh = ["--training.local_batch_size", "1", "--training.global_batch_size", "-1", "--mesh", "dp_shard=8,ep=8"]
    config = load_config(["--model.name", "deepseek_v3", "--model.flavor", flavor, *mesh])
    plan = resolve_job(config, 8, "cuda")
    assert plan.workload.params == pytest.approx(num_params(whole_model(plan.model_args)), rel=1e-8)
    assert replace(plan.workload, latents=None).params != pytest.approx(plan.workload.params, rel=1e-3)


def test_mfu_counts_the_scores_over_query_heads_and_the_values_over_value_heads() -> None:
    """6 N + 6 L S h (q + v): the query-key matmul over heads of nope + rope channels, the
    value matmul over the narrower value heads (671B: 192 and 128 channels over 128 heads)."""
    args = FLAVORS["671B"]
    params = active_params(args, num_params(whole_model(args), exclude_embedding=True))
    seq = 4096
    assert model_flops_per_token(args, seq) == 6 * params + 6 * args.n_layers * seq * 128 * (192 + 128)


def test_a_checkpoint_s_arguments_read_back_as_deepseek_s(tmp_path) -> None:
    args = FLAVORS["deepseek_v3_debug"]
    assert family_of(args) == "deepseek_v3"
    folder = tmp_path / "step-1"
    folder.mkdir()
    write_model_args(folder, args)
    assert read_model_args(folder) == args
    assert model_keys(args) == '`model.name` = "deepseek_v3", `model.flavor` = "deepseek_v3_debug"'


def test_the_families_that_route_are_those_whose_flavors_have_experts() -> None:
    """``MOE_FAMILIES`` (which settings the ``[moe]`` keys apply to) against the flavors themselves."""
    routing = {name for name, flavors in FAMILIES.items() if all(isinstance(a, MoEArgs) for a in flavors.values())}
    assert routing == set(MOE_FAMILIES)
