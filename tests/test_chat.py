"""Chat fine-tuning: the Llama 3 and Qwen3 (ChatML) renderings are the models' templates token for token, labels
are valid exactly on the assistant's tokens, truncation never keeps a sample without a label and
reports what it dropped, and bad lines name file:line. (The loss is the same on every mesh:
``test_run_train.py`` runs chat with a Llama-3-style tokenizer on three meshes.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_tokenizer import LLAMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, build, build_qwen

from trainer.data.chat import render, uses_chatml_format, uses_llama3_format
from trainer.data.samples import build_dataset
from trainer.data.tokenizer import load_tokenizer
from trainer.loss import IGNORE_INDEX
from trainer.runtime.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
SENTENCEPIECE = str(ROOT / "assets" / "tokenizer" / "shakespeare.model")
CONVERSATION = (
    ("system", "Answer in verse."),
    ("user", "Who art thou?"),
    ("assistant", " A player, sir. "),
    ("user", "And what of it?"),
    ("assistant", "Nothing more."),
)


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(build(tmp_path_factory.mktemp("llama3_style"))))


def chats(path: Path, conversations: list[list[tuple[str, str]]]) -> Path:
    lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) for conv in conversations]
    path.write_text("\n".join(lines) + "\n")
    return path


def trained_text(tokenizer, tokens: list[int], targets: list[int]) -> str:
    return tokenizer.decode([t for t, keep in zip(tokens, targets) if keep])


def test_llama3_rendering_is_the_chat_template(llama3) -> None:
    transformers = pytest.importorskip("transformers")
    reference_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(llama3.path), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    expected = reference_tokenizer.apply_chat_template(messages, chat_template=LLAMA3_CHAT_TEMPLATE, tokenize=True)
    tokens, targets = render(CONVERSATION, llama3)
    assert uses_llama3_format(llama3)
    assert tokens == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    # Labels: every assistant content and its <|eot_id|>, nothing else (no header, no user text).
    assert trained_text(llama3, tokens, targets) == "A player, sir.<|eot_id|>Nothing more.<|eot_id|>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(build_qwen(tmp_path_factory.mktemp("qwen_style"))))


THINKING = (
    ("user", "Who art thou?"),
    ("assistant", "<think>\nA riddle.\n</think>\n\nA player."),
    ("user", "And now?"),
    ("assistant", "<think>Still a riddle.</think>A king."),
)


@pytest.mark.parametrize(
    "conversation", [CONVERSATION, THINKING, CONVERSATION[:3]], ids=["plain", "thinking", "one turn"]
)
def test_chatml_rendering_is_qwen3_s_template(qwen, conversation) -> None:
    """Token for token what Qwen3's rules render: no BOS, the think part of earlier turns dropped,
    the last answer's kept (an empty think block when it has none)."""
    transformers = pytest.importorskip("transformers")
    reference_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(qwen.path), eos_token="<|im_end|>")
    messages = [{"role": r, "content": c} for r, c in conversation]
    expected = reference_tokenizer.apply_chat_template(messages, chat_template=QWEN3_CHAT_TEMPLATE, tokenize=True)
    tokens, targets = render(conversation, qwen)
    assert uses_chatml_format(qwen) and not uses_llama3_format(qwen)
    assert tokens == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert qwen.bos_id == qwen.token_id("<|endoftext|>")  # no BOS: documents open with the separator
    trained = trained_text(qwen, tokens, targets)
    last = conversation[-1][1].split("</think>")[-1]
    assert trained.endswith(f"</think>\n\n{last}<|im_end|>")
    assert "<|im_start|>" not in trained and "user" not in trained


def test_chatml_labels_are_the_assistant_bodies(qwen) -> None:
    tokens, targets = render(THINKING, qwen)
    assert trained_text(qwen, tokens, targets) == (
        "A player.<|im_end|><think>\nStill a riddle.\n</think>\n\nA king.<|im_end|>"
    )
    assert qwen.decode(tokens).startswith("<|im_start|>user\nWho art thou?<|im_end|>\n<|im_start|>assistant\nA player.")


def test_plain_rendering(llama3) -> None:
    sentencepiece = load_tokenizer(SENTENCEPIECE)
    assert not uses_llama3_format(sentencepiece)
    tokens, targets = render(CONVERSATION, sentencepiece)
    assert tokens[0] == sentencepiece.bos_id
    assert sentencepiece.decode(tokens) == (
        "system: Answer in verse.\n\nuser: Who art thou?\n\nassistant: A player, sir.user: And what of it?\n\n"
        "assistant: Nothing more."
    )
    trained = [t for t, keep in zip(tokens, targets) if keep]
    assert trained.count(sentencepiece.eos_id) == 2 and trained[-1] == sentencepiece.eos_id
    assert sentencepiece.decode(trained) == "A player, sir.Nothing more."


def test_labels_are_exactly_the_assistant_tokens(llama3, tmp_path: Path) -> None:
    data = chats(tmp_path / "chat.jsonl", [list(CONVERSATION), [("user", "Hi"), ("assistant", "Hail!")]])
    dataset = build_dataset("chat", str(data), llama3, 96)
    for index, conversation in enumerate([CONVERSATION, (("user", "Hi"), ("assistant", "Hail!"))]):
        tokens, targets = render(conversation, llama3)
        inputs, labels = dataset[index]
        assert inputs[: len(tokens)].tolist() == tokens
        assert (inputs[len(tokens) :] == llama3.pad_id).all()
        expected = [t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], targets[1:])]
        assert len(tokens) < 96 and labels.tolist() == expected + [IGNORE_INDEX] * (96 - len(expected))


def test_truncation_keeps_a_label_or_drops_and_reports(llama3, tmp_path: Path) -> None:
    long_question = " ".join(["Speak"] * 80)
    data = chats(
        tmp_path / "chat.jsonl",
        [
            [("user", "Hi"), ("assistant", "Hail! " * 40)],  # cut inside the answer: kept
            [("user", long_question), ("assistant", "Aye.")],  # the answer starts past the cut: dropped
            [("user", "Anyone?"), ("system", "Silence.")],  # no assistant: dropped
            [("user", "Bye"), ("assistant", "Farewell.")],
        ],
    )
    dataset = build_dataset("chat", str(data), llama3, 32)
    assert len(dataset) == 2
    stats = dataset.chat_stats
    assert (stats.conversations, stats.truncated, stats.dropped_by_truncation, stats.without_assistant) == (4, 2, 1, 1)
    assert "2 of 4 conversations kept" in stats.describe(32) and "raise `training.seq_len`" in stats.describe(32)
    assert all((dataset[i][1] != IGNORE_INDEX).any() for i in range(len(dataset)))
    _tokens, targets = render((("user", "Hi"), ("assistant", "Hail! " * 40)), llama3)
    assert (dataset[0][1] != IGNORE_INDEX).sum() == sum(targets[1:33]) > 10  # the answer up to the cut
    # The report survives the token cache.
    assert build_dataset("chat", str(data), llama3, 32).chat_stats == stats
    with pytest.raises(DataError, match="yields no chat samples.*raise `training.seq_len`"):
        build_dataset(
            "chat", str(chats(tmp_path / "none.jsonl", [[("user", long_question), ("assistant", "Aye.")]])), llama3, 32
        )


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"messages": []}', 'no "messages" list'),
        ('{"text": "hi"}', 'no "messages" list'),
        ('{"messages": [{"role": "user"}]}', 'message 1 needs a non-empty string "role" and a string "content"'),
        ('{"messages": [{"role": "", "content": "x"}]}', "message 1 needs"),
        ("[1, 2]", 'no "messages" list'),
        ("{oops", "invalid JSON"),
    ],
)
def test_bad_lines_name_file_and_line(llama3, tmp_path: Path, line: str, match: str) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    data = tmp_path / "chat.jsonl"
    data.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataError, match=f"chat.jsonl:3: {match}"):
        build_dataset("chat", str(data), llama3, 32)


def test_bundled_plays_make_conversations() -> None:
    tokenizer = load_tokenizer(SENTENCEPIECE)
    dataset = build_dataset("chat", None, tokenizer, 128)
    counts = torch.stack([(dataset[i][1] != IGNORE_INDEX).sum() for i in range(0, len(dataset), 97)])
    assert len(dataset) > 5000 and (counts > 0).all() and len(set(counts.tolist())) > 10
