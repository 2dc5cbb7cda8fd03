"""A tiny ``DeepseekV3ForCausalLM`` with every part of the architecture and our model given its
weights, for the tests that compare the two (``test_deepseek_v3.py``, ``test_hf_deepseek_v3.py``)."""

from __future__ import annotations

import torch
import transformers

from trainer.model.deepseek_v3 import DeepSeekV3Args
from trainer.model.llama3 import Transformer

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
