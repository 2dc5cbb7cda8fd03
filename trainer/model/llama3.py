"""Llama 3: RoPE with Llama-3.1 frequency scaling, grouped-query attention, RMSNorm, SwiGLU.

Parameter names are torchtitan's, so checkpoints and parallelism plans map one to one. The
model is built on the meta device and materialised after sharding; ``init_weights`` then fills
each rank's shards from tile-seeded generators (``tiled_init``), so the initial weights are the
same whatever mesh the parameters are sharded over and whatever device holds them, and a rank
draws only what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.loss import CrossEntropy, cross_entropy_sum, linear_cross_entropy_sum
from trainer.model import rope
from trainer.model.rope import apply_rotary_emb
from trainer.model.tiled_init import fill_local_, stacked_box


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True
    """Llama-3.1 long-context frequency scaling (original context 8192)."""
    rope_scaling_factor: float = 8.0
    """8 for Llama 3.1 (8B, 70B, 405B), 32 for Llama 3.2 (1B, 3B)."""
    max_seq_len: int = 131072
    vocab_from_tokenizer: bool = False
    """Debug flavors take the tokenizer's vocabulary; real flavors keep Llama 3's 128256 rows."""
    head_size: int = 0
    """Per-head width; 0 is ``dim // n_heads`` (Qwen3 sets it apart from the width)."""
    qk_norm: bool = False
    """Qwen3's RMSNorm over each query and key head, before RoPE."""
    ffn_hidden_size: int = 0
    """The dense feed-forward's hidden units; 0 is Llama's sizing from ``multiple_of`` and
    ``ffn_dim_multiplier`` (Qwen3 publishes the width itself)."""
    tie_embeddings: bool = False
    """The output projection is the token embedding's matrix (Qwen3 0.6B to 4B, Llama 3.2)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def attention_width(self) -> float:
        """The query heads' width, averaged over the score (query-key) and value matmuls; a
        latent attention's value heads are narrower than its query heads."""
        return self.n_heads * self.head_dim

    def make_block(self, layer_id: int) -> nn.Module:
        """Block ``layer_id`` of the model these arguments describe (a shape family may have its own)."""
        return TransformerBlock(layer_id, self)

    def rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The RoPE rotations the blocks take (a shape family may rotate other channels)."""
        return rope_frequencies(self, device)

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling=False,
        vocab_from_tokenizer=True,
    ),
    # Llama 3.2 ties the output projection to the embedding; here it is a separate matrix, as
    # in torchtitan, which adds vocab x dim parameters to the published counts.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling_factor=32.0,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling_factor=32.0,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}


def model_args(
    flavor: str, tokenizer_vocab_size: int, seq_len: int, n_layers: int = 0, flavors: Mapping[str, ModelArgs] = FLAVORS
) -> ModelArgs:
    """The flavor's shape, sized for the tokenizer and the training sequence length; ``n_layers``
    blocks instead of the flavor's when it is not 0. ``flavors``: the model family's."""
    if flavor not in flavors:
        raise ValueError(f"`model.flavor` = {flavor} is not of this `model.name`; choose one of {', '.join(flavors)}.")
    args = flavors[flavor]
    if n_layers:
        args = replace(args, n_layers=n_layers)
    if args.vocab_from_tokenizer:
        args = replace(args, vocab_size=padded_vocab_size(tokenizer_vocab_size))
    elif tokenizer_vocab_size > args.vocab_size:
        raise ValueError(
            f"the tokenizer (`model.tokenizer_path`) has {tokenizer_vocab_size} tokens but flavor "
            f"{flavor} has {args.vocab_size} embedding rows; use a tokenizer of at most that size."
        )
    return replace(args, max_seq_len=max(seq_len, 1))


VOCAB_MULTIPLE = 64


def padded_vocab_size(n: int) -> int:
    """``n`` rounded up to a multiple of ``VOCAB_MULTIPLE``.

    Tensor parallelism splits the vocabulary evenly, so its size must divide by the TP degree.
    Padding the same way on every mesh keeps the model, and so the loss, mesh-independent; the
    extra rows are never a label and the model learns to give them no probability.
    """
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def rope_frequencies(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """The model's RoPE table (``rope.frequencies``), Llama 3.1's scaling applied where it is set."""
    scaling = args.rope_scaling_factor if args.rope_scaling else None
    return rope.frequencies(args.head_dim, args.rope_theta, args.max_seq_len, scaling, device)


def causal_attention(
    xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA over ``(batch, heads, seq, head_dim)``, key/value heads repeated for GQA.

    Causal, unless ``attn_mask`` says otherwise: context parallelism passes a causal mask
    aligned to the bottom right when a query chunk attends to a longer run of keys, and document
    masking an additive mask from :func:`document_causal_mask`.
    """
    n_rep = xq.shape[1] // xk.shape[1]
    if n_rep > 1:
        xk = xk.repeat_interleave(n_rep, dim=1)
        xv = xv.repeat_interleave(n_rep, dim=1)
    if attn_mask is None:
        return F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
    return F.scaled_dot_product_attention(xq, xk, xv, attn_mask=attn_mask)


def document_causal_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(batch, 1, seq, seq)``: 0 where a query may see a key (an earlier or the
    same token of its own document), ``-inf`` elsewhere.

    Built once per forward and shared by every block. Additive in the compute dtype rather than
    boolean because SDPA converts a boolean mask to this form on every call, and each block's
    backward would then keep its own copy.
    """
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return additive_mask(causal & (document_ids[:, None, :, None] == document_ids[:, None, None, :]), dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, ``-inf`` elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        # Context parallelism swaps in an attention that sees the other ranks' keys and values.
        self.attention_fn: Callable[..., torch.Tensor] = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: object = None) -> torch.Tensor:
        """``mask``: what ``attention_fn`` takes besides q, k, v (document masking), or None (causal)."""
        bsz, seqlen, _ = x.shape
        # -1 head counts: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        out = self.attention_fn(xq, xk, xv) if mask is None else self.attention_fn(xq, xk, xv, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int = 0):
        """SwiGLU of ``hidden`` units (0: the model's ``ffn_hidden_dim``)."""
        super().__init__()
        hidden = hidden or args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(
        self, layer_id: int, args: ModelArgs, feed_forward: nn.Module | None = None, attention: nn.Module | None = None
    ):
        """``feed_forward``: the block's MLP when it is not the dense SwiGLU (a mixture of experts);
        ``attention`` when it is not grouped-query attention (DeepSeek's latent attention)."""
        super().__init__()
        self.layer_id = layer_id
        self.attention = attention or Attention(args)
        self.feed_forward = feed_forward or FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the output projections keeps the residual stream's variance flat.
        self.output_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        # Activation checkpointing sets this to recompute the block's activations in backward.
        # A function rather than a wrapper module keeps the parameter names unchanged.
        self.checkpoint_fn: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: object = None) -> torch.Tensor:
        if self.checkpoint_fn is not None:
            return self.checkpoint_fn(self._forward, x, freqs_cis, mask)
        return self._forward(x, freqs_cis, mask)

    def _forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: object = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputProjection(nn.Linear):
    """The output projection: logits, or given the labels, their summed cross-entropy computed
    over chunks of ``chunk_tokens`` tokens (``trainer/loss.py``) so that the whole logits never
    exist. Computing the loss inside the module's own call keeps FSDP's gather of the weight and
    tensor parallelism's input and output handling around it, as for the logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.chunk_tokens = 0
        self.cross_entropy: CrossEntropy = cross_entropy_sum
        self.gradients_in_forward = False  # StepPlan.loss_gradients_in_forward

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy_sum(
            h, self.weight, labels, self.chunk_tokens, self.cross_entropy, self.gradients_in_forward
        )


class Transformer(nn.Module):
    # A pipeline stage sets the ends it does not hold to None.
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.RMSNorm | None
    output: OutputProjection | None
    freqs_cis: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."L-1" keeps torchtitan's names and lets blocks be wrapped by name.
        self.layers = nn.ModuleDict({str(i): args.make_block(i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputProjection(args.dim, args.vocab_size)
        self.tie_output()
        self.register_buffer("freqs_cis", args.rope_table(self.tok_embeddings.weight.device), persistent=False)
        # Turns document ids into the blocks' attention mask, once per forward; context
        # parallelism swaps in one that matches its attention (keys gathered from every rank).
        self.attention_mask: Callable[[torch.Tensor, torch.dtype], object] = document_causal_mask

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of ``tokens`` (``batch, seq``), or given ``labels`` (``batch, seq``) the summed
        cross-entropy, computed without the whole logits (``OutputProjection``).

        ``positions`` are the tokens' RoPE positions when they are not ``0..seq-1``: ``(seq,)``
        for every sample (a context-parallel rank holds two separate chunks) or ``(batch, seq)``
        (positions that restart at each packed document). With ``document_ids`` (``batch,
        seq``) a token attends only to earlier tokens of the same document.

        A pipeline stage holds some of the modules (the others are None, so parameter names
        stay those of the whole model): without the embedding ``tokens`` are the previous
        stage's hidden states, without norm and output the hidden states are returned.
        """
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]] if positions is None else self.freqs_cis[positions]
        mask = None if document_ids is None else self.attention_mask(document_ids, h.dtype)
        for layer in self.layers.values():
            h = layer(h, freqs_cis, mask)
        if self.output is None:
            return h
        assert self.norm is not None  # a stage holds norm and output together
        if labels is None:
            return self.output(self.norm(h))
        return self.output(self.norm(h), labels=labels)

    def tie_output(self) -> None:
        """Make the output projection's weight the embedding's, when the model ties them.

        Tensor parallelism swaps each module's weight for a DTensor of its own, so this is done
        again after it (both are split over the vocabulary, ``Shard(0)``); FSDP then shards the
        one parameter once. A stage holding only one end (pipeline parallelism) has nothing to tie.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_std(self, name: str) -> tuple[str, float]:
        """How parameter ``name`` is initialised: ``(kind, std)``. A tied embedding is drawn small
        (Qwen3's 0.02): a token's own logit starts near ``std x dim``, its prediction of itself."""
        if name == "tok_embeddings.weight":
            return ("trunc_normal", 0.02) if self.args.tie_embeddings else ("normal", 1.0)
        if name == "output.weight":
            return "trunc_normal", self.args.dim**-0.5
        if name.endswith("norm.weight"):
            return "ones", 0.0
        inputs = ("wq", "wk", "wv", "w1", "gate", "wq_a", "wq_b", "wkv_a", "wkv_b")  # latent attention's too
        if name.endswith(tuple(f"{n}.weight" for n in inputs) + ("experts.w1",)):
            return "trunc_normal", 0.02
        if name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3")):
            layer = self.layers[name.split(".")[1]]
            assert isinstance(layer, TransformerBlock)
            return "trunc_normal", layer.output_init_std
        raise ValueError(f"no initialisation rule for parameter {name}")

    @torch.no_grad()
    def init_weights(self, seed: int, progress: Callable[[int], None] | None = None) -> None:
        """Fill every parameter (plain or DTensor) and recompute the RoPE table.

        Each value comes from the generator of the tile it lies in, seeded from ``seed``, the
        parameter's name and the tile's place (see ``tiled_init``), drawn on the CPU whatever the
        parameter's device; a rank draws only the tiles its shards overlap. The result is independent of the mesh,
        the sharding and the order of initialisation. ``progress`` is told each parameter's
        global size once it is filled.

        A module holding some of a stacked parameter's slices (expert parallelism's experts)
        says which with ``first_expert`` and ``n_experts``: its slices draw the tiles of their
        place in the whole stack. Modules with ``reset_buffers`` (an MoE's bias and counters)
        reset them.
        """
        for name, param in self.named_parameters():
            kind, std = self.init_std(name)
            local = param.to_local() if isinstance(param, DTensor) else param
            if kind == "ones":
                local.fill_(1.0)
            else:
                offset, _, shape = stacked_box(self.get_submodule(name.rpartition(".")[0]), param)
                fill_local_(local, shape, offset, kind, std, seed, name)
            if progress is not None:
                progress(param.numel())
        for module in self.modules():
            reset = getattr(module, "reset_buffers", None)
            if reset is not None:
                reset()
        self.freqs_cis = self.args.rope_table(self.freqs_cis.device)


def num_params(model: Transformer, exclude_embedding: bool = False) -> int:
    """Parameters, a tied matrix once; ``exclude_embedding`` leaves the embedding out unless it is
    also the output projection (whose matmul the FLOPs count)."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding and model.tok_embeddings is not None and not model.args.tie_embeddings:
        total -= model.tok_embeddings.weight.numel()
    return total


def whole_model(args: ModelArgs) -> Transformer:
    """The unsplit model on the meta device (no memory): what FLOPs and parameter counts describe
    even when a rank holds only some pipeline stages."""
    with torch.device("meta"):
        return Transformer(args)
