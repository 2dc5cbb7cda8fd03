"""Mixture-of-Experts at its real size: the FLOPs a token costs, the routing the planners assume."""

from __future__ import annotations

import pytest

from parallelisms.expert_parallel import AssumedRouting
from trainer.config import load_config
from trainer.entry.launch import main as launch_main
from trainer.metrics import model_flops_per_token
from trainer.model.llama3 import num_params, whole_model
from trainer.model.moe import FLAVORS
from trainer.planning.job_plan import resolve_job


def _hand_count(flavor: str) -> tuple[int, int]:
    """(all parameters but the embedding, those one token passes through), from the shapes."""
    a = FLAVORS[flavor]
    head_dim = a.head_size or a.dim // a.n_heads
    q, kv = a.n_heads * head_dim, a.kv_heads * head_dim
    attention = 2 * a.dim * q + 2 * a.dim * kv + 2 * a.dim + (2 * head_dim if a.qk_norm else 0)
    expert = 3 * a.dim * a.moe_hidden_dim
    router_and_shared = a.dim * a.n_experts + a.n_shared_experts * expert
    dense = a.n_dense_layers * (attention + 3 * a.dim * a.ffn_hidden_dim)
    moe_layers = a.n_layers - a.n_dense_layers
    outside = a.dim + a.vocab_size * a.dim  # final norm, output projection
    total = dense + moe_layers * (attention + router_and_shared + a.n_experts * expert) + outside
    active = dense + moe_layers * (attention + router_and_shared + a.top_k * expert) + outside
    return total, active


@pytest.mark.parametrize(("flavor", "active"), [("debugmoe", 3_678_592), ("qwen3_30b_a3b", 3_041_867_776)])
def test_flops_per_token_count_the_active_parameters(flavor: str, active: int) -> None:
    """MFU's FLOPs per token: 6 x the parameters a token meets (router, shared experts, its k
    routed experts, the dense first blocks, the output) + attention's 12 L h q S; not every expert."""
    args, seq_len = FLAVORS[flavor], 4096
    total, counted = _hand_count(flavor)
    assert num_params(whole_model(args), exclude_embedding=True) == total
    assert counted == active
    attention = args.n_heads * args.head_dim  # Qwen3-30B-A3B: 32 heads of 128 on a width of 2048
    assert model_flops_per_token(args, seq_len) == 6 * active + 12 * args.n_layers * attention * seq_len


@pytest.mark.parametrize(("imbalance", "ep", "rank"), [(1.0, 4, 0), (1.5, 4, 0), (1.5, 8, 3), (2.0, 2, 1), (3.0, 1, 0)])
def test_assumed_routing_sizes_the_busiest_rank(imbalance: float, ep: int, rank: int) -> None:
    """The planned rank receives ``imbalance`` x its share from every source alike, sends all its
    rows, and what it sends itself is what it receives from itself."""
    rows = 8192 * 8
    sent, received = AssumedRouting(imbalance).splits(rows, ep, rank)
    assert len(sent) == len(received) == ep
    assert sum(sent) == rows
    assert sum(received) == (round(rows * imbalance) if ep > 1 else rows)
    assert sent[rank] == received[rank]
    assert max(received) - min(received) <= 1
    assert min(sent) >= 0


@pytest.mark.parametrize(
    ("ngpu", "args", "advice"),
    [
        # One node: ep 1 gathers all 128 experts of a block; 16 per GPU fit a 66 GiB GPU.
        ("8", ["--mesh", "ep=1", "--target.memory_gib", "66"], "`--parallelism.expert_parallel_degree 4`"),
        # Half the node: the float32 state alone is 114 GiB per GPU.
        ("4", ["--mesh", "ep=4"], "dp_shard 8 (8 processes in all"),
        # No checkpointing: 70 GiB of activations, 42 of them the routed tokens'.
        ("8", ["--activation_checkpoint.mode", "none"], "`--activation_checkpoint.mode full`"),
    ],
)
def test_an_oversized_moe_job_exits_2_naming_what_fits(monkeypatch, tmp_path, capsys, ngpu, args, advice):
    monkeypatch.setenv("NGPU", ngpu)
    monkeypatch.chdir(tmp_path)
    code = launch_main(["--config", "qwen3_30b_a3b.toml", "--dry-run", "--target-gpu", "h100", *args])
    out, err = capsys.readouterr()
    assert code == 2 and "experts: 128 routed (top-8)" in out
    assert err.count("\n") == 1 and "this job needs about" in err and advice in err, err


def test_the_imbalance_sizes_the_busiest_rank_in_the_estimate():
    """The busiest rank's routed activations and buffers grow with the stated imbalance; the
    experts' weights and state do not."""
    config = load_config(["--config", "qwen3_30b_a3b.toml", "--activation_checkpoint.mode", "none"])
    balanced, skewed = (resolve_job(config, 8, "cuda", {"routing_imbalance": f}).memory for f in (1.0, 2.0))
    assert skewed.activations > 1.3 * balanced.activations
    assert skewed.fsdp_buffers == balanced.fsdp_buffers


def test_an_imbalance_beyond_every_token_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NGPU", "8")
    monkeypatch.chdir(tmp_path)
    code = launch_main(["--config", "qwen3_30b_a3b.toml", "--dry-run", "--target.routing_imbalance", "9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "at most 8x the average tokens" in err
