"""Document masking: a packed, masked batch is exactly its documents run one by one.

The definition of right: each document fragment of each window run on its own through the
plain model (positions from 0, causal attention over the fragment only), its token losses
summed over the whole batch and divided by the same N. The masked batch must give that loss
and every gradient within float32 round-off, on one process, on context-parallel meshes of both
masking backends (all-gather K/V and Ulysses, with FSDP, TP, activation checkpointing, compile)
and through pipeline stages. Turning the mask off, or deriving the documents on a shard
instead of the whole sequence, must break the equality.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from harness import GLOBAL_BATCH, MAX_NORM, assert_matches, clipped, full, max_relative_error, run_ranks, trainer_for
from step_helpers import fetch_step, forward_backward

from parallelisms.context_parallel import attend_local_chunks, local_chunk_masks, resolve_backend
from parallelisms.sequence_shards import head_tail_positions
from trainer.config import ConfigError, load_config
from trainer.data.datasets import load_dataset
from trainer.data.documents import document_ids, document_positions, split_documents
from trainer.data.loader import GlobalOrder
from trainer.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.model.llama3 import ModelArgs, Transformer, causal_attention, document_causal_mask
from trainer.planning.job_plan import resolve_job
from trainer.step.batches import MicroBatch

BOS, EOS = 1, 2
SMALL = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, rope_scaling=False, max_seq_len=32
)


def packed_windows(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``[bos] doc [eos] ...`` of random 1-14-token documents, cut into ``seq + 1`` windows
    from an offset inside the first document, so windows start and end mid-document."""
    gen = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    while len(stream) < 5 + batch * (seq + 1):
        n = int(torch.randint(1, 15, (1,), generator=gen))
        stream += [BOS, *torch.randint(3, SMALL.vocab_size, (n,), generator=gen).tolist(), EOS]
    return torch.tensor(stream[5 : 5 + batch * (seq + 1)]).view(batch, seq + 1)


def per_document(model: Transformer, inputs: torch.Tensor, labels: torch.Tensor, bos: int = BOS) -> torch.Tensor:
    """Summed token losses of every document fragment of every window, each run on its own."""
    ids = document_ids(inputs, bos)
    total = torch.zeros(())
    for b in range(inputs.shape[0]):
        for doc in ids[b].unique():
            part = ids[b] == doc
            total = total + cross_entropy_sum(model(inputs[b][part][None]), labels[b][part][None])
    return total


def loss_and_grads(model: Transformer, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_documents_of_a_window():
    tokens = torch.tensor([[7, 8, BOS, 9, EOS, BOS, 5, 6], [BOS, 3, 4, EOS, BOS, BOS, 5, 6]])
    labels = torch.tensor([[8, BOS, 9, EOS, BOS, 5, 6, EOS], [3, 4, EOS, BOS, BOS, 5, 6, BOS]])
    assert document_ids(tokens, BOS).tolist() == [[0, 0, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 3, 3, 3]]
    # The leading fragment (a document begun in an earlier window) counts from 0, as any window does.
    assert document_positions(tokens, BOS).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 0, 1, 2]]
    within, _, _ = split_documents(tokens, labels, BOS)
    x = IGNORE_INDEX
    assert within.tolist() == [[8, x, 9, EOS, x, 5, 6, EOS], [3, 4, EOS, x, x, 5, 6, x]]


def attentive_model() -> Transformer:
    """The small model with query and key weights scaled up: at initialisation the attention
    is nearly uniform, which would hide a wrong mask or wrong positions in round-off."""
    model = Transformer(SMALL)
    model.init_weights(3)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wq.weight.mul_(10)
            block.attention.wk.weight.mul_(10)
    return model


def test_masked_packed_batch_equals_documents_on_their_own():
    model = attentive_model()
    window = packed_windows(3, 32)
    inputs, labels, positions, ids = (window[:, :-1], *split_documents(window[:, :-1], window[:, 1:], BOS))
    assert int((ids.max(dim=1).values >= 2).sum()) == 3  # every window holds several documents
    n = int((labels != IGNORE_INDEX).sum())

    want_loss, want = loss_and_grads(model, lambda: per_document(model, inputs, labels) / n)
    got_loss, got = loss_and_grads(model, lambda: cross_entropy_sum(model(inputs, positions, ids), labels) / n)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)

    def grads_with(positions: torch.Tensor | None, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return loss_and_grads(model, lambda: cross_entropy_sum(model(inputs, positions, ids), labels) / n)[1]

    # RoPE sees relative positions only: within a masked document, positions 0.. or the
    # window's own give the same loss up to round-off. What breaks it is positions derived on
    # pieces of the sequence (a CP shard), restarting inside a document; and no mask at all.
    assert max_relative_error(grads_with(None, ids), want) < 1e-5
    halves = torch.cat([document_positions(half, BOS) for half in inputs.chunk(2, dim=1)], dim=1)
    for wrong in (grads_with(positions, None), grads_with(halves, ids)):
        assert max_relative_error(wrong, want) > 1e-2


@pytest.mark.parametrize("degree", [2, 3])
def test_simulated_cp_ranks_with_document_masks_equal_masked_attention(degree):
    """One process plays every CP rank: the chunk masks see exactly the keys the full mask does."""
    torch.manual_seed(0)
    batch, heads, kv_heads, chunk, dim = 2, 4, 2, 5, 8
    seq = 2 * degree * chunk
    q = torch.randn(batch, heads, seq, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, heads, seq, dim, dtype=torch.float64)
    ids = document_ids(packed_windows(batch, seq, seed=1)[:, :-1], BOS)
    expected = causal_attention(q, k, v, document_causal_mask(ids, torch.float64))
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    out = torch.empty_like(expected)
    for rank in range(degree):
        pos = head_tail_positions(seq, rank, degree)
        masks = local_chunk_masks(ids, rank, degree, torch.float64)
        out[:, :, pos] = attend_local_chunks(causal_attention, q[:, :, pos], k, v, rank, degree, masks)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), upstream), expected_grads):
        torch.testing.assert_close(got, want)


def test_masking_a_kind_without_documents_is_a_config_error():
    with pytest.raises(ConfigError, match=r"training\.document_mask.*shakespeare_dialogue"):
        load_config(["--training.dataset", "shakespeare_dialogue", "--training.document_mask"])


def test_ring_attention_with_document_mask_is_a_config_error(monkeypatch):
    """On CUDA, ``auto`` picks the all-gather-K/V backend for masked documents; ``ring`` is refused."""
    assert resolve_backend("auto", "cuda", document_mask=True) == "allgather_kv"
    assert resolve_backend("auto", "cuda") == "ring"
    monkeypatch.setattr("trainer.planning.job_plan.device_type", lambda: "cuda")
    argv = [
        "--training.document_mask",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_backend",
        "ring",
    ]
    with pytest.raises(ConfigError, match=r"context_parallel_backend.*training\.document_mask"):
        resolve_job(load_config(argv), 2)


@pytest.mark.slow
def test_compiled_blocks_do_not_recompile_for_new_document_layouts():
    """The mask's shape depends on the batch and sequence only, never on where documents fall.

    Recompiling is dynamo's decision (its guards), the same with any backend: ``aot_eager``
    checks it in seconds where inductor would spend half a minute generating code.
    """
    model = attentive_model()
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    for step in range(3):
        window = packed_windows(2, 32, seed=step)
        inputs, (labels, positions, ids) = window[:, :-1], split_documents(window[:, :-1], window[:, 1:], BOS)
        cross_entropy_sum(model(inputs, positions, ids), labels).backward()
        if step == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")


# --------------------------------------------------------------------------------------------
# Through the trainer: packed data of short documents, on context-parallel meshes
# --------------------------------------------------------------------------------------------

WORDS = [
    "the",
    "king",
    "queen",
    "lord",
    "speak",
    "night",
    "day",
    "love",
    "death",
    "sword",
    "crown",
    "fair",
    "foul",
    "heaven",
    "earth",
    "blood",
]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """A .jsonl of 120 documents of 2-30 words: a 64-token window holds several."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("documents") / "documents.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(2, 30)))}) for _ in range(120)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def masked_argv(data: str, local_batch_size: int, extra: list[str]) -> list[str]:
    return [
        "--training.dataset",
        "shakespeare",
        "--training.dataset_path",
        data,
        "--training.document_mask",
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
        "--training.local_batch_size",
        str(local_batch_size),
        "--training.max_norm",
        str(MAX_NORM),
        "--training.steps",
        "1",
        "--debug.seed",
        "7",
        "--metrics.enable_tensorboard=false",
        *extra,
    ]


def per_document_reference(argv: list[str]) -> tuple[dict, dict]:
    """The first global batch, every document fragment run on its own by the unsharded model;
    and the same windows and labels unmasked (one attention over each whole window)."""
    p = resolve_job(load_config(argv), world_size=1)
    dataset = load_dataset(p.config, p.tokenizer, p.global_batch_size)
    model = Transformer(p.model_args)
    model.init_weights(p.config.debug.seed)
    samples = [dataset[i] for i in GlobalOrder(len(dataset), GLOBAL_BATCH, p.config.debug.seed).batch(0)]
    inputs = torch.stack([s[0] for s in samples])
    labels, _, ids = split_documents(inputs, torch.stack([s[1] for s in samples]), p.tokenizer.bos_id)
    assert (ids.max(dim=1).values >= 2).all()  # every window holds several documents
    n = int((labels != IGNORE_INDEX).sum())
    masked = loss_and_grads(model, lambda: per_document(model, inputs, labels, p.tokenizer.bos_id) / n)
    unmasked = loss_and_grads(model, lambda: cross_entropy_sum(model(inputs), labels) / n)
    out = []
    for loss, grads in (masked, unmasked):
        norm = torch.stack([g.double().square().sum() for g in grads.values()]).sum().sqrt().item()
        out.append({"loss": loss, "norm": norm, "n": n, "grads": clipped(grads)})
    return out[0], out[1]


ULYSSES = ["--parallelism.context_parallel_backend", "ulysses"]
MESHES = {
    "dp_shard=2 x cp=2, 2 micro-batches, AC full": (
        2,
        ["--mesh", "dp_shard=2,cp=2", "--activation_checkpoint.mode", "full"],
    ),
    "cp=2 x tp=2, AC per op": (8, ["--mesh", "cp=2,tp=2", "--activation_checkpoint.mode", "selective"]),
    "ulysses dp_shard=2 x cp=2, 2 micro-batches": (2, ["--mesh", "dp_shard=2,cp=2", *ULYSSES]),
    "ulysses cp=2 x tp=2, compile + AC per op": (
        8,
        ["--mesh", "cp=2,tp=2", *ULYSSES, "--activation_checkpoint.mode", "selective", "--compile.enable"]
        + ["--compile.components", "model"],
    ),
    "pp=2 x dp_shard=2, 2 micro-batches": (2, ["--mesh", "pp=2,dp_shard=2"]),
    "pp=2 x cp=2 ulysses, Interleaved1F1B": (
        8,
        ["--mesh", "pp=2,cp=2", *ULYSSES, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    ),
}
"""Four ranks each (local batch size, extra argv), run in one process group."""


def masked_step(argv: list[str]) -> dict:
    """One step through the trainer; every rank returns its step result and the full gradients
    of the parameters it holds (under PP, its stages'), to be merged over the ranks. Under PP
    also the pipeline's forward-only summed loss of the rank's samples (what validation runs)."""
    _, parts = trainer_for(argv)
    microbatches = fetch_step(parts)
    result = forward_backward(parts, microbatches)
    grads = {name: full(prm.grad) for name, prm in parts.model.named_parameters()}
    out = {"loss": result.loss_avg, "norm": result.grad_norm, "n": result.n_valid_tokens, "grads": grads}
    if parts.pipeline is not None:
        batch = [torch.cat([getattr(mb, field) for mb in microbatches]) for field in MicroBatch._fields]
        out["evaluated"] = parts.pipeline.evaluate(*batch).item()
    return out


def meshes_worker(argvs: dict[str, list[str]]) -> dict[str, dict]:
    return {name: masked_step(argv) for name, argv in argvs.items()}


@pytest.mark.slow
def test_masked_meshes_equal_documents_on_their_own(short_documents):
    """Context parallel (both masking backends) and pipeline meshes equal the per-document
    reference, and differ from the same batch unmasked."""
    ref, unmasked = per_document_reference(masked_argv(short_documents, GLOBAL_BATCH, []))
    assert max_relative_error(unmasked["grads"], ref["grads"]) > 1e-2
    argvs = {name: masked_argv(short_documents, local_batch, extra) for name, (local_batch, extra) in MESHES.items()}
    ranks = run_ranks(meshes_worker, 4, argvs)
    for name in MESHES:
        result = {**ranks[0][name], "grads": {k: v for r in ranks for k, v in r[name]["grads"].items()}}
        for r in ranks:
            assert r[name]["n"] == result["n"] and r[name]["loss"] == pytest.approx(result["loss"], rel=1e-6)
        assert_matches(result, ref)
        assert max_relative_error(result["grads"], unmasked["grads"]) > 1e-2, name
        if name.startswith("pp=2"):  # ranks 0 and 1: the first stage's two data or CP shards
            evaluated = ranks[0][name]["evaluated"] + ranks[1][name]["evaluated"]
            assert evaluated == pytest.approx(ref["loss"] * ref["n"], rel=1e-5), name
