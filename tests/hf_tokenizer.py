"""A small Hugging Face ``tokenizer.json`` shaped like Llama 3's, built locally (nothing is
downloaded): byte-level BPE with Llama 3's pre-tokenizer pattern and its special tokens, trained
in about a second on a few of the bundled plays."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.sources import read_shakespeare_plays

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
)


def _trained_bpe(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Llama 3's pre-tokenizer pattern, trained on a few of the bundled plays."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([play.text for play in read_shakespeare_plays()[:3]], trainer=trainer)
    return tokenizer


def build(folder: Path, vocab_size: int = 700, eos: str = "<|end_of_text|>") -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``; return the former."""
    tokenizer = _trained_bpe(vocab_size)
    tokenizer.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": eos,
                "chat_template": LLAMA3_CHAT_TEMPLATE,
            }
        )
    )
    return folder / "tokenizer.json"


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_THINK = ["<think>", "</think>"]  # added tokens that are not special, as in Qwen3's tokenizer.json
# Qwen3's rules for a finished conversation, written for these tests: ChatML turns; an assistant
# message's think part kept only after the last user message, and always opened on the last one.
QWEN3_CHAT_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m.content %}{% set reasoning = '' %}"
    "{% if m.role == 'assistant' and '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + content }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
)


def build_qwen(folder: Path, vocab_size: int = 700) -> Path:
    """A Qwen-shaped ``tokenizer.json``: byte-level BPE, ChatML's special tokens, no BOS (its
    ``tokenizer_config.json`` says ``bos_token: null``), ``<|im_end|>`` as EOS."""
    tokenizer = _trained_bpe(vocab_size)
    tokenizer.add_special_tokens(QWEN_SPECIALS)
    tokenizer.add_tokens(QWEN_THINK)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": QWEN3_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"
