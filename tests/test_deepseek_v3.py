"""DeepSeek-V3's shape against transformers' ``DeepseekV3ForCausalLM``: a tiny random model with
every part of the architecture (query and key/value latents, YaRN, a dense first block, group-
limited sigmoid routing with the correction bias and the routed scaling factor, a shared expert)
computes the same logits as ours given its weights; the 671B flavor has DeepSeek's published
parameter counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.checkpoint.folders import model_keys, read_model_args, write_model_args
from trainer.config import load_config
from trainer.config.choices import MOE_FAMILIES
from trainer.metrics.accounting import model_flops_per_token
from trainer.model.deepseek_v3 import FLAVORS, DeepSeekV3Args
from trainer.model.families import FAMILIES, family_of
from trainer.model.llama3 import Transformer, num_params, whole_model
from trainer.model.moe import MoEArgs, active_params
from trainer.planning.job_plan import resolve_job

transformers = pytest.importorskip("transformers")

LOGITS_TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
YARN |= {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_pair() -> tuple[torch.nn.Module, Transformer]:
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=32, rope_parameters=YARN, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            std = 0.5 if name.endswith("gate.weight") else 0.1
            p.copy_(
                1 + 0.3 * torch.randn(p.shape, generator=gen)
                if p.dim() == 1
                else std * torch.randn(p.shape, generator=gen)
            )
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8, generator=gen))
    args = DeepSeekV3Args(
        dim=64, n_layers=3, n_heads=4, vocab_size=256, norm_eps=config.rms_norm_eps, rope_theta=10000.0,
        rope_scaling=False, max_seq_len=32, ffn_hidden_size=96, n_experts=8, top_k=2, moe_hidden_dim=32,
        n_shared_experts=1, n_dense_layers=1, score_func="sigmoid", route_norm=True, route_scale=2.5, n_groups=4,
        topk_groups=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        yarn_factor=4.0, yarn_original_context=8,
    )  # fmt: skip
    ours = Transformer(args).eval()
    ours.load_state_dict(ours_from_hf(hf.state_dict(), args))
    return hf, ours


def ours_from_hf(hf: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    names = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_a_proj": "attention.wq_a", "self_attn.q_a_layernorm": "attention.q_norm",
             "self_attn.q_b_proj": "attention.wq_b", "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
             "self_attn.kv_a_layernorm": "attention.kv_norm", "self_attn.kv_b_proj": "attention.wkv_b",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
             "mlp.down_proj": "feed_forward.w2", "mlp.gate": "feed_forward.router.gate",
             "mlp.shared_experts.gate_proj": "feed_forward.shared_experts.w1",
             "mlp.shared_experts.up_proj": "feed_forward.shared_experts.w3",
             "mlp.shared_experts.down_proj": "feed_forward.shared_experts.w2"}  # fmt: skip
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    for key, tensor in hf.items():
        if not key.startswith("model.layers."):
            continue
        _, _, layer, rest = key.split(".", 3)
        prefix = f"layers.{layer}."
        if rest == "mlp.gate.e_score_correction_bias":
            out[prefix + "feed_forward.expert_bias"] = tensor
        elif rest == "mlp.experts.gate_up_proj":
            gate, up = tensor.split(args.moe_hidden_dim, dim=1)
            out[prefix + "feed_forward.experts.w1"], out[prefix + "feed_forward.experts.w3"] = gate, up
        elif rest == "mlp.experts.down_proj":
            out[prefix + "feed_forward.experts.w2"] = tensor
        else:
            module, _, kind = rest.rpartition(".")
            out[prefix + f"{names[module]}.{kind}"] = tensor
    return out


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
