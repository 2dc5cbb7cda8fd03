"""What the Hugging Face tests share (``test_hf_interop.py``, ``test_hf_stream.py``): the two
model shapes, each built once with sharpened attention, a bit-exact comparison of state dicts,
and the conversion scripts run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch
from harness import ROOT

from trainer.checkpoint.hf_load import load_hf_weights
from trainer.loss import IGNORE_INDEX
from trainer.model.hf_architectures import adapter_for_config
from trainer.model.llama3 import FLAVORS, ModelArgs, Transformer

SEQ_LEN = 256
SEED = 7

CONFIGS = {
    "debugmodel": replace(FLAVORS["debugmodel"], max_seq_len=SEQ_LEN),
    "gqa_rope_scaling": replace(
        ModelArgs(),
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=64,
        rope_scaling=True,
        rope_scaling_factor=8.0,
        max_seq_len=SEQ_LEN,
    ),
}


@cache
def build_model(name: str) -> Transformer:
    """``CONFIGS[name]`` freshly initialised, with q/k scaled up 10x; built once (init takes seconds).

    At the default 0.02 init, attention is nearly uniform and a wrong RoPE layout moves the
    logits by about 1e-5, the same as round-off; sharper attention makes it ~1e-2. Tests must
    not modify the model.
    """
    model = Transformer(CONFIGS[name])
    model.init_weights(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                param.mul_(10.0)
    return model.eval()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def run_script(name: str, *args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def one_at_a_time(sd: dict[str, torch.Tensor]) -> tuple[Callable[[str], torch.Tensor], list[str]]:
    """A reader of ``sd``'s tensors (a copy each) that fails if any tensor it gave is still alive
    when the next is asked for, and the names in the order asked: an export that streams."""
    alive: list[weakref.ref] = []
    order: list[str] = []

    def read(name: str) -> torch.Tensor:
        held = [ref for ref in alive if ref() is not None]
        assert not held, f"{len(held)} tensor(s) still held when {name} is read"
        order.append(name)
        tensor = sd[name].clone()
        alive.append(weakref.ref(tensor))
        return tensor

    return read, order


def load_ours(hf_dir: Path) -> Transformer:
    """Our model of a Hugging Face folder (its adapter chosen by its ``config.json``), its weights
    read by the trainer's ``checkpoint.initial_load_in_hf`` loader."""
    config = json.loads((hf_dir / "config.json").read_text())
    args = adapter_for_config(config).model_args_from_hf_config(config)
    model = Transformer(args)
    load_hf_weights(model, args, hf_dir)
    return model


def labelled_batch(seed: int, vocab: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of tokens and labels, the last label and four in the first row ignored."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, seq_len), generator=gen)
    labels = torch.randint(0, vocab, (2, seq_len), generator=gen)
    labels[:, -1] = IGNORE_INDEX  # transformers shifts its labels: the last position predicts nothing
    labels[0, 5:9] = IGNORE_INDEX
    return tokens, labels


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels for ours: it predicts ``labels[t + 1]`` at position ``t``."""
    return torch.cat([torch.full((labels.shape[0], 1), IGNORE_INDEX), labels[:, :-1]], dim=1)
